"""The runner-worker protocol (``bench.run.worker_protocol``): the request and the outcome survive their
JSON, the worker's command carries the two files alone, and the runner's own fields never overwrite
the worker's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from bench.machine import Peaks
from bench.run import execute, runner
from bench.run.checkpointing import CheckpointPolicy, CheckpointRun, policy_for
from bench.run.worker_protocol import DetailsClash, WorkerOutcome, WorkerRequest, merge_details
from bench.scenario import scenario_from_dict

TINY = {
    "schema_version": 1,
    "mode": "execute",
    "model": {
        "vocab_size": 128,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32},
    },
    "precision": "fp32",
    "run": {"warmup_steps": 0, "steps": 2, "tokens_per_step": 64, "timeout_s": 60},
}
PROXY = {**TINY, "mode": "proxy", "cluster": {"gpus": 1, "gpu_memory_gib": 80, "peak_tflops": 989}}


@pytest.mark.parametrize(
    "checkpoint",
    [
        None,
        CheckpointRun(CheckpointPolicy(4, Path("/results/checkpoints/tiny"), True, 2), Path("/x/step-00000004"), 3),
        CheckpointRun(None, Path("/x/step-00000008"), 1),
        CheckpointRun(CheckpointPolicy(1, Path("relative/ckpt"), False, 1), None, 2),
    ],
)
def test_a_request_survives_its_json(checkpoint):
    request = WorkerRequest(
        spec=scenario_from_dict(copy.deepcopy(TINY)).spec,
        file="scenarios/tiny.yaml",
        device="cuda",
        peaks=Peaks(989.5, 1979.0, "datasheet"),
        checkpoint=checkpoint,
        project_devices=("h100-sxm", "b200"),
    )
    assert WorkerRequest.from_json(request.to_json()) == request
    bare = WorkerRequest(spec=request.spec, file=None, device="cpu")
    assert WorkerRequest.from_json(bare.to_json()) == bare


def test_an_outcome_survives_its_json():
    outcome = WorkerOutcome("ok", None, {"mfu": {"median": 0.4, "samples": [0.4]}}, {"peak_tflops": 1.0, "x": [1]})
    assert WorkerOutcome.from_json(outcome.to_json()) == outcome
    failed = WorkerOutcome("timeout", "stopped after 60 s")
    assert WorkerOutcome.from_json(failed.to_json()) == failed


def test_the_runners_fields_follow_the_workers_and_never_overwrite_them():
    merged = merge_details({"peak_tflops": 1.0, "b": 2}, {"memory_check": {"forced": False}})
    assert list(merged) == ["peak_tflops", "b", "memory_check"]
    with pytest.raises(DetailsClash, match="peak_tflops"):
        merge_details({"peak_tflops": 1.0}, {"peak_tflops": None})


class FakeWorker:
    """Stands in for the worker process: keeps the command and the request, writes the given details."""

    def __init__(self, monkeypatch, details: dict):
        self.details, self.commands, self.requests = details, [], []
        monkeypatch.setattr(runner, "run_with_timeout", self)
        monkeypatch.setattr(runner, "available_memory_bytes", lambda device: (64 * 2**30, "MemAvailable"))
        monkeypatch.setattr(execute, "measure_peak_tflops", lambda device, dtype, seconds=1.0: 2.0)

    def __call__(self, command, timeout, env=None):
        self.commands.append(command)
        self.requests.append(WorkerRequest.from_json(Path(command[-2]).read_text()))
        Path(command[-1]).write_text(WorkerOutcome("ok", None, {}, self.details).to_json())
        return 0, []


def test_the_worker_gets_one_request_file_and_the_runner_adds_only_its_own_fields(tmp_path, monkeypatch):
    worker = FakeWorker(monkeypatch, {"peak_tflops": 2.0, "peak_tflops_fp8": None, "peak_tflops_source": "given"})
    spec = {**copy.deepcopy(TINY), "checkpoint": {"every_steps": 1}}
    scenario = scenario_from_dict(spec)
    outcome = runner.Runner(torch.device("cpu"), tmp_path).run_one(scenario)
    (command,), (request,) = worker.commands, worker.requests
    assert command[:-2] == runner.worker_command(1) and not any(part.startswith("--") for part in command[-2:])
    assert request.device == "cpu" and request.peaks == Peaks(2.0, None, request.peaks.source)
    # The policy the runner worked out, carried to the worker: the worker does not work it out again.
    assert request.checkpoint == CheckpointRun(policy_for(scenario.spec, tmp_path), None, 1)
    assert list(outcome.details) == ["peak_tflops", "peak_tflops_fp8", "peak_tflops_source", "memory_check"]
    assert outcome.details["peak_tflops_source"] == "given"  # the worker's words, untouched


@pytest.mark.parametrize(
    "spec, clash",
    [(TINY, "memory_check"), (PROXY, "peak_tflops")],
    ids=["execute", "proxy"],
)
def test_a_worker_field_the_runner_would_overwrite_is_refused(tmp_path, monkeypatch, spec, clash):
    FakeWorker(monkeypatch, {clash: "the worker's"})
    scenario = scenario_from_dict(copy.deepcopy(spec))
    with pytest.raises(DetailsClash, match=clash):
        runner.Runner(torch.device("cpu"), tmp_path).run_one(scenario)


def test_a_worker_that_dies_gets_the_runners_fields_alone(tmp_path, monkeypatch):
    FakeWorker(monkeypatch, {})
    monkeypatch.setattr(runner, "run_with_timeout", lambda command, timeout, env=None: (None, []))
    outcome = runner.Runner(torch.device("cpu"), tmp_path).run_one(scenario_from_dict(copy.deepcopy(PROXY)))
    assert outcome.status == "timeout" and outcome.details == {"peak_tflops": None}
    assert json.loads(outcome.path.read_text())["details"] == {"peak_tflops": None}
