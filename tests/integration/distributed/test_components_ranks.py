"""Rank models built from the layout on gloo ranks: their dispatchers and experts."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from component_models import GQA
from distributed_harness import run_ranks

from moe_engine import build_model
from moe_engine.config import DispatchKind, ParallelConfig
from moe_engine.moe.dedup_dispatch import DedupDispatcher
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import build_rank_model

# (name, layout); the expected dispatcher of each is written out in _expected.
LAYOUTS = [
    ("per-expert-sync", ParallelConfig(dp=4, ep=2, dispatch="sync", dispatch_rows="per-expert", a2a_chunks=2)),
    ("per-rank-no-sync", ParallelConfig(dp=4, ep=4, capacity_factor=2.0, dispatch_rows="per-rank")),
    ("auto-two-nodes", ParallelConfig(dp=4, ep=4, ranks_per_node=2, dispatch="sync")),
]


def _expected(name: str, rank: int) -> dict:
    """By hand: the dispatcher class, its settings and group sizes, and the experts (8) rank holds."""
    if name == "per-expert-sync":  # ep groups {0, 1} and {2, 3}: ep rank = rank % 2, 4 experts each
        return dict(
            cls="AllToAllDispatcher",
            kind="sync",
            cf=1.25,
            chunks=2,
            sizes=[2],
            held=range(4 * (rank % 2), 4 * (rank % 2) + 4),
        )
    if name == "per-rank-no-sync":
        return dict(
            cls="DedupDispatcher", kind="no-sync", cf=2.0, chunks=1, sizes=[4], held=range(2 * rank, 2 * rank + 2)
        )
    # Two nodes of two ranks: per-node rows, a level between nodes then one inside the node.
    return dict(cls="DedupDispatcher", kind="sync", cf=1.25, chunks=1, sizes=[2, 2], held=range(2 * rank, 2 * rank + 2))


def _describe(layer: MoELayer) -> dict:
    d = layer.dispatcher
    groups = [level.group for level in d.levels] if isinstance(d, DedupDispatcher) else [d.group]
    return dict(
        cls=type(d).__name__,
        kind=d.kind.value,
        cf=d.capacity_factor,
        chunks=d.chunks,
        sizes=[dist.get_world_size(g) for g in groups],
        fused=(d.fused_kernels, layer.experts.fused_kernels, layer.router.fused_kernels),
        held=layer.experts.global_experts,
        experts=(layer.experts.gate_up.detach().clone(), layer.experts.down.detach().clone()),
    )


def _rank_job() -> dict:
    out = {}
    for fused in (True, False):
        config = dataclasses.replace(GQA, fused_kernels=fused)
        for name, parallel in LAYOUTS:
            groups = build_process_groups(Layout(parallel))
            rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), seed=11)
            out[name, fused] = [_describe(layer) for layer in rank_model.moe_layers()]
            if fused and name == "per-expert-sync":
                spec = DispatchSpec.from_parallel(parallel, groups)
                out["spec"] = (
                    spec.ep,
                    spec.ep_rank,
                    spec.kind,
                    spec.a2a_chunks,
                    spec.rows.value,
                    spec.group is groups.ep,
                )
    return out


@pytest.mark.slow
def test_rank_models_build_their_dispatchers_and_experts_from_the_layout():
    """Four gloo ranks, three layouts, fused and eager: each MoE layer's dispatcher class, kind, capacity
    factor, chunks, groups and fused switch are the layout's and config's, its experts the rank's block
    with the single-process model's values (same seed), all from the build alone."""
    outcomes = run_ranks(_rank_job, 4, timeout=240.0)
    reference = build_model(GQA, seed=11)
    full = [(m.experts.gate_up.detach(), m.experts.down.detach()) for m in reference.moe_layers()]
    for rank, out in enumerate(outcomes):
        for name, _ in LAYOUTS:
            want = _expected(name, rank)
            for fused in (True, False):
                layers = out[name, fused]
                assert len(layers) == 2
                for layer, (gate_up, down) in zip(layers, full):
                    got = {k: layer[k] for k in want}
                    assert got == want, (name, rank)
                    assert layer["fused"] == (fused, fused, fused), (name, rank)
                    block = slice(want["held"].start, want["held"].stop)
                    assert torch.equal(layer["experts"][0], gate_up[block]), (name, rank, fused)
                    assert torch.equal(layer["experts"][1], down[block]), (name, rank, fused)
        assert out["spec"] == (2, rank % 2, DispatchKind.SYNC, 2, "per-expert", True)
