"""Run scenarios: plans in process, executes in a worker process with a timeout; write results.

One module on purpose: the run loop (``Runner``) and what it calls (the memory check, the worker's
command, its timeout and process-group kill) serve that one loop.

Every scenario is loaded and validated before any work starts. A scenario that fails, runs out of
memory or times out is recorded with that status and the suite goes on. A scenario needing more GPUs
(dp * pp) than the host has is recorded ``skipped`` with the reason before anything else (no plan, no
memory query, no process), so a suite can list layouts for several node sizes. An execute scenario
whose plan (``bench.predict.plan``) needs more memory than its device has is recorded ``oom`` without
starting (unless forced).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import yaml

from bench.machine import available_memory_bytes, device_peak, machine_identity, machine_info
from bench.release.version import engine_info
from bench.results import SCHEMA_VERSION, result_dir, scenario_file_entry, scenario_hash, utc_now, write_result
from bench.run.checkpointing import CheckpointRun, append_journal, next_attempt, policy_for
from bench.run.conditions import Watch
from bench.run.launch import Launch
from bench.run.worker_protocol import Peaks, WorkerOutcome, WorkerRequest, merge_details
from bench.scenario import SCENARIOS_DIR, Scenario, ScenarioError, load_scenario
from bench.units import gib

if TYPE_CHECKING:
    from rich.progress import TaskID

SUITES_PATH = SCENARIOS_DIR / "suites.yaml"


def suite_files(name: str, device: torch.device) -> list[Path]:
    suites = yaml.safe_load(SUITES_PATH.read_text())
    suites.pop("comparisons", None)  # the pairs the summary compares (bench.report.comparisons), not a suite
    if name not in suites:
        raise ScenarioError(SUITES_PATH, name, f"no such suite (known: {', '.join(sorted(suites))})")
    entry = suites[name]
    patterns = entry.get("any") or entry.get("cuda" if device.type == "cuda" else "cpu") or []
    excluded = {f for pattern in entry.get("exclude", []) for f in SCENARIOS_DIR.glob(pattern)}
    files: list[Path] = []
    for pattern in patterns:
        files.extend(f for f in sorted(SCENARIOS_DIR.glob(pattern)) if f not in excluded)
    return files


def expand_paths(paths: list[str | Path]) -> list[Path]:
    """Files as given; folders expand to the YAML files below them."""
    files: list[Path] = []
    for path in map(Path, paths):
        files.extend(sorted(path.rglob("*.yaml")) if path.is_dir() else [path])
    return files


def load_all(files: list[Path]) -> list[Scenario]:
    """Load and validate every scenario, raising the first ScenarioError before any work."""
    scenarios = [load_scenario(f) for f in files]
    seen: dict[str, Path | None] = {}
    for s in scenarios:
        if s.name in seen:
            raise ScenarioError(s.file, "name", f"duplicate scenario name {s.name!r} (also {seen[s.name]})")
        seen[s.name] = s.file
    return scenarios


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ScenarioError(None, "--device", "cuda requested but no CUDA device is available")
    return torch.device(choice)


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


# Memory check before an execute scenario starts. It is refused (recorded oom, nothing started) when
# its planned memory is more than (1 + MEMORY_MARGIN) times what the device has free. The plan's
# tensor total has come out 0.3-4.3% below the measured peak on every layout proxy-check ran
# (docs/measurements/proxy-check-2core-cpu.json), and a process needs its RSS on top of its tensors
# (libraries, allocator caches, a CUDA context), so a plan over the available memory does not fit.
# The 10% allowance is for layouts the plan was not checked against, where it may overcount: such a
# scenario runs and its own run decides. ``moe-bench run --force`` skips the refusal.
MEMORY_MARGIN = 0.10


@dataclass(frozen=True)
class RankMemory:
    """One rank's planned memory and the memory it draws on."""

    rank: int
    host: str
    """The host the rank runs on (only compared, never recorded)."""
    device: str
    """``cpu`` (the ranks of a host share its RAM) or ``cuda:<i>`` (one GPU's memory)."""
    planned: int
    """The plan's memory_total of the rank's pipeline stage, bytes."""
    available: int
    """What the device had free when asked, bytes."""
    source: str
    """Where ``available`` comes from."""


