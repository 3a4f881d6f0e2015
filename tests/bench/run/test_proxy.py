"""Proxy scenarios: validation, the scaled run, the collective census and a whole proxy run."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from bench.predict.projection import Collective
from bench.results import REPO_ROOT
from bench.run.proxy import CallScaling, classify_calls, run_spec
from bench.run.runner import Runner, SilentReporter
from bench.scenario import ScenarioError, load_scenario, scenario_from_dict
from moe_engine.parallel.collective_log import CollectiveCall

OLMO_DIR = REPO_ROOT / "scenarios" / "olmo-core3"

TINY = {
    "schema_version": 1,
    "name": "tiny-proxy",
    "mode": "proxy",
    "model": {
        "vocab_size": 512, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96, "shared_expert_hidden": 64},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "bf16",
    "parallel": {"dp": 4, "ep": 4, "pp": 2, "schedule": "1f1b", "microbatches": 4, "optimizer_sharding": "zero1",
                 "dispatch": "no-sync", "capacity_factor": 1.25},
    "run": {"tokens_per_step": 4 * 4 * 2 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 1, "threads": 1},
    "cluster": {"gpus": 8, "gpus_per_node": 4, "gpu_memory_gib": 1, "peak_tflops": 1},
}


def tiny(**changes) -> dict:
    spec = copy.deepcopy(TINY)
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return spec


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
    assert (scale.tokens_per_microbatch_run, scale.tokens_per_microbatch_full) == (128, 4096)
    # 1F1B keeps pp - 0 = 8 microbatches in flight on stage 0.
    assert (scale.microbatches_run, scale.microbatches_full) == (8, 64)
    assert spec["model"]["n_layers"] == 8 and spec["model"]["seq_len"] == 128
    assert spec["run"]["tokens_per_step"] == 64 * 8 * 128
    # The experts keep their shapes.
    assert spec["model"]["moe"] == scenario.spec["model"]["moe"] and spec["model"]["d_model"] == 8192
    spec, scale = run_spec(scenario, torch.device("cuda"))
    assert (scale.blocks_run, scale.tokens_per_microbatch_run) == (7, 4096)
    assert spec["model"]["n_layers"] == 56


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


@pytest.mark.slow
def test_a_proxy_run_measures_its_rank(tmp_path):
    runner = Runner(torch.device("cpu"), tmp_path, reporter_factory=SilentReporter)
    outcome = runner.run_one(scenario_from_dict(tiny()), lambda line: None)
    assert outcome.status == "ok", outcome.error
    import json

    document = json.loads(outcome.path.read_text())
    details, metrics = document["details"], document["metrics"]
    assert document["mode"] == "proxy" and details["rank"]["pp_rank"] == 0 and details["rank"]["ep_rank"] == 1
    # Every no-sync all-to-all moves ep * C rows of D bf16 values, C = ceil(1.25 * T 64 * k 2 / ep 4) = 40.
    a2a = [row for row in details["collectives_per_step"] if row["op"] == "all_to_all" and row["nbytes"] > 1024]
    assert a2a and {row["nbytes"] for row in a2a} == {4 * 40 * 64 * 2}
    # The proxy runs the 2 microbatches 1F1B keeps in flight on stage 0 of 2 (of the scenario's 4):
    # 2 blocks x 2 microbatches x (dispatch + combine) x (forward + backward)
    assert details["scale"]["microbatches_run"] == 2 and details["scale"]["microbatches_full"] == 4
    assert sum(row["count"] for row in a2a) == 2 * 2 * 4
    # Stage 0 of 2 sends activations forward and receives gradients: one message each per microbatch.
    sends = [row for row in details["collectives_per_step"] if row["op"] == "send"]
    assert sends == [{"op": "send", "group_size": 2, "nbytes": 2 * 32 * 64 * 2, "phase": "pipeline",
                      "count": 2, "total_bytes": 2 * 2 * 32 * 64 * 2}]
    phases = details["phases_s"]
    for phase in ("attention", "router", "dispatch", "experts", "shared_expert", "embedding"):
        assert phases[phase]["forward"] > 0 and phases[phase]["backward"] > 0, phase
    for phase in ("optimizer", "grad_buffers"):
        assert phases[phase]["forward"] > 0, phase
    # The plan of what ran is within 15% of the measured peak.
    assert abs(metrics["plan_memory_gap"]["median"]) < 0.15
    projection = details["projection_run_scale"]
    assert projection["step_s"] == pytest.approx(sum(
        projection["breakdown_s"][k] for k in
        ("compute", "expert_comm", "pipeline_comm", "bubble", "grad_sync_exposed", "optimizer", "other_comm")
    ))
    assert math.isclose(metrics["projected_run_step_time_s"]["median"], projection["step_s"])
