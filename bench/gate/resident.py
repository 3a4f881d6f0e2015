"""Resident A/B sides: one long-lived worker process (group) per side, timed in alternating blocks.

Each side is ``bench/gate/resident_worker.py`` running on its own tree's code, built and warmed
once. The controller alternates short blocks of steps, baseline and candidate, in an order that
flips every pair (AB, BA, AB, ...), so drift of the machine hits both sides within seconds and
cancels over pairs; start-up is paid once. ``compare_resident`` samples until the paired
statistics (``bench.gate.paired``) decide, or the time budget runs out.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.gate import paired
from bench.scenario import Scenario

WORKER_SCRIPT = Path(__file__).with_name("resident_worker.py")
TARGET_BLOCK_S = 0.6
"""Seconds a block aims at: long enough to dwarf the timer and the barrier, short enough that a
pair sees the same machine state."""


class WorkerDied(RuntimeError):
    """A side's worker exited or stopped answering: the scenario fails with its error."""


class WorkerFailedToStart(WorkerDied):
    """A side's worker died before it was ready: nothing can be measured (bad input for the gate)."""


class ResidentSide:
    """One side's worker; a context manager that never leaves a process behind."""

    def __init__(self, label: str, root: Path, scenario: Scenario, device: str, timeout_s: float):
        self.label, self.root, self.scenario, self.device, self.timeout_s = (
            label,
            Path(root),
            scenario,
            device,
            timeout_s,
        )
        self._tmp = tempfile.TemporaryDirectory(prefix=f"moe-ab-{label}-")
        self.stderr_path = Path(self._tmp.name) / "stderr.log"
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.process: subprocess.Popen | None = None
        self.last_losses: list[float] = []
        """The losses of the last block (both sides of identical code give identical ones)."""

    def __enter__(self) -> ResidentSide:
        spec_file = Path(self._tmp.name) / "scenario.json"
        spec_file.write_text(
            json.dumps({"spec": self._spec_as_written(), "file": str(self.scenario.file), "timeout_s": self.timeout_s})
        )
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        # One side runs at a time, its ranks sharing every core, as the runner gives a launch's ranks.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.scenario.world_size)))
        self._stderr = self.stderr_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), str(spec_file), "--device", self.device],
            cwd=self.root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._receive("ready")
        except WorkerDied as err:
            self.close()
            raise WorkerFailedToStart(f"{self.scenario.name}: {err}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _spec_as_written(self) -> dict:
        """The scenario as its file says it: each side's loader fills in its own defaults (an older
        baseline's schema does not know the fields a newer loader adds)."""
        path = Path(self.scenario.file) if self.scenario.file else None
        if path is not None and path.is_file():
            return yaml.safe_load(path.read_text())
        return self.scenario.spec

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None  # started with stdout=PIPE
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _receive(self, key: str) -> dict:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise WorkerDied(f"{self.label} worker gave no answer within {self.timeout_s:.0f} s") from None
        if line is None:
            assert self.process is not None  # lines come from a started worker
            self.process.wait(timeout=30)
            raise WorkerDied(f"{self.label} worker exited with code {self.process.returncode}: {self.error_tail()}")
        message = json.loads(line)
        if key not in message:
            raise WorkerDied(f"{self.label} worker answered {line.strip()!r}, expected {key}")
        return message

    def error_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [x for x in self.stderr_path.read_text().splitlines() if x.strip()]
            return lines[-1] if lines else "no error output"
        return "no error output"

    def block(self, steps: int) -> float:
        """Seconds of ``steps`` steps on this side (the slowest rank's)."""
        with contextlib.suppress(BrokenPipeError, OSError):  # the worker is gone: _receive says how
            self._send({"block": steps})
        reply = self._receive("seconds")
        self.last_losses = reply["losses"]
        return float(reply["seconds"])

    def _send(self, message: dict) -> None:
        """One line to the worker; BrokenPipeError or OSError when it is gone."""
        assert self.process is not None and self.process.stdin is not None  # started with stdin=PIPE
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._send({"stop": True})
            with contextlib.suppress(subprocess.TimeoutExpired):  # then killed below
                self.process.wait(timeout=10)
        if self.process is not None:
            # The worker's ranks share its session: nothing of either side outlives the scenario.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        with contextlib.suppress(OSError, AttributeError):
            self._stderr.close()
        self._tmp.cleanup()


@dataclass
class ResidentComparison:
    """What the paired blocks of one scenario showed."""

    scenario: str
    steps_per_block: int
    baseline_s: list[float] = field(default_factory=list)
    candidate_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    estimate: paired.PairedEstimate | None = None
    verdict: str = "inconclusive"
    stopped_by: str = ""
    """"decided" (the interval got narrower than the tolerance) or "budget" (time ran out)."""


def compare_resident(
    baseline: ResidentSide,
    candidate: ResidentSide,
    tolerance: float,
    budget_s: float,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    stop_early: bool = True,
) -> ResidentComparison:
    """Alternate blocks until the paired test decides (``stop_early``) or ``budget_s`` is spent."""
    start = clock()
    probe = [baseline.block(1), candidate.block(1)]
    steps = max(1, round(TARGET_BLOCK_S / max(min(probe), 1e-6)))
    # One unrecorded block of the final size per side: the first blocks of a process still grow its
    # allocator pools and caches, which would bias the first pairs toward whichever side ran first.
    baseline.block(steps), candidate.block(steps)
    result = ResidentComparison(baseline.scenario.name, steps)
    while True:
        first, second = (baseline, candidate) if len(result.baseline_s) % 2 == 0 else (candidate, baseline)
        times = {first.label: first.block(steps), second.label: second.block(steps)}
        result.baseline_s.append(times[baseline.label])
        result.candidate_s.append(times[candidate.label])
        n = len(result.baseline_s)
        if n >= 2:
            result.estimate = paired.hodges_lehmann(paired.log_ratios(result.baseline_s, result.candidate_s))
            result.verdict = paired.verdict(result.estimate, tolerance)
        # The estimate exists from the second pair on.
        if stop_early and result.estimate is not None and paired.decided(result.estimate, tolerance):
            result.stopped_by = "decided"
            break
        if clock() - start >= budget_s and n >= paired.MIN_PAIRS:
            result.stopped_by = "budget"
            break
        if n % 10 == 0 and result.estimate is not None:
            lo, hi = result.estimate.interval
            log(f"  {n} pairs: x{1 + result.estimate.slowdown:.3f} [{1 + lo:.3f}, {1 + hi:.3f}]")
    result.seconds = clock() - start
    return result
