"""Every scenario of the gpu suite fits the GPU it targets, by the plan, with 15% headroom.

``bench/gpu-check.sh`` runs the suite on one H200; a scenario that does not fit would be recorded
``oom`` (the runner refuses it before starting) and fail the check.
"""

from __future__ import annotations

import pytest
import torch

from bench.predict.plan import plan_scenario
from bench.run.runner import suite_files
from bench.scenario import load_scenario

HEADROOM = 0.15
GPU_SCENARIOS = suite_files("gpu", torch.device("cuda"))


def test_the_gpu_suite_is_not_empty():
    assert GPU_SCENARIOS


@pytest.mark.parametrize("path", GPU_SCENARIOS, ids=lambda p: p.stem)
def test_gpu_scenario_fits_its_device_with_headroom(path):
    scenario = load_scenario(path)
    cluster = scenario.spec.get("cluster")
    assert cluster, f"{path.name}: a gpu-suite scenario names the device it targets (cluster section)"
    metrics, _ = plan_scenario(scenario)
    planned_gib = metrics["memory_total_bytes"]["median"] / 2**30
    budget_gib = (1 - HEADROOM) * cluster["gpu_memory_gib"]
    assert planned_gib <= budget_gib, (
        f"{path.name}: planned {planned_gib:.1f} GiB per rank, over {budget_gib:.1f} GiB "
        f"({1 - HEADROOM:.0%} of {cluster['gpu_memory_gib']} GiB)"
    )
