"""The proxy records each gradient bucket's overlap windows: the backward left after its reduction
launched and the optimizer updates left after its ZeRO-1 gather launched, with the proxy's own work of
fabricating peers' data left out."""

import dataclasses
import time

import pytest
import torch

from bench.predict.proxy_projection import unbucketed_calls
from bench.run.proxy.measure import bucket_measurements, measure_rank, sync_table
from bench.run.proxy.rank import peers
from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
from bench.run.proxy.scale import run_spec
from bench.scenario import scenario_from_dict

SLEEP_S = 0.01
"""Added to every fabrication of peers' rows: a window that kept fabrication would hold these."""

SPEC = {
    "schema_version": 1,
    "name": "sync-windows-proxy",
    "mode": "proxy",
    "model": {
        "vocab_size": 256,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "seq_len": 32,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 64},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "bf16",
    "parallel": {
        "dp": 2,
        "ep": 2,
        "microbatches": 2,
        "optimizer_sharding": "zero1",
        "dispatch": "no-sync",
        "capacity_factor": 1.25,
    },
    "run": {"tokens_per_step": 2 * 2 * 2 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 0, "threads": 1},
    "cluster": {"gpus": 2, "gpus_per_node": 2, "gpu_memory_gib": 1, "peak_tflops": 1},
}
# Small buckets, so that several launch while the last backward still runs.
BUCKET_ELEMENTS = 8192


@pytest.fixture(scope="module")
def measured():
    scenario = scenario_from_dict(SPEC)
    spec, scale = run_spec(scenario, torch.device("cpu"))
    run_scenario = scenario_from_dict(spec)
    run_scenario.parallel_config = dataclasses.replace(run_scenario.parallel_config, bucket_elements=BUCKET_ELEMENTS)
    repeat_rows = peers.repeat_rows

    def slow_repeat_rows(rows_RD, num_rows):
        time.sleep(SLEEP_S)
        return repeat_rows(rows_RD, num_rows)

    peers.repeat_rows = slow_repeat_rows
    join_fake_world(scale.rank, scenario.world_size)
    try:
        result, _ = measure_rank(run_scenario, scale, torch.device("cpu"))
    finally:
        leave_fake_world()
        peers.repeat_rows = repeat_rows
    return result


def test_every_measured_step_records_every_bucket(measured):
    assert len(measured.syncs) == SPEC["run"]["steps"]
    assert len(measured.buckets) > 4 and all(len(step) == len(measured.buckets) for step in measured.syncs)
    # Each bucket's collectives are the ones the step issued: none is missing from the recorded calls, and
    # no reduce-scatter or gather is left once they are taken out.
    buckets = bucket_measurements(measured, sync_table(measured))
    left = unbucketed_calls(measured.calls, buckets)
    assert not [c for c in left if c.op in ("reduce_scatter", "all_gather")]
    assert sum(b.reduce is not None for b in buckets) == sum(c.op == "reduce_scatter" for c in measured.calls)
    # A reduce-scatter sends the bucket's fp32 gradients, its gather the parameters: bf16, fp32 for the routers.
    for b in buckets:
        if b.reduce is not None:
            assert b.reduce.nbytes in (b.gather.nbytes, 2 * b.gather.nbytes)


def test_windows_shrink_in_launch_order_and_leave_fabrication_out(measured):
    for step in measured.syncs:
        reduce = [row["reduce_window_s"] for row in step]
        gather = [row["gather_window_s"] for row in step]
        assert reduce == sorted(reduce, reverse=True) and gather == sorted(gather, reverse=True)
        first = step[0]
        compute = first["reduce_window_compute_s"]
        # The first bucket launches inside the blocks' backward: block compute and several exchanges
        # with the peers, each fabricated (and slept in), are still ahead of it.
        assert compute["blocks"] > 0
        # Lower bounds only, which load cannot break: a sleep lasts at least its length, and a window
        # that counted fabrication as compute (in "rest" or a block class) would lose these sleeps.
        assert first["reduce_window_s"] - sum(compute.values()) > 2 * SLEEP_S
        # A gather hides under the updates of the buckets after it: its window holds every one of them.
        for index, row in enumerate(step):
            later = sum(r["update_s"] for r in step[index + 1 :])
            assert row["gather_window_s"] >= later * (1 - 1e-9)
            assert row["update_s"] > 0
