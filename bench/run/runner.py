"""Run scenarios: plans in process, executes in a worker process with a timeout; write results.

The run loop (``Runner``) and the lock on the results folder; what it runs and where is chosen in
``bench.run.suites``, the memory pre-check's arithmetic is in ``bench.run.memory``, its console in
``bench.run.console``, and the worker's command, timeout and kill in ``bench.run.process``.

Every scenario is loaded and validated before any work starts. A scenario that fails, runs out of
memory or times out is recorded with that status and the suite goes on. A scenario needing more GPUs
(dp * pp) than the host has is recorded ``skipped`` with the reason before anything else (no plan, no
memory query, no process), so a suite can list layouts for several node sizes. An execute scenario
whose plan (``bench.predict.plan``) needs more memory than its device has is recorded ``oom`` without
starting (unless forced).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from bench.machine import Peaks, available_memory_bytes, device_peak, machine_identity, machine_info
from bench.predict.plan import plan_scenario
from bench.release.version import engine_info
from bench.results import SCHEMA_VERSION, result_dir, scenario_file_entry, scenario_hash, utc_now, write_result
from bench.run import execute
from bench.run.checkpointing import CheckpointRun, append_journal, next_attempt, policy_for
from bench.run.conditions import Watch
from bench.run.console import Reporter
from bench.run.launch import Launch
from bench.run.memory import CUDA_FREE_SOURCE, MEMORY_MARGIN, RankMemory, cuda_free_bytes, memory_shortfall
from bench.run.process import run_with_timeout, worker_command, worker_env
from bench.run.worker import execute_outcome
from bench.run.worker_protocol import WorkerOutcome, WorkerRequest, merge_details
from bench.scenario import Scenario
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    scenario: Scenario
    status: str
    error: str | None
    path: Path | None
    """The result document written; None where this process writes none (``writes_results``)."""
    metrics: dict[str, Any]
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    """The result document's scenario name (``<name>.plan`` for the plan of a non-plan scenario)."""
    conditions: dict[str, Any] | None = None
    """What the machine was doing over an execute run (``bench.run.conditions``); None for the others."""

    @property
    def noisy(self) -> str | None:
        """Why the run was noisy, one line; None when it was quiet (or not watched)."""
        if not self.conditions or not self.conditions.get("noisy"):
            return None
        return "; ".join(self.conditions["reasons"])


