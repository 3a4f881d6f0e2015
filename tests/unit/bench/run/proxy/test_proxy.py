"""Proxy scenarios: validation, the scaled run, the collective census, the projections and a whole proxy run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from proxy_scenario import tiny

from bench.predict.collectives import Collective, Network
from bench.predict.proxy_projection import (
    BucketMeasurement,
    CallScaling,
    ProjectionTarget,
    StageSize,
    StepMeasurement,
    classify_calls,
    project_full_scale,
    project_run_scale,
    scaled_sync_buckets,
)
from bench.results import REPO_ROOT
from bench.run.collective_log import CollectiveCall
from bench.run.proxy.scale import ProxyScale, run_spec
from bench.scenario import ScenarioError, load_scenario, scenario_from_dict

OLMO_DIR = REPO_ROOT / "scenarios" / "olmo-core3"


@pytest.mark.parametrize(
    "change,field",
    [
        ({"proxy.rank": 8}, "proxy.rank"),
        ({"parallel.dp_mode": "fsdp", "parallel.ep": 1, "parallel.optimizer_sharding": "none"}, "parallel.dp_mode"),
        ({"parallel.schedule": "interleaved1f1b", "parallel.virtual_stages": 2}, "parallel.virtual_stages"),
    ],
)
def test_proxy_scenarios_refuse_what_a_proxy_cannot_replay(change, field):
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(tiny(**change))
    assert err.value.field_path == field


def test_proxy_scenarios_need_a_cluster():
    spec = tiny()
    del spec["cluster"]
    with pytest.raises(ScenarioError, match="cluster"):
        scenario_from_dict(spec)


def test_the_1_2t_proxy_scales_down_on_cpu_only():
    scenario = load_scenario(OLMO_DIR / "moe-1.2t-512gpu-proxy.yaml")
    spec, scale = run_spec(scenario, torch.device("cpu"))
    # Stage 0 of 8 holds 7 of the 56 blocks; 16.8M tokens over dp 64 and 64 microbatches: 1 sequence of 4096.
    assert (scale.blocks_run, scale.blocks_full) == (1, 7)
    assert (scale.tokens_per_microbatch_run, scale.tokens_per_microbatch_full) == (32, 4096)
    # cpu_scale.microbatches: 2 instead of the 8 that 1F1B keeps in flight on stage 0.
    assert (scale.microbatches_run, scale.microbatches_full) == (2, 64)
    assert spec["model"]["n_layers"] == 8 and spec["model"]["seq_len"] == 32
    assert spec["run"]["tokens_per_step"] == 64 * 2 * 32
    assert spec["precision"] == "fp32" and scenario.precision == "bf16"
    # The experts keep their shapes.
    assert spec["model"]["moe"] == scenario.spec["model"]["moe"] and spec["model"]["d_model"] == 8192
    spec, scale = run_spec(scenario, torch.device("cuda"))
    assert (scale.blocks_run, scale.tokens_per_microbatch_run) == (7, 4096)
    assert spec["model"]["n_layers"] == 56 and spec["precision"] == "bf16"
    assert (scale.microbatches_run, scale.microbatches_full) == (8, 64)  # 1F1B's in-flight count on a GPU


def test_without_cpu_scale_microbatches_the_cpu_run_keeps_the_in_flight_count():
    data = yaml.safe_load((OLMO_DIR / "moe-1.2t-512gpu-proxy.yaml").read_text())
    del data["proxy"]["cpu_scale"]["microbatches"], data["proxy"]["cpu_scale"]["precision"]
    spec, scale = run_spec(scenario_from_dict(data), torch.device("cpu"))
    assert (scale.microbatches_run, spec["precision"]) == (8, "bf16")


def test_collectives_split_into_microbatch_and_step_entries():
    ep, dp = (0, 1), (0, 1, 2, 3)
    calls = [CollectiveCall("all_to_all", ep, 100 + i, "ep") for i in range(8)]  # 2 per microbatch, sizes vary
    calls += [CollectiveCall("send", (0, 4), 64, "pp")] * 4
    calls += [CollectiveCall("reduce_scatter", dp, 4096, "dp"), CollectiveCall("all_reduce", dp, 8, "world")]
    per_microbatch, per_step = classify_calls(calls, {"ep": "expert", "pp": "pipeline", "dp": "grad"}, microbatches=4)
    assert sorted(per_microbatch, key=lambda c: c.op) == [
        Collective("all_to_all", ep, round(sum(100 + i for i in range(8)) / 8), "expert", 2),
        Collective("send", (0, 4), 64, "pipeline", 1),
    ]
    assert sorted(per_step, key=lambda c: c.op) == [
        Collective("all_reduce", dp, 8, "other", 1),
        Collective("reduce_scatter", dp, 4096, "grad", 1),
    ]
    with pytest.raises(RuntimeError, match="do not split"):
        classify_calls(calls[:3], {"ep": "expert"}, microbatches=2)

    # At the scenario's scale: 32x the tokens per microbatch, 7x the blocks, 3x the dense parameters.
    scaling = CallScaling(token_ratio=32, block_ratio=7, param_ratio={"dp": 3.0})
    per_microbatch, per_step = classify_calls(
        calls, {"ep": "expert", "pp": "pipeline", "dp": "grad"}, microbatches=4, scaling=scaling
    )
    assert sorted(per_microbatch, key=lambda c: c.op) == [
        Collective("all_to_all", ep, round(sum(32 * (100 + i) for i in range(8)) / 8), "expert", 14),
        Collective("send", (0, 4), 32 * 64, "pipeline", 1),
    ]
    assert sorted(per_step, key=lambda c: c.op) == [
        Collective("all_reduce", dp, 8, "other", 1),
        Collective("reduce_scatter", dp, 3 * 4096, "grad", 1),
    ]


# A measured step at the run's scale, made up: 1 of the stage's 8 blocks, 128 of 4096 tokens per microbatch,
# 2 of 16 microbatches, on rank 0 of 16 (4 GPUs per node, pp 2: dp 8).
SCALE = ProxyScale(
    rank=0,
    pp_rank=0,
    blocks_run=1,
    blocks_full=8,
    seq_len_run=128,
    tokens_per_microbatch_run=128,
    tokens_per_microbatch_full=4096,
    microbatches_run=2,
    microbatches_full=16,
)
PHASES_S = {
    "attention": {"forward": 0.010, "backward": 0.020},
    "router": {"forward": 0.001, "backward": 0.002},
    "dispatch": {"forward": 0.002, "backward": 0.003},
    "experts": {"forward": 0.030, "backward": 0.060},
    "shared_expert": {"forward": 0.004, "backward": 0.008},
    "block": {"forward": 0.001, "backward": 0.001},
    "embedding": {"forward": 0.003, "backward": 0.005},
    "optimizer": {"forward": 0.040, "backward": 0.0},
    "grad_buffers": {"forward": 0.006, "backward": 0.0},
    "fabrication": {"forward": 0.5, "backward": 0.5},  # the proxy's own work: scaled with nothing
    "other": {"forward": 0.004, "backward": 0.0},
}
COMPUTE_S = 0.200
EP, PP, DP, EDP, WORLD = (0, 1, 2, 3), (0, 8), (0, 4), (0, 8), tuple(range(16))
CALLS = (
    # 2 dispatch/combine all-to-alls per microbatch, 2 microbatches; sync dispatch sends different sizes
    [CollectiveCall("all_to_all", EP, nbytes, "ep") for nbytes in (1000, 1400, 1000, 1400)]
    + [CollectiveCall("send", PP, 512, "pp")] * 2
    + [
        CollectiveCall("reduce_scatter", DP, 4000, "dp"),
        CollectiveCall("all_reduce", EDP, 6000, "edp"),
        CollectiveCall("all_reduce", WORLD, 8, "world"),
    ]
)
MEASURED = StepMeasurement(
    COMPUTE_S,
    PHASES_S,
    CALLS,
    group_phases={"ep": "expert", "pp": "pipeline", "dp": "grad", "edp": "grad"},
    family_groups={"dense": "dp", "expert": "edp"},
)
# Dense parameters x3, local expert parameters x6, optimizer state x7, gradient buffers x5.
RUN = StageSize(dense_params=1000, expert_params=2000, optimizer_bytes=12_000, grad_bytes=6_000)
FULL = StageSize(dense_params=3000, expert_params=12_000, optimizer_bytes=84_000, grad_bytes=30_000)
NET = Network(gpus_per_node=4, intra_node_gbps=100, inter_node_gbps=10, latency_us=10)
TARGET = ProjectionTarget(rank=0, world_size=16, pp=2, schedule="1f1b", net=NET)
ALPHA, INTRA, INTER = 10e-6, 100e9, 10e9


def test_the_full_scale_projection_scales_each_part_by_its_own_rule():
    step = project_full_scale(MEASURED, SCALE, RUN, FULL, TARGET, tokens_per_step=8 * 16 * 4096, flops_per_token=6e9)

    # The blocks: attention .030 + router .003 + dispatch .005 + experts .090 + shared expert .012 + block .002
    # = .142 s per step of 2 microbatches, x 8 blocks x 32 tokens. The embedding .008 unscaled. The rest:
    # compute .200 - optimizer .040 - grad buffers .006 - embedding .008 - blocks .142 = .004, x 32 tokens.
    assert step.microbatch_phases_s == pytest.approx(
        {
            "blocks": 0.142 * 8 * 32 / 2,
            "rest": 0.004 * 32 / 2,
            "embedding": 0.008 / 2,
        }
    )
    microbatch_s = (0.142 * 8 * 32 + 0.004 * 32 + 0.008) / 2  # 18.244
    assert step.timing.microbatch_s == pytest.approx(microbatch_s)
    # Once per step: the optimizer x 84000 / 12000 optimizer bytes, the gradient buffers x 30000 / 6000.
    assert step.step_phases_s == pytest.approx({"optimizer": 0.040 * 7, "grad_buffers": 0.006 * 5})
    assert step.timing.optimizer_s == pytest.approx(0.28 + 0.03)

    # All-to-all bytes x 32 tokens, their count (4 over 2 microbatches) x 8 blocks; stage messages x 32 tokens;
    # dense gradients x 3, expert gradients x 6; the world all-reduce as recorded.
    assert sorted(step.per_microbatch, key=lambda c: c.op) == [
        Collective("all_to_all", EP, (32 * 1000 + 32 * 1400) // 2, "expert", 2 * 8),
        Collective("send", PP, 32 * 512, "pipeline", 1),
    ]
    assert sorted(step.per_step, key=lambda c: (c.op, c.phase)) == [
        Collective("all_reduce", EDP, 6 * 6000, "grad", 1),
        Collective("all_reduce", WORLD, 8, "other", 1),
        Collective("reduce_scatter", DP, 3 * 4000, "grad", 1),
    ]

    # The step, priced by hand: the all-to-all stays on node 0 (4 of 4 ranks there), the others cross nodes.
    a2a = 16 * (3 * ALPHA + 38_400 * 3 / 4 / INTRA)
    send = ALPHA + 16_384 / INTER
    t_mb = microbatch_s + a2a + send
    grad = (ALPHA + 12_000 / 2 / INTER) + (2 * ALPHA + 2 * 36_000 / 2 / INTER)
    other = 2 * 15 * ALPHA + 2 * 15 / 16 * 8 / INTER
    # 1F1B over 2 stages: (16 microbatches + 1) t_mb; no buckets were measured, so the gradient collectives
    # launch when the backward ends: all exposed.
    step_s = 17 * t_mb + grad + 0.31 + other
    projection = step.projection
    assert projection.step_s == pytest.approx(step_s)
    assert projection.breakdown_s == pytest.approx(
        {
            "compute": 16 * microbatch_s,
            "expert_comm": 16 * a2a,
            "pipeline_comm": 16 * send,
            "bubble": t_mb,
            "grad_sync_exposed": grad,
            "grad_sync_hidden": 0.0,
            "grad_sync_total": grad,
            "optimizer": 0.31,
            "param_gather_exposed": 0.0,
            "param_gather_hidden": 0.0,
            "param_gather_total": 0.0,
            "other_comm": other,
            "fsdp_gather_exposed": 0.0,
            "fsdp_gather_total": 0.0,
            "skew": 0.0,
            "expert_comm_hidden": 0.0,
            "expert_comm_total": 16 * a2a,  # one chunk: nothing overlaps
        }
    )
    assert projection.tokens_per_s_per_gpu == pytest.approx(8 * 16 * 4096 / step_s / 16)
    assert projection.tflops_per_gpu == pytest.approx(6e9 * 8 * 16 * 4096 / step_s / 16 / 1e12)


def test_the_run_scale_projection_prices_the_step_as_measured():
    step = project_run_scale(MEASURED, SCALE, TARGET, tokens_per_step=8 * 2 * 128, flops_per_token=1e9)
    # Everything but the optimizer and the gradient buffers, over the 2 microbatches that ran.
    microbatch_s = (0.200 - 0.040 - 0.006) / 2
    assert step.timing.microbatch_s == pytest.approx(microbatch_s)
    assert step.timing.optimizer_s == pytest.approx(0.046)
    assert sorted(step.per_microbatch, key=lambda c: c.op) == [
        Collective("all_to_all", EP, 1200, "expert", 2),
        Collective("send", PP, 512, "pipeline", 1),
    ]
    a2a = 2 * (3 * ALPHA + 1200 * 3 / 4 / INTRA)
    t_mb = microbatch_s + a2a + ALPHA + 512 / INTER
    grad = (ALPHA + 4000 / 2 / INTER) + (2 * ALPHA + 2 * 6000 / 2 / INTER)
    other = 2 * 15 * ALPHA + 2 * 15 / 16 * 8 / INTER
    assert step.projection.step_s == pytest.approx((2 + 1) * t_mb + grad + 0.046 + other)


def test_stage_sizes_come_from_the_plan_of_the_replayed_stage():
    plan = {
        "stages": [
            {"dense_params": 1, "local_expert_params": 2, "memory_bytes": {"optimizer": 3, "grads": 4, "params": 9}},
            {
                "dense_params": 10,
                "local_expert_params": 20,
                "memory_bytes": {"optimizer": 30, "grads": 40, "params": 90},
            },
        ]
    }
    assert StageSize.from_plan(plan, 1) == StageSize(
        dense_params=10, expert_params=20, optimizer_bytes=30, grad_bytes=40
    )


# ---- overlap windows: the run's buckets at the scenario's scale ------------------------------------

RUN_DP = CollectiveCall("all_reduce", DP, 1000, "dp")


def bucket(
    blocks: float,
    rest: float,
    embedding: float,
    launches: float,
    update_s: float,
    share: float = 1.0,
    filled: bool = True,
    gather: bool = True,
) -> BucketMeasurement:
    return BucketMeasurement(
        RUN_DP,
        CollectiveCall("all_gather", DP, 500, "dp") if gather else None,
        share,
        filled,
        {"blocks": blocks, "rest": rest, "embedding": embedding, "grad_buffers": launches},
        update_s,
    )


# Two filled buckets of block parameters, launched with 0.6 and 0.2 s of the 1.0 s of the blocks' backward
# left, then the embedding bucket, launched as the backward ends.
BUCKETS = [bucket(0.6, 0.01, 0.3, 0.02, 0.1), bucket(0.2, 0.01, 0.3, 0.01, 0.2), bucket(0, 0, 0, 0, 0.5, share=0.0)]


def test_overlap_windows_at_the_run_scale_are_the_measured_ones():
    reduces, gathers = scaled_sync_buckets(BUCKETS, blocks_backward_s=1.0)
    assert [b.window_s for b in reduces] == pytest.approx([0.6 + 0.01 + 0.3 + 0.02, 0.2 + 0.01 + 0.3 + 0.01, 0.0])
    assert [b.collective for b in reduces] == [Collective("all_reduce", DP, 1000, "grad")] * 3
    # A gather's window: the updates of the buckets after it.
    assert [b.window_s for b in gathers] == pytest.approx([0.2 + 0.5, 0.5, 0.0])
    assert [b.collective.nbytes for b in gathers] == [500] * 3


def test_overlap_windows_at_the_scenario_scale_repeat_the_block_buckets():
    # 3 copies of the run's blocks, 4x the tokens: a block bucket's copy k still has its own blocks' rest
    # plus 2 - k whole copies of the blocks' backward ahead, each x 4 tokens; the rest, the embedding and
    # the launches as measured.
    reduces, gathers = scaled_sync_buckets(BUCKETS, blocks_backward_s=1.0, block_ratio=3, token_ratio=4)
    first = [(0.6 + 2 - k) * 4 + 0.01 + 0.3 + 0.02 for k in range(3)]  # 10.73, 6.73, 2.73
    second = [(0.2 + 2 - k) * 4 + 0.01 + 0.3 + 0.01 for k in range(3)]  # 9.12, 5.12, 1.12
    assert [b.window_s for b in reduces] == pytest.approx(
        [first[0], second[0], first[1], second[1], first[2], second[2], 0.0]
    )
    # Each copy carries one copy's bytes; the embedding bucket keeps its own.
    assert [b.collective.nbytes for b in reduces] == [1000] * 7
    # Updates: copy k of the first bucket has the second bucket's (0.2) and 2 - k more copies of both
    # (0.3 each) ahead, then the embedding's 0.5; copy k of the second: 2 - k copies and the embedding.
    assert [b.window_s for b in gathers] == pytest.approx([1.3, 1.1, 1.0, 0.8, 0.7, 0.5, 0.0])


def test_a_fractional_block_ratio_splits_copies_and_a_mixed_or_open_bucket_stays_whole():
    # 3.5 copies of the blocks: 4 copies of 3.5 / 4 of the bytes, each copy's blocks x 3.5 / 4.
    reduces, _ = scaled_sync_buckets([bucket(0.5, 0, 0, 0, 0.1)], blocks_backward_s=1.0, block_ratio=3.5)
    assert [b.window_s for b in reduces] == pytest.approx([(0.5 + 3 - k) * 3.5 / 4 for k in range(4)])
    assert [b.collective.nbytes for b in reduces] == [875] * 4
    # Half block parameters (the embedding with a block's norm): one bucket, its block half x 3;
    # an unfilled block bucket (open to the end of the walk) also stays one, with all its bytes x 3.
    mixed = bucket(0.5, 0.1, 0, 0, 0.1, share=0.5)
    open_bucket = bucket(0.0, 0.1, 0.2, 0, 0.1, filled=False)
    reduces, gathers = scaled_sync_buckets([mixed, open_bucket], blocks_backward_s=1.0, block_ratio=3, token_ratio=2)
    assert [(b.window_s, b.collective.nbytes) for b in reduces] == [
        (pytest.approx(0.5 * 2 * 3 + 0.1), 2000),
        (pytest.approx(0.1 + 0.2), 3000),
    ]
    # The mixed bucket's gather hides under the open bucket's update, which grows x 3 with its bytes.
    assert [(b.window_s, b.collective.nbytes) for b in gathers] == [(pytest.approx(0.3), 1000), (0.0, 1500)]


def test_the_projections_price_the_buckets_instead_of_their_recorded_calls():
    dense = BucketMeasurement(
        CollectiveCall("reduce_scatter", DP, 4000, "dp"),
        None,
        1.0,
        True,
        {"blocks": 0.01, "rest": 0.0, "embedding": 0.004, "grad_buffers": 0.0},
        0.01,
    )
    expert = BucketMeasurement(
        CollectiveCall("all_reduce", EDP, 6000, "edp"),
        None,
        1.0,
        True,
        {"blocks": 0.0, "rest": 0.0, "embedding": 0.004, "grad_buffers": 0.0},
        0.01,
    )
    measured = dataclasses.replace(MEASURED, buckets=[dense, expert])
    step = project_full_scale(measured, SCALE, RUN, FULL, TARGET, tokens_per_step=8 * 16 * 4096, flops_per_token=6e9)
    # The recorded reductions are the buckets': no "grad" entry is left for the step to price again.
    assert [c.phase for c in step.per_step] == ["other"]
    # 8 copies of each bucket (8 blocks of the stage, 1 ran), each with the run's bytes.
    assert len(step.grad_buckets) == 16 and {b.collective.nbytes for b in step.grad_buckets} == {4000, 6000}
    rs = ALPHA + 4000 / 2 / INTER
    ar = 2 * ALPHA + 2 * 6000 / 2 / INTER
    breakdown = step.projection.breakdown_s
    assert breakdown["grad_sync_total"] == pytest.approx(8 * (rs + ar))
    # The blocks' backward of one microbatch: .094 s of the table's block phases over 2 microbatches; x 32
    # tokens, every copy but the last launches with over a second of backward ahead, far more than the
    # 10-21 us each collective needs; the last copy of the expert bucket launches with only the embedding's
    # 4 ms ahead, which still hides it.
    assert breakdown["grad_sync_exposed"] == 0.0
    assert breakdown["grad_sync_hidden"] == pytest.approx(8 * (rs + ar))
    missing = dataclasses.replace(dense, reduce=CollectiveCall("reduce_scatter", DP, 4001, "dp"))
    with pytest.raises(RuntimeError, match="missing from the recorded step"):
        project_run_scale(dataclasses.replace(MEASURED, buckets=[missing]), SCALE, TARGET, 1, 1.0)
