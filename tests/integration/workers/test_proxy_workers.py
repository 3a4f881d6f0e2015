"""A proxy run in its worker process measures its rank."""

from __future__ import annotations

import math

import pytest
import torch
from proxy_scenario import tiny

from bench.predict.device import load_profile
from bench.predict.projection import STEP_KEYS
from bench.run.console import SilentReporter
from bench.run.project import project_on_device
from bench.run.runner import Runner
from bench.scenario import scenario_from_dict


@pytest.mark.slow
def test_a_proxy_run_measures_its_rank(tmp_path):
    runner = Runner(torch.device("cpu"), tmp_path, reporter_factory=SilentReporter, project_devices=["h100-sxm"])
    outcome = runner.run_one(scenario_from_dict(tiny()))
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
    assert sends == [
        {
            "op": "send",
            "group_size": 2,
            "nbytes": 2 * 32 * 64 * 2,
            "phase": "pipeline",
            "count": 2,
            "total_bytes": 2 * 2 * 32 * 64 * 2,
        }
    ]
    phases = details["phases_s"]
    for phase in ("attention", "router", "dispatch", "experts", "shared_expert", "embedding"):
        assert phases[phase]["forward"] > 0 and phases[phase]["backward"] > 0, phase
    for phase in ("optimizer", "grad_buffers"):
        assert phases[phase]["forward"] > 0, phase
    # The plan of what ran is within 15% of the measured peak.
    assert abs(metrics["plan_memory_gap"]["median"]) < 0.15
    projection = details["projection_run_scale"]
    assert projection["step_s"] == pytest.approx(sum(projection["breakdown_s"][k] for k in STEP_KEYS))
    # Every gradient bucket's windows and bytes: the dense buckets reduce-scatter over dp 4 and gather their
    # parameters back (ZeRO-1); the experts' sync over edp 1, a group of one, with no collective.
    sync = details["sync_windows"]["buckets"]
    dense = [row for row in sync if row["family"] == "dense"]
    assert dense and all(row["reduce_op"] == "reduce_scatter" and row["group_size"] == 4 for row in dense)
    assert all(row["grad_bytes"] > 0 and row["param_gather_bytes"] > 0 for row in dense)
    assert all(row["reduce_op"] is None for row in sync if row["family"] == "expert")
    assert all(row["update_s"] > 0 and row["reduce_window_s"] >= 0 for row in sync)
    breakdown = projection["breakdown_s"]
    for name in ("grad_sync", "param_gather"):
        assert breakdown[f"{name}_total"] > 0
        assert breakdown[f"{name}_hidden"] + breakdown[f"{name}_exposed"] == pytest.approx(breakdown[f"{name}_total"])
    assert math.isclose(metrics["projected_run_step_time_s"]["median"], projection["step_s"])
    # Beside the CPU-measured projection, the op-level one on the device asked for (--project-on).
    on_h100 = details["device_projections"]["h100-sxm"]
    assert on_h100["step_s"] == pytest.approx(
        project_on_device(scenario_from_dict(tiny()), load_profile("h100-sxm"))["step_s"], rel=1e-9
    )
