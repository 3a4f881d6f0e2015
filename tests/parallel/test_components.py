"""Every component of a built model is chosen at its construction, from the configs: the fused
kernels' switch of each module and the dispatcher of each MoE layer (class, settings, groups, held
experts), with no call after the build. The expectations are written out from the configs here, not
read back from the engine's own mapping.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

from moe_engine import build_model
from moe_engine.config import DispatchKind, ModelConfig, MoEConfig, ParallelConfig
from moe_engine.model import Block, Transformer
from moe_engine.modules.mlp import SwiGLU
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding
from moe_engine.moe.dedup_dispatch import DedupDispatcher
from moe_engine.moe.dispatch import AllToAllDispatcher, LocalDispatcher
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.router import Router
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import build_rank_model

# A dense first block, qk-norm, a shared expert: every module kind that takes the switch.
GQA = ModelConfig(
    vocab_size=64,
    d_model=16,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    n_dense_layers=1,
    dense_hidden=24,
    qk_norm=True,
    dtype="fp32",
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=12, shared_expert_hidden=8),
)
# Multi-head latent attention: its own norms (query and key-value latents).
MLA = dataclasses.replace(
    GQA,
    head_dim=None,
    qk_norm=False,
    n_kv_heads=4,
    mla=dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4),
)

# Module kinds that take the switch, and how many of each the configs above build (by hand:
# norms: 2 per block + final (+ 2 qk-norms per block, or 2 latent norms per MLA block); SwiGLU: the
# dense block's FFN + one shared expert per MoE block).
SWITCHED = (Transformer, Block, RMSNorm, SwiGLU, RotaryEmbedding, Router, GroupedExperts, MoELayer)
COUNTS = {
    "gqa": {Transformer: 1, Block: 3, RMSNorm: 13, SwiGLU: 3, RotaryEmbedding: 1, Router: 2},
    "mla": {Transformer: 1, Block: 3, RMSNorm: 13, SwiGLU: 3, RotaryEmbedding: 1, Router: 2},
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_a_built_model_holds_the_switch_of_its_config_in_every_module(name, fused):
    config = dataclasses.replace({"gqa": GQA, "mla": MLA}[name], fused_kernels=fused)
    model = build_model(config)
    found = {kind: [m for m in model.modules() if type(m) is kind] for kind in SWITCHED}
    for kind, count in COUNTS[name].items():
        assert len(found[kind]) == count, kind.__name__
    for kind, modules in found.items():
        assert all(m.fused_kernels is fused for m in modules), kind.__name__
    for layer in found[MoELayer]:
        assert type(layer.dispatcher) is LocalDispatcher and layer.dispatcher.fused_kernels is fused
        assert layer.experts.backend.fused_swiglu is fused
        assert layer.experts.global_experts == range(8)
    # Every other module says nothing about fused kernels: none was missed above.
    assert not [type(m).__name__ for m in model.modules() if type(m) not in SWITCHED and hasattr(m, "fused_kernels")]


def test_a_model_built_with_the_other_switch_takes_the_same_weights_and_loss():
    """The eager model is built from its own config and given the fused one's weights: the same
    parameter names and shapes, and, on a CPU where the fused ops run their eager compositions, the
    same loss."""
    tokens = torch.randint(0, GQA.vocab_size, (2, GQA.seq_len), generator=torch.Generator().manual_seed(3))
    fused = build_model(GQA, seed=5)
    eager = build_model(dataclasses.replace(GQA, fused_kernels=False), seed=6)
    eager.load_state_dict(fused.state_dict())
    torch.testing.assert_close(fused.loss(tokens, tokens), eager.loss(tokens, tokens), rtol=1e-6, atol=1e-6)


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


def test_a_spec_refuses_what_its_layout_cannot_hold():
    with pytest.raises(ValueError, match="need an expert-parallel group"):
        DispatchSpec(ep=2)
    assert DispatchSpec.from_parallel(ParallelConfig(), None).local
    assert DispatchSpec().local_experts(6) == range(6)
    assert isinstance(DispatchSpec().build(GQA.moe, 16, 1, True), LocalDispatcher)
    assert not isinstance(DispatchSpec().build(GQA.moe, 16, 1, True), AllToAllDispatcher)