# The free memory of the GPUs is asked in a process of its own, which exits with its answer: asking in
# the runner would create a CUDA context on every GPU (about 0.5 GB each) and hold it for the whole
# suite, memory the workers then lack. Inside a launch each rank asks for its own GPU, which it uses anyway.
_CUDA_FREE_QUERY = (
    "import json, sys, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(int(sys.argv[1]))]))"
)
CUDA_FREE_SOURCE = "free memory of the GPU, torch.cuda.mem_get_info in a short-lived process"


def cuda_free_bytes(count: int, timeout: float = 120) -> list[int]:
    """The free memory of GPUs 0 to ``count - 1``, bytes, without a CUDA context in this process."""
    command = [sys.executable, "-c", _CUDA_FREE_QUERY, str(count)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        raise OSError(f"the GPU memory query did not answer within {timeout:g} s") from err
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"the GPU memory query exited with code {done.returncode}: {last}")
    return [int(b) for b in json.loads(done.stdout.strip().splitlines()[-1])]


def memory_shortfall(ranks: list[RankMemory], margin: float = MEMORY_MARGIN) -> tuple[str | None, list[dict]]:
    """Why the ranks cannot fit (the memory pool furthest over), or None; and every pool's figures.

    A pool is a GPU, or the RAM of a host, which the CPU ranks on that host share: its ranks' plans
    add up against what it has free.
    """
    hosts = list(dict.fromkeys(r.host for r in ranks))
    pools: dict[str, list[RankMemory]] = {}
    for r in ranks:
        where = "this host" if len(hosts) == 1 else f"node {hosts.index(r.host)}"
        label = f"{where}'s memory" if r.device == "cpu" else (r.device if len(hosts) == 1 else f"{where} {r.device}")
        pools.setdefault(label, []).append(r)
    rows, worst = [], None
    for label, members in pools.items():
        planned, available = sum(m.planned for m in members), min(m.available for m in members)
        rows.append(
            {
                "pool": label,
                "ranks": len(members),
                "planned_bytes": planned,
                "available_bytes": available,
                "source": members[0].source,
            }
        )
        if planned > available * (1 + margin) and (worst is None or planned / available > worst[0]):
            worst = (planned / max(available, 1), label, members, planned, available)
    if worst is None:
        return None, rows
    _, label, members, planned, available = worst
    if len(members) == 1:
        reason = f"planned {gib(planned, decimals=1)} per rank, {gib(available, decimals=1)} available"
    else:
        reason = (
            f"planned {gib(planned, decimals=1)} for the {len(members)} ranks sharing {label} "
            f"({gib(max(m.planned for m in members), decimals=1)} on the most loaded), {gib(available, decimals=1)} available"
        )
    return f"{reason} ({members[0].source}); not started", rows


CONSOLE_WIDTH = 120
"""The widest line the runner's own messages take (logs are read in terminals and editors)."""


class Reporter:
    """Progress output: plain lines (CI, pipes) or a rich live display on a terminal."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stdout
        self.rich = self.stream.isatty() and not os.environ.get("CI")
        self.total, self.index = total, 0
        self._progress = None
        if self.rich:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                transient=True,
            )
            self._progress.start()
            self._suite = self._progress.add_task("suite", total=total)
            self._step: TaskID | None = None

    def start(self, scenario: Scenario, mode: str | None = None) -> None:
        self.index += 1
        mode = mode or scenario.mode
        what = mode if mode == scenario.mode else f"{mode} of {scenario.mode}"
        label = f"[{self.index}/{self.total}] {scenario.name} ({what})"
        if self._progress:
            self._progress.update(self._suite, description=label)
            if self._step is not None:
                self._progress.remove_task(self._step)
            self._step = self._progress.add_task("  steps", total=None)
        else:
            print(label, file=self.stream, flush=True)

    def line(self, text: str) -> None:
        if self._progress:
            if text.startswith("step ") and "/" in text:
                done, total = text.split()[1].split("/")
                assert self._step is not None  # start() added the scenario's steps task
                self._progress.update(self._step, completed=int(done), total=int(total), description=f"  {text}")
        else:
            print(f"    {text}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line that is no scenario's progress (the results folder's lock)."""
        if self._progress:
            self._progress.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def finish(self, outcome: Outcome) -> None:
        message = f"  -> {outcome.status} in {outcome.seconds:.1f}s: {outcome.path}"
        if outcome.error:
            message += f"\n     {outcome.error}"
        if outcome.noisy:
            import textwrap

            lines = textwrap.wrap(
                f"NOISY (not compared by the gate or the report): {outcome.noisy}",
                CONSOLE_WIDTH,
                initial_indent="     ",
                subsequent_indent="       ",
            )
            message += "\n" + "\n".join(lines)
        if self._progress:
            self._progress.advance(self._suite)
            self._progress.console.print(f"{outcome.scenario.name}{message}")
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress:
            self._progress.stop()


