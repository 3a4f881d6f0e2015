"""The op-level projection on the 2-core CPU profile against runs measured on the machine it describes.

The profile (devices/cpu-2core.yaml) and the runs (docs/measurements/proxy-check-2core-cpu-warmup30.json:
the 2-rank smoke layouts, 30 warm-up steps, 5 runs each) were both measured on a 2-core CPU machine. The
test prices each layout on the profile, with the rank skew of the recorded runs' step-time spread, and
compares it with their recorded median step: no step is timed here, so a loaded or different machine
cannot move the result. The band is wide: it guards against pricing that is off by a factor (a kind of
op left out, a unit wrong), not the last 10%. Against this machine's own runs, projected / measured - 1
of every run and its median: ``moe-bench proxy-check --device-profile cpu-2core --runs 5 --warmup-steps 30``.
"""

from __future__ import annotations

import json
import statistics

import pytest

from bench.predict.device import load_profile
from bench.predict.skew import SkewModel
from bench.results import REPO_ROOT
from bench.run.project import project_on_device
from bench.scenario import load_scenario
from bench.validate.proxy_check import with_warmup

pytestmark = pytest.mark.slow

MEASURED = REPO_ROOT / "docs" / "measurements" / "proxy-check-2core-cpu-warmup30.json"


@pytest.mark.parametrize("name", ["e8-dp2-bf16", "e8-ep2-nosync-bf16", "e8-ep2-sync-bf16", "e8-pp2-1f1b-bf16"])
def test_op_level_projection_is_near_the_recorded_runs(name):
    report = json.loads(MEASURED.read_text())
    runs = [r for r in report["rows"] if r["scenario"] == name and r["status"] == "ok"]
    assert len(runs) == 5
    scenario = with_warmup(load_scenario(REPO_ROOT / "scenarios" / "smoke" / f"{name}.yaml"), report["warmup_steps"])
    skew = SkewModel(statistics.median(r["step_time_cv"] for r in runs), "the recorded runs' step times")
    projected = project_on_device(scenario, load_profile("cpu-2core"), skew=skew)["step_s"]
    measured = statistics.median(r["measured_step_s"] for r in runs)
    assert 0.5 < projected / measured < 1.5, f"projected {projected * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms"
