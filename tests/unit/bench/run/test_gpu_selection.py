"""The gpu suite on hosts of 1, 2, 4 and 8 GPUs (device count faked): what starts, what is skipped or
refused, and that neither a skipped nor a refused scenario starts anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.predict.plan import plan_scenario
from bench.results import load_results
from bench.run import runner
from bench.run.console import SilentReporter
from bench.run.memory import MEMORY_MARGIN
from bench.run.runner import Runner
from bench.run.suites import load_all, suite_files
from bench.run.worker_protocol import WorkerRequest

GIB = 2**30
GPU_SUITE = load_all(suite_files("gpu", torch.device("cuda")))
ONE_GPU_SET = {"e8-top4-random-bf16", "e128-top4-random-bf16", "e8-top4-random-mxfp8", "e8-top4-random-fp8"}


def planned_per_gpu(scenario) -> int:
    """The most loaded pipeline stage's planned bytes: what one GPU has to hold."""
    return max(int(stage["memory_total_bytes"]) for stage in plan_scenario(scenario)[1]["stages"])


class FakeNode:
    """A host with ``gpus`` GPUs of ``free_gib`` free each; records memory queries and worker launches."""

    def __init__(self, monkeypatch, gpus: int, free_gib: float):
        self.gpus, self.free = gpus, int(free_gib * GIB)
        self.memory_queries: list[str] = []
        self.launches: dict[str, list[str]] = {}
        self.requests: dict[str, WorkerRequest] = {}
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(runner, "cuda_free_bytes", self.available)
        monkeypatch.setattr(runner, "device_peak", lambda device: (None, "no peak on a faked GPU"))
        monkeypatch.setattr(runner, "run_with_timeout", self.worker)

    def available(self, count: int) -> list[int]:
        assert count <= self.gpus
        self.memory_queries.extend(f"cuda:{r}" for r in range(count))
        return [self.free] * count

    def worker(self, command, timeout, env=None):
        request = WorkerRequest.from_json(Path(command[-2]).read_text())
        self.launches[request.spec["name"]] = command
        self.requests[request.spec["name"]] = request
        Path(command[-1]).write_text(json.dumps({"status": "ok", "error": None, "metrics": {}, "details": {}}))
        return 0, []


def run_suite(tmp_path: Path, node: FakeNode):
    out = tmp_path / "results"
    Runner(torch.device("cuda"), out, reporter_factory=SilentReporter).run(GPU_SUITE)
    return {d.name: d for d in load_results(out)}


def test_the_gpu_suite_has_scenarios_for_1_2_4_and_8_gpus():
    assert {s.world_size for s in GPU_SUITE} == {1, 2, 4, 8}
    assert {s.name for s in GPU_SUITE if s.world_size == 1} == ONE_GPU_SET


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_a_host_runs_the_scenarios_it_has_the_gpus_for_and_records_the_rest_skipped(tmp_path, monkeypatch, gpus):
    node = FakeNode(monkeypatch, gpus, free_gib=139)
    docs = run_suite(tmp_path, node)
    fits = {s.name for s in GPU_SUITE if s.world_size <= gpus}
    assert set(node.launches) == fits
    if gpus == 1:
        assert fits == ONE_GPU_SET  # a 1-GPU host keeps the one-GPU set
    for s in GPU_SUITE:
        doc = docs[s.name]
        if s.name in fits:
            assert doc.status == "ok"
            command = node.launches[s.name]
            assert node.requests[s.name].device == "cuda"
            if s.world_size > 1:  # one process per GPU under torchrun
                assert f"--nproc-per-node={s.world_size}" in command
            else:
                assert "torch.distributed.run" not in command
        else:
            assert doc.status == "skipped"
            assert doc.data["error"] == f"needs {s.world_size} GPUs (dp * pp); this host has {gpus}"
            assert doc.data["details"] == {}  # refused before any plan or memory check
    # Memory was asked for each GPU of each started scenario, never for a skipped one.
    expected = sorted(f"cuda:{r}" for s in GPU_SUITE if s.name in fits for r in range(s.world_size))
    assert sorted(node.memory_queries) == expected


def test_a_scenario_the_gpus_cannot_hold_is_recorded_oom_before_starting(tmp_path, monkeypatch):
    node = FakeNode(monkeypatch, 8, free_gib=30)
    docs = run_suite(tmp_path, node)
    too_big = {s.name for s in GPU_SUITE if planned_per_gpu(s) > (1 + MEMORY_MARGIN) * 30 * GIB}
    # Both kinds are present: the check decides per scenario, from its plan.
    assert "node8-e128-ddp-ep8-nosync-bf16" in too_big and "node8-e8-ddp-ep8-nosync-bf16" not in too_big
    assert set(node.launches) == {s.name for s in GPU_SUITE} - too_big
    for s in GPU_SUITE:
        if s.name not in too_big:
            continue
        doc = docs[s.name]
        assert doc.status == "oom" and doc.metrics == {}
        assert doc.data["error"] == (
            f"planned {planned_per_gpu(s) / GIB:.1f} GiB per rank, 30.0 GiB available ({runner.CUDA_FREE_SOURCE}); "
            "not started (moe-bench run --force starts it anyway)"
        )
        pools = doc.data["details"]["memory_check"]["pools"]
        assert [p["pool"] for p in pools] == [f"cuda:{r}" for r in range(s.world_size)]