class Runner:
    def __init__(
        self,
        device: torch.device,
        out_root: Path,
        reporter_factory: Callable[[int], Reporter] = Reporter,
        launch: Launch | None = None,
        plan_only: bool = False,
        force: bool = False,
        resume: dict[str, Path] | None = None,
        project_devices: list[str] | None = None,
    ):
        self.device = device
        self.launch = launch
        self.out_root = Path(out_root)
        self.machine = machine_info()
        self.engine = engine_info()
        self.reporter_factory = reporter_factory
        self.plan_only = plan_only
        """Plan every scenario (``moe-bench plan``) instead of running it."""
        self.force = force
        """Start execute scenarios whose plan does not fit the device (``moe-bench run --force``)."""
        self.resume = resume or {}
        """The checkpoint each scenario (by name) resumes from (``moe-bench run --resume``, checked)."""
        self.project_devices = list(project_devices or [])
        """Device profiles a proxy result is also projected onto, beside its cluster.device (``--project-on``)."""
        self._cpu_peaks: dict[str, float] = {}
        """The CPU peak measured once per dtype, TFLOP/s."""

    @property
    def out_dir(self) -> Path:
        return result_dir(self.out_root, self.engine["version"], self.machine["name"])

    def run(self, scenarios: list[Scenario]) -> list[Outcome]:
        reporter = self.reporter_factory(len(scenarios))
        outcomes = []
        lock = results_lock(self.out_root) if self.writes_results and not self.plan_only else None
        try:
            for scenario in scenarios:
                reporter.start(scenario, mode="plan" if self.plan_only else scenario.mode)
                outcome = self.run_one(scenario)
                reporter.finish(outcome)
                outcomes.append(outcome)
        finally:
            if lock is not None:
                lock.close()  # closing the file releases the lock
            reporter.close()
        return outcomes

    def run_one(self, scenario: Scenario) -> Outcome:
        started = time.perf_counter()
        planned = self.plan_only or scenario.mode == "plan"
        if planned:
            metrics, details = plan_scenario(scenario)
            status, error, conditions = "ok", None, None
        else:
            status, error, metrics, details, conditions = self._execute(scenario)
        seconds = time.perf_counter() - started
        # The plan of an execute or proxy scenario is a result of its own: named apart, so that
        # comparisons never pool it with the scenario's runs (same spec, same hash).
        name = scenario.name if scenario.mode == "plan" or not planned else f"{scenario.name}.plan"
        mode = "plan" if planned else scenario.mode
        document = self.document(scenario, status, error, metrics, details, seconds, name=name, mode=mode)
        if conditions is not None:
            document["conditions"] = conditions
            document["machine"] = {
                **self.machine,
                "identity": machine_identity(self.machine, conditions["calibration_start"]),
            }
        path = write_result(document, self.out_dir) if self.writes_results else None
        return Outcome(
            scenario, status, error, path, metrics, seconds, details=details, name=name, conditions=conditions
        )

    @property
    def writes_results(self) -> bool:
        """Inside a launch only rank 0 writes; the other ranks compute the same outcomes."""
        return self.launch is None or self.launch.rank == 0

    def document(self, scenario, status, error, metrics, details, seconds, name=None, mode=None) -> dict[str, Any]:
        mode = mode or scenario.mode
        return {
            "schema_version": SCHEMA_VERSION,
            "engine": self.engine,
            "timestamp": utc_now(),
            "duration_s": seconds,
            "machine": self.machine,
            "scenario": {
                "name": name or scenario.name,
                **scenario_file_entry(scenario.file),
                "hash": scenario_hash(scenario.spec),
                "spec": scenario.spec,
            },
            "mode": mode,
            "device": "none" if mode == "plan" else str(self.device),
            "status": status,
            "error": error,
            "metrics": metrics if status == "ok" else {},
            "details": details,
        }

    def _skip_reason(self, scenario: Scenario) -> str | None:
        if scenario.mode == "proxy":
            # One process whatever the layout; inside a launch, rank 0 alone would have to run it.
            return "proxy scenarios run outside a torchrun/Slurm launch" if self.launch is not None else None
        if self.launch is not None and scenario.world_size != self.launch.world_size:
            return (
                f"needs {scenario.world_size} ranks (dp * pp) but this {self.launch.source} launch has "
                f"{self.launch.world_size}; run it outside the launch and moe-bench starts its own ranks"
            )
        if self.launch is not None:
            return None
        if self.device.type == "cuda" and scenario.world_size > torch.cuda.device_count():
            return f"needs {scenario.world_size} GPUs (dp * pp); this host has {torch.cuda.device_count()}"
        return None

    def _peaks(self, scenario: Scenario) -> tuple[Peaks, dict[str, str]]:
        """The peaks MFU is measured against with their source, and why an MFU is left out (by metric)."""
        mxfp8 = scenario.precision == "mxfp8"
        missing: dict[str, str] = {}
        if self.device.type == "cuda":
            peak, note = device_peak(self.device)
            if peak is None:
                missing["mfu"] = note
                if mxfp8:
                    missing["mfu_fp8"] = note
                return Peaks(), missing
            if mxfp8 and peak.fp8 is None:
                missing["mfu_fp8"] = f"{peak.source} gives no FP8 peak: the GPU has no FP8 tensor cores"
            return Peaks(peak.bf16, peak.fp8 if mxfp8 else None, note), missing
        key = scenario.model.dtype.value
        if key not in self._cpu_peaks:
            self._cpu_peaks[key] = execute.measure_peak_tflops(self.device, scenario.model.dtype.torch_dtype)
        # The ranks of a CPU layout share the cores the peak was measured on.
        ranks_here = 1 if self.launch is not None else scenario.world_size
        if mxfp8:
            missing["mfu_fp8"] = "no FP8 peak on a CPU (the MXFP8 GEMMs are emulated)"
        source = f"{key} dense matmul measured on all cores, divided by the ranks sharing them"
        return Peaks(self._cpu_peaks[key] / ranks_here, None, source), missing

    def _rank_memory(self, scenario: Scenario) -> list[RankMemory]:
        """Every rank's planned memory and its pool's free memory (inside a launch: gathered from the ranks)."""
        _, plan = plan_scenario(scenario)
        stage_bytes = [int(s["memory_total_bytes"]) for s in plan["stages"]]
        layout, host = Layout(scenario.parallel_config), socket.gethostname()

        def entry(rank: int, device: torch.device) -> RankMemory:
            available, source = available_memory_bytes(device)
            name = str(device) if device.type == "cuda" else "cpu"
            return RankMemory(rank, host, name, stage_bytes[layout.coords(rank).pp_rank], available, source)

        if self.launch is not None:
            # Every rank must reach the same verdict: each reports its own figures to all.
            gathered: list[RankMemory | None] = [None] * self.launch.world_size
            dist.all_gather_object(gathered, entry(self.launch.rank, self.device))
            return cast(list[RankMemory], gathered)  # every rank's entry filled in
        if self.device.type == "cuda":
            # The runner starts one rank per GPU, rank r on GPU r.
            free = cuda_free_bytes(scenario.world_size)
            return [
                RankMemory(r, host, f"cuda:{r}", stage_bytes[layout.coords(r).pp_rank], free[r], CUDA_FREE_SOURCE)
                for r in range(scenario.world_size)
            ]
        available, source = available_memory_bytes(self.device)
        return [
            RankMemory(r, host, "cpu", stage_bytes[layout.coords(r).pp_rank], available, source)
            for r in range(scenario.world_size)
        ]

    def _memory_check(self, scenario: Scenario) -> tuple[str | None, dict[str, Any]]:
        """Why the scenario cannot fit the memory here (None when it can, or when forced) and the figures."""
        try:
            ranks = self._rank_memory(scenario)
        except OSError as err:  # no /proc/meminfo on this platform, or no answer from the GPUs: nothing to compare with
            return None, {"skipped": f"available memory unknown: {err}"}
        reason, pools = memory_shortfall(ranks)
        details = {"pools": pools, "margin": MEMORY_MARGIN, "shortfall": reason, "forced": self.force}
        return (None if self.force else reason), details

    def _execute(self, scenario: Scenario) -> tuple[str, str | None, dict, dict, dict | None]:
        """Status, error, metrics, details and the machine's conditions over the run (``bench.run.conditions``;
        None where no worker ran, or inside a launch, whose other ranks share the machine by design)."""
        reason = self._skip_reason(scenario)
        if reason:
            return "skipped", reason, {}, {}, None
        if scenario.mode == "execute":
            refusal, memory_check = self._memory_check(scenario)
            if refusal:
                oom = f"{refusal} (moe-bench run --force starts it anyway)"
                return "oom", oom, {}, {"memory_check": memory_check}, None
            peaks, missing = self._peaks(scenario)
            # The peaks and their source are the worker's fields (it measured against them); the
            # runner adds what only it knows.
            runner_details: dict[str, Any] = {
                "memory_check": memory_check,
                **({"mfu_unavailable": missing} if missing else {}),
            }
        else:
            peaks, runner_details = Peaks(), {"peak_tflops": None}
        request = self._request(scenario, peaks)
        conditions = None
        if self.launch is not None:
            outcome = self._execute_in_launch(scenario, request)
        elif scenario.mode == "execute":
            watch = Watch.start()
            outcome = self._run_worker(scenario, request)
            conditions = watch.finish()
        else:
            outcome = self._run_worker(scenario, request)
        details = merge_details(outcome.details, runner_details)
        return outcome.status, outcome.error, outcome.metrics, details, conditions

    def _request(self, scenario: Scenario, peaks: Peaks) -> WorkerRequest:
        """What the worker is asked; inside a launch rank 0 alone numbers the checkpoint attempt."""
        checkpoint = self._checkpoint_run(scenario) if self.writes_results else None
        if self.launch is not None and dist.is_initialized():
            # Rank 0 reads and writes the journal; every rank needs its answer.
            shared = [checkpoint]
            dist.broadcast_object_list(shared, src=0)
            checkpoint = shared[0]
        return WorkerRequest(
            spec=scenario.spec,
            file=str(scenario.file) if scenario.file else None,
            device=str(self.device),
            peaks=peaks,
            checkpoint=checkpoint,
            project_devices=tuple(self.project_devices),
        )

    def _run_worker(self, scenario: Scenario, request: WorkerRequest) -> WorkerOutcome:
        timeout = scenario.run.timeout_s
        with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
            request_path, out_path = Path(tmp) / "request.json", Path(tmp) / "outcome.json"
            request_path.write_text(request.to_json())
            processes = 1 if scenario.mode == "proxy" else scenario.world_size
            command = worker_command(processes) + [str(request_path), str(out_path)]
            returncode, tail = run_with_timeout(command, timeout, env=worker_env(processes))
            if returncode is None:
                outcome = WorkerOutcome("timeout", f"stopped after exceeding its timeout of {timeout:g} s")
            elif not out_path.exists():
                rank_errors = sorted(Path(tmp).glob("outcome.json.rank*.error"))
                detail = rank_errors[0].read_text() if rank_errors else (tail[-1] if tail else "no output")
                status = "oom" if returncode in (-signal.SIGKILL, 137) else "failed"
                outcome = WorkerOutcome(status, f"worker exited with code {returncode}: {detail}")
            else:
                outcome = WorkerOutcome.from_json(out_path.read_text())
        self._end_attempt(request.checkpoint, outcome)
        return outcome

    def _checkpoint_run(self, scenario: Scenario) -> CheckpointRun | None:
        """The scenario's checkpoints, its policy worked out here once: None when it neither saves nor resumes."""
        if scenario.mode != "execute":
            return None
        policy = policy_for(scenario.spec, self.out_root)
        resume = self.resume.get(scenario.name)
        if policy is None and resume is None:
            return None
        return CheckpointRun(policy, resume, next_attempt(policy.root) if policy else 1)

    def _end_attempt(self, checkpoint: CheckpointRun | None, outcome: WorkerOutcome) -> None:
        """The attempt's end in the journal: written here, since a killed worker cannot write it."""
        policy = checkpoint.policy if checkpoint else None
        if checkpoint is not None and policy is not None and policy.root.is_dir():
            append_journal(
                policy.root,
                {"event": "end", "attempt": checkpoint.attempt, "status": outcome.status, "error": outcome.error},
            )

    def _execute_in_launch(self, scenario: Scenario, request: WorkerRequest) -> WorkerOutcome:
        """Every rank of the launch executes its share here; the process group's timeout bounds hangs."""
        groups = build_process_groups(Layout(scenario.parallel_config))
        outcome = execute_outcome(scenario, request, self.device, groups)
        if self.writes_results:
            self._end_attempt(request.checkpoint, outcome)
        return outcome


LOCK_NAME = ".moe-bench.lock"


def results_lock(out_root: Path):
    """Hold the results folder for this run: a second ``moe-bench run`` into the same folder waits
    (saying for whom) until the first ends. Two runs at once share the cores, and each would measure
    the other: both results would be noisy. The lock is the open file returned (``fcntl.flock``, released
    when it is closed or the process ends, however it ends)."""
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    handle = open(out_root / LOCK_NAME, "a+")  # noqa: SIM115 (held for the run; the caller closes it)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another moe-bench run"
        logger.info(f"waiting: {holder} is running into {out_root} (two runs at once would measure each other)")
        fcntl.flock(handle, fcntl.LOCK_EX)
    handle.seek(0)
    handle.truncate()
    handle.write(f"moe-bench run (pid {os.getpid()}, started {utc_now()})\n")
    handle.flush()
    return handle
