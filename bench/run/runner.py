"""Run scenarios: plans in process, executes in a worker process with a timeout; write results.

Every scenario is loaded and validated before any work starts. A scenario that fails, runs out of
memory or times out is recorded with that status and the suite goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from bench.machine import machine_info, peak_tflops
from bench.release.version import engine_info
from bench.results import SCHEMA_VERSION, result_dir, scenario_hash, utc_now, write_result
from bench.run.launch import Launch
from bench.scenario import SCENARIOS_DIR, Scenario, ScenarioError, load_scenario

SUITES_PATH = SCENARIOS_DIR / "suites.yaml"


def suite_files(name: str, device: torch.device) -> list[Path]:
    suites = yaml.safe_load(SUITES_PATH.read_text())
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
    path: Path
    metrics: dict[str, Any]
    seconds: float


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
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(), transient=True,
            )
            self._progress.start()
            self._suite = self._progress.add_task("suite", total=total)
            self._step = None

    def start(self, scenario: Scenario) -> None:
        self.index += 1
        label = f"[{self.index}/{self.total}] {scenario.name} ({scenario.mode})"
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
                self._progress.update(self._step, completed=int(done), total=int(total), description=f"  {text}")
        else:
            print(f"    {text}", file=self.stream, flush=True)

    def finish(self, outcome: Outcome) -> None:
        message = f"  -> {outcome.status} in {outcome.seconds:.1f}s: {outcome.path}"
        if outcome.error:
            message += f"\n     {outcome.error}"
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
        super().__init__(total, stream=open(os.devnull, "w"))


class Runner:
    def __init__(
        self,
        device: torch.device,
        out_root: Path,
        reporter_factory: Callable[[int], Reporter] = Reporter,
        launch: Launch | None = None,
    ):
        self.device = device
        self.launch = launch
        self.out_root = Path(out_root)
        self.machine = machine_info()
        self.engine = engine_info()
        self.reporter_factory = reporter_factory
        self._peaks: dict[str, float | None] = {}

    @property
    def out_dir(self) -> Path:
        return result_dir(self.out_root, self.engine["version"], self.machine["name"])

    def run(self, scenarios: list[Scenario]) -> list[Outcome]:
        reporter = self.reporter_factory(len(scenarios))
        outcomes = []
        try:
            for scenario in scenarios:
                reporter.start(scenario)
                outcome = self.run_one(scenario, reporter.line)
                reporter.finish(outcome)
                outcomes.append(outcome)
        finally:
            reporter.close()
        return outcomes

    def run_one(self, scenario: Scenario, progress: Callable[[str], None]) -> Outcome:
        started = time.perf_counter()
        if scenario.mode == "plan":
            from bench.predict.plan import plan_scenario

            metrics, details = plan_scenario(scenario)
            status, error = "ok", None
        else:
            status, error, metrics, details = self._execute(scenario, progress)
        seconds = time.perf_counter() - started
        document = self.document(scenario, status, error, metrics, details, seconds)
        path = write_result(document, self.out_dir) if self.writes_results else None
        return Outcome(scenario, status, error, path, metrics, seconds)

    @property
    def writes_results(self) -> bool:
        """Inside a launch only rank 0 writes; the other ranks compute the same outcomes."""
        return self.launch is None or self.launch.rank == 0

    def document(self, scenario, status, error, metrics, details, seconds) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "engine": self.engine,
            "timestamp": utc_now(),
            "duration_s": seconds,
            "machine": self.machine,
            "scenario": {
                "name": scenario.name,
                "file": str(scenario.file) if scenario.file else None,
                "hash": scenario_hash(scenario.spec),
                "spec": scenario.spec,
            },
            "mode": scenario.mode,
            "device": "none" if scenario.mode == "plan" else str(self.device),
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

    def _peak(self, scenario: Scenario) -> float | None:
        if scenario.mode == "proxy":
            return None
        if self.device.type == "cuda":
            return peak_tflops(self.device)
        key = scenario.model.dtype.value
        if key not in self._peaks:
            from bench.run.execute import measure_peak_tflops

            self._peaks[key] = measure_peak_tflops(self.device, scenario.model.dtype.torch_dtype)
        # The ranks of a CPU layout share the cores the peak was measured on.
        ranks_here = 1 if self.launch is not None else scenario.world_size
        return self._peaks[key] / ranks_here

    def _execute(self, scenario: Scenario, progress) -> tuple[str, str | None, dict, dict]:
        reason = self._skip_reason(scenario)
        if reason:
            return "skipped", reason, {}, {}
        peak = self._peak(scenario)
        if self.launch is not None:
            return self._execute_in_launch(scenario, peak)
        timeout = scenario.run["timeout_s"]
        with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
            spec_path, out_path = Path(tmp) / "scenario.json", Path(tmp) / "outcome.json"
            spec_path.write_text(json.dumps({"spec": scenario.spec, "file": str(scenario.file) if scenario.file else None}))
            processes = 1 if scenario.mode == "proxy" else scenario.world_size
            command = worker_command(processes) + [str(spec_path), str(out_path), "--device", str(self.device)]
            if peak:
                command += ["--peak-tflops", str(peak)]
            returncode, tail = run_with_timeout(command, timeout, progress, env=worker_env(processes))
            if returncode is None:
                return "timeout", f"stopped after exceeding its timeout of {timeout:g} s", {}, {}
            if not out_path.exists():
                rank_errors = sorted(Path(tmp).glob("outcome.json.rank*.error"))
                detail = rank_errors[0].read_text() if rank_errors else (tail[-1] if tail else "no output")
                status = "oom" if returncode in (-signal.SIGKILL, 137) else "failed"
                return status, f"worker exited with code {returncode}: {detail}", {}, {}
            outcome = json.loads(out_path.read_text())
        details = outcome["details"]
        details.setdefault("peak_tflops", peak)
        return outcome["status"], outcome["error"], outcome["metrics"], details


    def _execute_in_launch(self, scenario: Scenario, peak: float | None) -> tuple[str, str | None, dict, dict]:
        """Every rank of the launch executes its share here; the process group's timeout bounds hangs."""
        from bench.run.worker import execute_outcome
        from moe_engine.parallel.groups import build_process_groups
        from moe_engine.parallel.layout import Layout

        groups = build_process_groups(Layout(scenario.parallel_config))
        outcome = execute_outcome(scenario, self.device, peak, groups)
        details = outcome["details"]
        details.setdefault("peak_tflops", peak)
        return outcome["status"], outcome["error"], outcome["metrics"], details


def worker_command(world_size: int) -> list[str]:
    """The worker, under torchrun when the layout has several ranks (one process per rank)."""
    if world_size == 1:
        return [sys.executable, "-m", "bench.run.worker"]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        "--max-restarts=0", "-m", "bench.run.worker",
    ]


def worker_env(world_size: int) -> dict[str, str]:
    """Share the cores between the ranks instead of letting each rank spawn a thread per core."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def run_with_timeout(
    command: list[str], timeout: float, on_line: Callable[[str], None], env: dict[str, str] | None = None
) -> tuple[int | None, list[str]]:
    """Run ``command``, relaying its output lines; kill its whole process group after ``timeout``.

    Returns (exit code or None on timeout, the last output lines).
    """
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        cwd=Path(__file__).resolve().parent.parent, env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
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
