"""The runner's GPU memory query runs in a process of its own: a CUDA context made in the runner would hold
about 0.5 GB on every GPU for the whole suite. The child's answer is faked by a sitecustomize on its
PYTHONPATH; the runner's own torch.cuda.mem_get_info raises, as asking in the runner is the bug."""

from __future__ import annotations

import os

import pytest
import torch
from scenario_files import variant, write_scenario

from bench.run.memory import CUDA_FREE_SOURCE
from bench.run.runner import Runner
from bench.scenario import load_scenario

FAKE_GPUS = """
import os
import torch

def _mem_get_info(index):
    if os.environ["MOE_TEST_GPU_QUERY"] == "fail":
        raise RuntimeError("no GPU answers")
    return ((index + 1) * 2**30, 80 * 2**30)

torch.cuda.mem_get_info = _mem_get_info
"""


def fake_gpu_children(monkeypatch, tmp_path, answer: str):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAKE_GPUS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MOE_TEST_GPU_QUERY", answer)

    def asked_here(device=None):
        raise AssertionError("the runner process asked CUDA for its free memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", asked_here)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.slow
def test_the_runner_asks_the_gpus_free_memory_in_a_process_of_its_own(tmp_path, monkeypatch):
    fake_gpu_children(monkeypatch, tmp_path, "answer")
    scenario = load_scenario(write_scenario(tmp_path, "dp2", variant(parallel={"dp": 2})))
    refusal, check = Runner(torch.device("cuda"), tmp_path / "r")._memory_check(scenario)
    assert refusal is None
    # GPU i has i + 1 GiB free in the child's answer.
    assert [(p["pool"], p["available_bytes"], p["source"]) for p in check["pools"]] == [
        ("cuda:0", 2**30, CUDA_FREE_SOURCE),
        ("cuda:1", 2 * 2**30, CUDA_FREE_SOURCE),
    ]


@pytest.mark.slow
def test_a_gpu_memory_query_that_fails_leaves_the_check_to_the_run(tmp_path, monkeypatch):
    fake_gpu_children(monkeypatch, tmp_path, "fail")
    scenario = load_scenario(write_scenario(tmp_path, "dp2", variant(parallel={"dp": 2})))
    refusal, check = Runner(torch.device("cuda"), tmp_path / "r")._memory_check(scenario)
    assert refusal is None
    assert check["skipped"].startswith("available memory unknown: the GPU memory query exited with code 1")
    assert check["skipped"].endswith("RuntimeError: no GPU answers")
