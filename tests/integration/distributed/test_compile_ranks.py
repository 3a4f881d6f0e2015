"""torch.compile of the expert-parallel no-sync layer on gloo ranks against eager."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch._dynamo
from distributed_harness import run_ranks
from tolerances import model_tolerance
from torch._dynamo.utils import counters

import moe_engine.compile as compile_module
from bench.results import REPO_ROOT
from moe_engine.compile import graph_breaks
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, RecomputeConfig, RecomputePart
from moe_engine.host_sync import forbid_host_sync, profile_host_syncs
from moe_engine.parallel.pipeline import cross_entropy
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, routing="random", shared_expert_hidden=16),
    # The reference step: the graph-break table below is the unfused model's.
    fused_kernels=False,
)
# lr 1 and eps 1 make the updates nearly proportional to the gradients (as in tests/integration/distributed/test_trainer.py):
# Adam's normalisation would turn the rounding noise of near-zero gradients into full-size updates.
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0)
SEQUENCES, STEPS = 4, 3
# Fixed, so that a failure replays exactly (the model's init and the batches derive from it).
SEED = 1234
RECOMPUTE = {
    "none": RecomputeConfig(),
    "full": RecomputeConfig(mode="full"),
    "selective": RecomputeConfig(mode="selective", parts=list(RecomputePart)),
}
# Every fp32 model compiled here is CONFIG or one of its size (the widest sum: the 96-word vocabulary).
FP32_TOLERANCE = (
    model_tolerance(CONFIG, SEQUENCES * CONFIG.seq_len, gradients=False),
    model_tolerance(CONFIG, SEQUENCES * CONFIG.seq_len),
)
TOLERANCE = {"fp32": FP32_TOLERANCE, "bf16": (1e-3, 2**-4), "mxfp8": (1e-3, 2**-2)}
"""(loss rtol, gradient tolerance relative to the gradient's largest magnitude), see the module docstring."""
# The documented row is the per-expert exchange (the per-rank one compiles into more graphs: not yet in the table).
EP_NO_SYNC = ParallelConfig(dp=2, ep=2, dispatch="no-sync", capacity_factor=2.0, dispatch_rows="per-expert")
GROUPED_MM_CALLS_PER_STEP = 6
"""Grouped GEMMs of one expert forward + backward: 2 fprop, 2 dgrad, 2 wgrad."""


def documented_breaks() -> dict[str, tuple[int, list[str]]]:
    """The table of docs/compile-and-host-syncs.md: backend -> (graphs, break sites)."""
    lines = (REPO_ROOT / "docs" / "compile-and-host-syncs.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*backend\s*\|\s*graphs\s*\|\s*breaks", line))
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        backend, graphs, sites = (cell.strip() for cell in line.strip("|").split("|"))
        table[backend] = (int(graphs), [s.strip() for s in sites.split(",")])
    return table


def _batches(config: ModelConfig, sequences: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, config.vocab_size, (sequences, config.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _train(config, parallel, groups, recompute, compiled, seed=SEED, rows=slice(None)):
    """Losses, every step's gradients, and dynamo's compiled graphs and frames after each step."""
    rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), seed, recompute, compile=compiled)
    trainer = ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)
    params = dict(rank_model.module.named_parameters())
    losses, grads, graphs, frames = [], [], [], []
    for tokens, labels in _batches(config, SEQUENCES * parallel.dp, seed):
        losses.append(trainer.step(tokens[rows], labels[rows]))
        grads.append({n: trainer.optimizer.grad_view(p).float().clone() for n, p in params.items()})
        graphs.append(counters["stats"]["unique_graphs"])
        frames.append(counters["frames"]["total"])
    return {"losses": torch.stack(losses), "grads": grads, "graphs": graphs, "frames": frames, "rank_model": rank_model}


def _assert_close(compiled, eager, precision: str) -> None:
    loss_rtol, grad_tol = TOLERANCE[precision]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=loss_rtol, atol=0)
    for step, (got, want) in enumerate(zip(compiled["grads"], eager["grads"])):
        for name, grad in want.items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                got[name],
                grad,
                rtol=0,
                atol=grad_tol * scale,
                msg=lambda m, step=step, name=name: f"step {step}, gradient of {name}: {m}",
            )


