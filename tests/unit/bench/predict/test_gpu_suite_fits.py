"""Every scenario of the gpu suite fits the GPU it targets, by the plan, with 15% headroom.

``bench/gpu-check.sh`` runs the suite on one H200; a scenario that does not fit would be recorded
``oom`` (the runner refuses it before starting) and fail the check. The node scenarios (2, 4 and 8
GPUs) target an H100 SXM 80 GB, the smallest GPU of the nodes they are for.
"""

from __future__ import annotations

import pytest
import torch

from bench.predict.device import load_profile
from bench.predict.plan import plan_scenario
from bench.report.comparisons import load_comparisons
from bench.run.suites import suite_files
from bench.scenario import load_scenario

HEADROOM = 0.15
GPU_SCENARIOS = suite_files("gpu", torch.device("cuda"))
NODE_SCENARIOS = [p for p in GPU_SCENARIOS if load_scenario(p).world_size > 1]
H100_BYTES = load_profile("h100-sxm").memory_bytes


def most_loaded_gpu_bytes(scenario) -> int:
    """The plan's memory of the most loaded pipeline stage: what one GPU holds."""
    return max(int(stage["memory_total_bytes"]) for stage in plan_scenario(scenario)[1]["stages"])


def test_the_gpu_suite_is_not_empty():
    assert GPU_SCENARIOS
    assert {load_scenario(p).world_size for p in NODE_SCENARIOS} == {2, 4, 8}


@pytest.mark.parametrize("path", GPU_SCENARIOS, ids=lambda p: p.stem)
def test_gpu_scenario_fits_its_device_with_headroom(path):
    scenario = load_scenario(path)
    cluster = scenario.spec.get("cluster")
    assert cluster, f"{path.name}: a gpu-suite scenario names the device it targets (cluster section)"
    planned_gib = most_loaded_gpu_bytes(scenario) / 2**30
    budget_gib = (1 - HEADROOM) * cluster["gpu_memory_gib"]
    assert planned_gib <= budget_gib, (
        f"{path.name}: planned {planned_gib:.1f} GiB per rank, over {budget_gib:.1f} GiB "
        f"({1 - HEADROOM:.0%} of {cluster['gpu_memory_gib']} GiB)"
    )


@pytest.mark.parametrize("path", NODE_SCENARIOS, ids=lambda p: p.stem)
def test_node_scenario_fits_an_h100_80gb_with_headroom(path):
    scenario = load_scenario(path)
    assert scenario.cluster.device == "h100-sxm"
    assert scenario.cluster.gpus == scenario.world_size
    planned = most_loaded_gpu_bytes(scenario)
    assert planned <= (1 - HEADROOM) * H100_BYTES, (
        f"{path.name}: planned {planned / 2**30:.1f} GiB on the most loaded GPU, over {1 - HEADROOM:.0%} of "
        f"{H100_BYTES / 2**30:.1f} GiB"
    )


NODE_NAMES = {p.stem: p for p in NODE_SCENARIOS}
NODE_PAIRS = [(c.name, a, b) for c in load_comparisons() for a, b in c.pairs if a in NODE_NAMES or b in NODE_NAMES]


def test_every_node_scenario_is_in_a_comparison():
    # tests/unit/bench/report/test_comparisons.py checks that each pair has one size (active, tokens, GPUs).
    assert {name for _, a, b in NODE_PAIRS for name in (a, b)} == set(NODE_NAMES)
