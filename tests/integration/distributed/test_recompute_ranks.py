"""Recompute under every rank layout on gloo ranks trains like no recompute."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from distributed_harness import run_ranks
from recompute_cases import MODES, SEQUENCES, assert_same_training, small_config, train_steps

from moe_engine.config import ParallelConfig, RecomputeConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout

# ---- several ranks: the same layout with and without recompute ----

LAYOUTS = {
    "ep2-no-sync": ParallelConfig(dp=2, ep=2, dispatch="no-sync", capacity_factor=2.0, microbatches=2),
    "ep2-sync-zero1": ParallelConfig(dp=2, ep=2, dispatch="sync", optimizer_sharding="zero1"),
    "pp2-1f1b": ParallelConfig(pp=2, schedule="1f1b", microbatches=4),
    "fsdp-dp2": ParallelConfig(dp=2, dp_mode="fsdp"),
    "dp2-pp2-ep2-gpipe": ParallelConfig(dp=2, ep=2, pp=2, schedule="gpipe", microbatches=2, capacity_factor=2.0),
}
CASES = [
    ("ep2-no-sync", "full"),
    ("ep2-no-sync", "all-parts"),
    ("ep2-sync-zero1", "full"),
    ("ep2-sync-zero1", "experts"),
    ("pp2-1f1b", "full-first-1-per-stage"),
    ("pp2-1f1b", "attention"),
    ("fsdp-dp2", "full"),
    ("dp2-pp2-ep2-gpipe", "full"),
]


def _layout_job(parallel: ParallelConfig, mode: str):
    groups = build_process_groups(Layout(parallel))
    share = SEQUENCES // parallel.dp
    rows = slice(groups.coords.dp_rank * share, (groups.coords.dp_rank + 1) * share)
    out = {}
    for name, recompute in (("none", RecomputeConfig()), (mode, MODES[mode])):
        out[name] = train_steps(small_config(), parallel, recompute, groups, rows)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout, mode", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_recompute_under_every_layout_trains_like_no_recompute(layout, mode):
    parallel = LAYOUTS[layout]
    for rank in run_ranks(_layout_job, parallel.world_size, parallel, mode, timeout=240):
        reference, got = rank["none"], rank[mode]
        assert got["recomputed"], "every rank recomputes its chosen blocks"
        if reference["losses"][0] is None:  # a pipeline stage without the loss
            assert got["losses"][0] is None
            got["losses"] = reference["losses"] = [torch.zeros(())]
        assert_same_training(got, reference)