"""The single-process rows of the docs page's table; the expert-parallel row is measured on 2 ranks below."""
EP_ROW = "expert-parallel no-sync dispatch (ep 2)"


def _assert_breaks_as_documented(row: str, run: dict, breaks: list[tuple[str, str]]) -> None:
    """The documented graphs, all compiled on the first step (no frame compiled after it), and breaks."""
    documented_graphs, documented_sites = documented_breaks()[row]
    assert run["graphs"] == [documented_graphs] * STEPS, f"{row}: graphs after each step {run['graphs']}"
    assert run["frames"] == [run["frames"][0]] * STEPS, f"{row}: frames compiled after each step {run['frames']}"
    assert [site for site, _ in breaks] == documented_sites, f"{row}: measured {breaks}"
    assert {reason for _, reason in breaks} == {compile_module.EAGER_REASON}, f"{row}: measured {breaks}"


def _ep_rank() -> dict:
    """Eager, then compiled, on this rank of ``EP_NO_SYNC``: training, and a profiled forward and backward."""
    from moe_engine.parallel.groups import build_process_groups
    from moe_engine.parallel.layout import Layout

    groups = build_process_groups(Layout(EP_NO_SYNC))
    rows = slice(groups.coords.dp_rank * SEQUENCES, (groups.coords.dp_rank + 1) * SEQUENCES)
    tokens, labels = next(_batches(CONFIG, SEQUENCES * EP_NO_SYNC.dp, SEED + 1))
    variants = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        run = _train(CONFIG, EP_NO_SYNC, groups, RECOMPUTE["none"], compiled, rows=rows)
        model = run["rank_model"].model
        # Forward and backward, as tests/unit/moe_engine/moe/test_host_sync.py checks them (the optimizer's own syncs,
        # AdamW reading its step count on CPU, are not the dispatch's), after training: nothing compiles
        # any more. The guard's dispatch mode would make dynamo run every frame eagerly (measured: no
        # compiled region runs under it), so the compiled variant has the profiler alone.
        with contextlib.nullcontext() if compiled else forbid_host_sync():
            syncs = profile_host_syncs(lambda model=model: cross_entropy(model(tokens[rows]), labels[rows]).backward())
        variants["compiled" if compiled else "eager"] = {
            "losses": run["losses"],
            "grads": run["grads"],
            "graphs": run["graphs"],
            "frames": run["frames"],
            "frames_after_profile": counters["frames"]["total"],
            "breaks": graph_breaks(),
            "syncs": [(s.name, s.inside("aten::_grouped_mm"), s.stack[:4]) for s in syncs],
        }
    return variants


@pytest.mark.slow
def test_expert_parallel_no_sync_compiled_matches_eager_without_host_syncs():
    """On 2 gloo ranks with ep 2: compiled losses and gradients are eager's, and compiling adds no host
    sync to the no-sync path: the profile of the compiled code that training ran (nothing compiles
    again) has the grouped GEMM kernel's syncs and no other, as eager's has."""
    local_experts = CONFIG.moe.num_experts // EP_NO_SYNC.ep
    for rank in run_ranks(_ep_rank, 2, timeout=300):
        eager, compiled = rank["eager"], rank["compiled"]
        _assert_close(compiled, eager, "fp32")
        for label, variant in rank.items():
            outside = [s for s in variant["syncs"] if not s[1]]
            assert outside == [], f"{label}: host syncs outside the grouped GEMM: {outside[:3]}"
            # The CPU kernel reads each local expert's offset once per GEMM; nothing else syncs.
            assert len(variant["syncs"]) == GROUPED_MM_CALLS_PER_STEP * local_experts * CONFIG.n_moe_layers, label
        assert compiled["frames_after_profile"] == compiled["frames"][-1]
        _assert_breaks_as_documented(EP_ROW, compiled, compiled["breaks"])
