"""torch.compile of the expert-parallel no-sync layer on gloo ranks against eager."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from compile_cases import (
    CONFIG,
    EP_ROW,
    RECOMPUTE,
    SEED,
    SEQUENCES,
    assert_breaks_as_documented,
    assert_close_to_eager,
    token_batches,
    train_steps,
)
from distributed_harness import run_ranks
from torch._dynamo.utils import counters

from moe_engine.compile import graph_breaks
from moe_engine.config import ParallelConfig
from moe_engine.host_sync import forbid_host_sync, profile_host_syncs
from moe_engine.parallel.pipeline import cross_entropy

# The documented row is the per-expert exchange (the per-rank one compiles into more graphs: not yet in the table).
EP_NO_SYNC = ParallelConfig(dp=2, ep=2, dispatch="no-sync", capacity_factor=2.0, dispatch_rows="per-expert")
GROUPED_MM_CALLS_PER_STEP = 6
"""Grouped GEMMs of one expert forward + backward: 2 fprop, 2 dgrad, 2 wgrad."""


def _ep_rank() -> dict:
    """Eager, then compiled, on this rank of ``EP_NO_SYNC``: training, and a profiled forward and backward."""
    from moe_engine.parallel.groups import build_process_groups
    from moe_engine.parallel.layout import Layout

    groups = build_process_groups(Layout(EP_NO_SYNC))
    rows = slice(groups.coords.dp_rank * SEQUENCES, (groups.coords.dp_rank + 1) * SEQUENCES)
    tokens, labels = next(token_batches(CONFIG, SEQUENCES * EP_NO_SYNC.dp, SEED + 1))
    variants = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        run = train_steps(CONFIG, EP_NO_SYNC, groups, RECOMPUTE["none"], compiled, rows=rows)
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
        assert_close_to_eager(compiled, eager, "fp32")
        for label, variant in rank.items():
            outside = [s for s in variant["syncs"] if not s[1]]
            assert outside == [], f"{label}: host syncs outside the grouped GEMM: {outside[:3]}"
            # The CPU kernel reads each local expert's offset once per GEMM; nothing else syncs.
            assert len(variant["syncs"]) == GROUPED_MM_CALLS_PER_STEP * local_experts * CONFIG.n_moe_layers, label
        assert compiled["frames_after_profile"] == compiled["frames"][-1]
        assert_breaks_as_documented(EP_ROW, compiled, compiled["breaks"])