class SilentReporter(Reporter):
    """For the ranks of a launch other than rank 0: rank 0 reports for everyone."""

    def __init__(self, total: int):
        super().__init__(total, stream=open(os.devnull, "w"))  # noqa: SIM115 (the stream lives as long as the reporter)


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
        lock = results_lock(self.out_root, reporter.note) if self.writes_results and not self.plan_only else None
        try:
            for scenario in scenarios:
                reporter.start(scenario, mode="plan" if self.plan_only else scenario.mode)
                outcome = self.run_one(scenario, reporter.line)
                reporter.finish(outcome)
                outcomes.append(outcome)
        finally:
            if lock is not None:
                lock.close()  # closing the file releases the lock
            reporter.close()
        return outcomes

    def run_one(self, scenario: Scenario, progress: Callable[[str], None]) -> Outcome:
        started = time.perf_counter()
        planned = self.plan_only or scenario.mode == "plan"
        if planned:
            from bench.predict.plan import plan_scenario

            metrics, details = plan_scenario(scenario)
            status, error, conditions = "ok", None, None
        else:
            status, error, metrics, details, conditions = self._execute(scenario, progress)
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
            from bench.run.execute import measure_peak_tflops

            self._cpu_peaks[key] = measure_peak_tflops(self.device, scenario.model.dtype.torch_dtype)
        # The ranks of a CPU layout share the cores the peak was measured on.
        ranks_here = 1 if self.launch is not None else scenario.world_size
        if mxfp8:
            missing["mfu_fp8"] = "no FP8 peak on a CPU (the MXFP8 GEMMs are emulated)"
        source = f"{key} dense matmul measured on all cores, divided by the ranks sharing them"
        return Peaks(self._cpu_peaks[key] / ranks_here, None, source), missing

    def _rank_memory(self, scenario: Scenario) -> list[RankMemory]:
        """Every rank's planned memory and its pool's free memory (inside a launch: gathered from the ranks)."""
        from bench.predict.plan import plan_scenario
        from moe_engine.parallel.layout import Layout

        _, plan = plan_scenario(scenario)
        stage_bytes = [int(s["memory_total_bytes"]) for s in plan["stages"]]
        layout, host = Layout(scenario.parallel_config), socket.gethostname()

        def entry(rank: int, device: torch.device) -> RankMemory:
            available, source = available_memory_bytes(device)
            name = str(device) if device.type == "cuda" else "cpu"
            return RankMemory(rank, host, name, stage_bytes[layout.coords(rank).pp_rank], available, source)

        if self.launch is not None:
            import torch.distributed as dist

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

    def _execute(self, scenario: Scenario, progress) -> tuple[str, str | None, dict, dict, dict | None]:
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
            outcome = self._run_worker(scenario, request, progress)
            conditions = watch.finish()
        else:
            outcome = self._run_worker(scenario, request, progress)
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

    def _run_worker(self, scenario: Scenario, request: WorkerRequest, progress) -> WorkerOutcome:
        timeout = scenario.run.timeout_s
        with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
            request_path, out_path = Path(tmp) / "request.json", Path(tmp) / "outcome.json"
            request_path.write_text(request.to_json())
            processes = 1 if scenario.mode == "proxy" else scenario.world_size
            command = worker_command(processes) + [str(request_path), str(out_path)]
            returncode, tail = run_with_timeout(command, timeout, progress, env=worker_env(processes))
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
        from bench.run.worker import execute_outcome
        from moe_engine.parallel.groups import build_process_groups
        from moe_engine.parallel.layout import Layout

        groups = build_process_groups(Layout(scenario.parallel_config))
        outcome = execute_outcome(scenario, request, self.device, groups)
        if self.writes_results:
            self._end_attempt(request.checkpoint, outcome)
        return outcome


