"""The op-level projection on this machine's profile against a real 2-rank run of the same layout here.

The profile (devices/cpu-2core.yaml) was measured on a 2-core CPU machine; on another machine the
check still runs, against whatever that machine does, with a wide band: it guards against pricing
that is off by a factor (a kind of op left out, a unit wrong), not the last 10%, which
``moe-bench proxy-check --device-profile cpu-2core --runs 5 --warmup-steps 30`` measures (this
layout's median there: -8.0%).
"""

from __future__ import annotations

import pytest

from bench.predict.device import load_profile
from bench.predict.projection import SkewModel
from bench.machine import machine_info
from bench.run.project import project_on_device
from bench.run.runner import Runner, resolve_device
from bench.scenario import load_scenario
from bench.validate.proxy_check import step_time_cv, with_warmup

pytestmark = pytest.mark.slow


def test_op_level_projection_is_near_a_real_run(tmp_path):
    # 30 warm-up steps: a fresh process's first steps run slower than the steady state a profile prices
    # (bench.validate.cpu_warmup: kernels built for the experts' new row counts).
    scenario = with_warmup(load_scenario("scenarios/smoke/e8-ep2-nosync-bf16.yaml"), 30)
    real = Runner(resolve_device("cpu"), tmp_path).run_one(scenario, lambda line: None)
    assert real.status == "ok", real.error
    samples = real.metrics["step_time_s"]["samples"]
    skew = SkewModel(step_time_cv(samples), "the real run's step times")
    projected = project_on_device(scenario, load_profile("cpu-2core"), skew=skew)
    measured = real.metrics["step_time_s"]["median"]
    ratio = projected["step_s"] / measured
    print(f"{machine_info()['name']}: projected {projected['step_s'] * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms")
    assert 0.5 < ratio < 1.5, f"projected / measured = {ratio:.2f}"