def worker_command(world_size: int) -> list[str]:
    """The worker, under torchrun when the layout has several ranks (one process per rank)."""
    if world_size == 1:
        return [sys.executable, "-m", "bench.run.worker"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "--max-restarts=0",
        "-m",
        "bench.run.worker",
    ]


QUIET_LIBRARIES = {
    # The profiler's trace markers (USDT profiler_start/stop, one pair per profiled step and rank) print
    # at Kineto's highest level, so only a level above every one of them silences them.
    "KINETO_LOG_LEVEL": "6",
    # c10's C++ warnings, e.g. "No backend of type 0 found ... Assuming no hooks are registered" from every
    # rank as its process groups are destroyed; Python-level warnings are not affected.
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}
"""Log levels of the worker environment that keep library chatter off the user's console; a value the
caller's environment already sets wins (``KINETO_LOG_LEVEL=4 moe-bench run ...`` shows Kineto's errors)."""


def worker_env(world_size: int) -> dict[str, str]:
    """Share the cores between the ranks instead of letting each rank spawn a thread per core; quiet
    the libraries (``QUIET_LIBRARIES``)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    for name, value in QUIET_LIBRARIES.items():
        env.setdefault(name, value)
    return env


def run_with_timeout(
    command: list[str], timeout: float, on_line: Callable[[str], None], env: dict[str, str] | None = None
) -> tuple[int | None, list[str]]:
    """Run ``command``, relaying its output lines; kill its whole process group after ``timeout``.

    Returns (exit code or None on timeout, the last output lines).
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        return _relay(process, lines, time.monotonic() + timeout, on_line)
    except BaseException:
        # Interrupted (Ctrl-C, or SIGTERM through bench.termination): the worker's own session gets
        # neither signal.
        kill_process_group(process)
        raise


def _relay(
    process: subprocess.Popen, lines: queue.Queue[str | None], deadline: float, on_line: Callable[[str], None]
) -> tuple[int | None, list[str]]:
    """``run_with_timeout``'s loop: relay lines until the output ends (then wait) or the deadline passes."""
    tail: list[str] = []
    finished_output = False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            kill_process_group(process)
            return None, tail
        try:
            line = lines.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            line = ""
        if line is None:
            finished_output = True
        elif line:
            tail = (tail + [line])[-20:]
            on_line(line)
        if finished_output:
            try:
                return process.wait(timeout=max(0.0, deadline - time.monotonic())), tail
            except subprocess.TimeoutExpired:
                kill_process_group(process)
                return None, tail


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # The command name may contain spaces; the parent pid follows its closing parenthesis.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_process_group(process: subprocess.Popen) -> None:
    """Kill the process, its process group, and descendants that left the group (torchrun's ranks)."""
    stragglers = _descendants(process.pid)
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)
    for pid in stragglers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


LOCK_NAME = ".moe-bench.lock"


def results_lock(out_root: Path, say: Callable[[str], None]):
    """Hold the results folder for this run: a second ``moe-bench run`` into the same folder waits
    (saying for whom) until the first ends. Two runs at once share the cores, and each would measure
    the other: both results would be noisy. The lock is the open file returned (``fcntl.flock``, released
    when it is closed or the process ends, however it ends)."""
    import fcntl

    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    handle = open(out_root / LOCK_NAME, "a+")  # noqa: SIM115 (held for the run; the caller closes it)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another moe-bench run"
        say(f"waiting: {holder} is running into {out_root} (two runs at once would measure each other)")
        fcntl.flock(handle, fcntl.LOCK_EX)
    handle.seek(0)
    handle.truncate()
    handle.write(f"moe-bench run (pid {os.getpid()}, started {utc_now()})\n")
    handle.flush()
    return handle
