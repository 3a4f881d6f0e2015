"""Resident A/B sides: one long-lived worker process (group) per side, timed in alternating blocks.

Each side is ``bench/ab/resident_worker.py`` running on its own tree's code, built and warmed
once. The controller alternates short blocks of steps, one side's bracketed by the other's, so drift
of the machine hits both sides within seconds and cancels in each ratio. A worker keeps a bias of its own for its whole life, so ``compare_resident``
runs several fresh worker pairs (``fresh_pair``), a few block pairs each, until the pooled
statistics (``bench.gate.paired``) decide, or the time budget runs out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.ab.deadline import SuiteDeadline
from bench.gate import paired
from bench.run.process import kill_process_group
from bench.scenario import Scenario

logger = logging.getLogger(__name__)

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

    def __init__(
        self,
        label: str,
        root: Path,
        scenario: Scenario,
        device: str,
        timeout_s: float,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ):
        self.label, self.root, self.scenario, self.device, self.timeout_s = (
            label,
            Path(root),
            scenario,
            device,
            timeout_s,
        )
        self.env, self.prefix = dict(env or {}), prefix
        """Extra environment and a command prefix for the worker (``bench.validate.worker_bias``'s variants)."""
        self._tmp = tempfile.TemporaryDirectory(prefix=f"moe-ab-{label}-")
        self.stderr_path = Path(self._tmp.name) / "stderr.log"
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.process: subprocess.Popen | None = None
        self.last_losses: list[float] = []
        """The losses of the last block (both sides of identical code give identical ones)."""

    def __enter__(self) -> ResidentSide:
        spec_file = Path(self._tmp.name) / "scenario.json"
        spec_file.write_text(
            json.dumps(
                {
                    "spec": self._spec_as_written(),
                    "file": str(self.scenario.file),
                    "timeout_s": self.timeout_s,
                }
            )
        )
        env = {**os.environ, **self.env, "PYTHONPATH": str(self.root)}
        # One side runs at a time, its ranks sharing every core, as the runner gives a launch's ranks.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.scenario.world_size)))
        self._stderr = self.stderr_path.open("w")
        self.process = subprocess.Popen(
            [*self.prefix, sys.executable, str(WORKER_SCRIPT), str(spec_file), "--device", self.device],
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
            kill_process_group(self.process)
        with contextlib.suppress(OSError, AttributeError):
            self._stderr.close()
        self._tmp.cleanup()


@contextlib.contextmanager
def fresh_pair(
    baseline_root: Path,
    candidate_root: Path,
    scenario: Scenario,
    device: str,
    timeout_s: float,
    candidate_first: bool = False,
) -> Iterator[tuple[ResidentSide, ResidentSide]]:
    """A new worker of each side, started in the order given, both closed on exit: one worker pair of
    ``compare_resident``."""
    with contextlib.ExitStack() as stack:
        order = ["candidate", "baseline"] if candidate_first else ["baseline", "candidate"]
        roots = {"baseline": baseline_root, "candidate": candidate_root}
        started = {
            label: stack.enter_context(ResidentSide(label, roots[label], scenario, device, timeout_s))
            for label in order
        }
        yield started["baseline"], started["candidate"]


@dataclass
class WorkerPairBlocks:
    """The block times of one pair of workers, in run order: the ``outer`` side's blocks bracket the
    other's (``O_1 I_1 O_2 I_2 ... I_n O_n+1``)."""

    baseline_s: list[float] = field(default_factory=list)
    candidate_s: list[float] = field(default_factory=list)
    outer: str = "baseline"
    """The side whose blocks come first and last ("baseline" or "candidate")."""

    @property
    def log_ratios(self) -> list[float]:
        """log(t_candidate / t_baseline) of each inner block against the mean of the two outer blocks
        around it, in log space: a drift that is linear over three blocks cancels."""
        outer, inner = (
            (self.baseline_s, self.candidate_s) if self.outer == "baseline" else (self.candidate_s, self.baseline_s)
        )
        if len(outer) != len(inner) + 1:
            raise ValueError(f"{len(inner)} inner blocks need {len(inner) + 1} outer blocks, got {len(outer)}")
        sign = 1.0 if self.outer == "baseline" else -1.0
        return [
            sign * (math.log(t) - (math.log(before) + math.log(after)) / 2)
            for t, before, after in zip(inner, outer, outer[1:])
        ]


@dataclass
class ResidentComparison:
    """What the paired blocks of one scenario showed, over its worker pairs."""

    scenario: str
    steps_per_block: int
    pairs: list[WorkerPairBlocks] = field(default_factory=list)
    seconds: float = 0.0
    estimate: paired.PooledEstimate | None = None
    verdict: str = "inconclusive"
    stopped_by: str = ""
    """"decided" (the interval got narrower than the tolerance), "budget" (time ran out),
    "extension" (time ran out again after the one extension an inconclusive verdict gets),
    "deadline" (an extension the gate's time limit had no room for) or "confirmation" (the fresh
    pairs that confirm a failing estimate are done, or as many as the gate's time limit held)."""
    unconfirmed: paired.PooledEstimate | None = None
    """The estimate that a confirmation put to the test (None where none ran)."""
    extension_refused: bool = False
    """An inconclusive verdict the gate's time limit had no room to extend (kept when a confirmation
    follows and ``stopped_by`` says so)."""

    @property
    def confirmation_pairs(self) -> int:
        """Fresh pairs the confirmation ran: as many as the first reading's, or fewer where the gate's
        time limit cut it (0: none ran)."""
        return len(self.pairs) - self.unconfirmed.worker_pairs if self.unconfirmed is not None else 0

    @property
    def baseline_s(self) -> list[float]:
        """Every baseline block, pair after pair."""
        return [t for pair in self.pairs for t in pair.baseline_s]

    @property
    def candidate_s(self) -> list[float]:
        return [t for pair in self.pairs for t in pair.candidate_s]

    @property
    def block_pairs(self) -> int:
        """The log-ratios over all pairs (one per inner block)."""
        return sum(len(pair.log_ratios) for pair in self.pairs)


Side = Any
"""A side as ``compare_resident`` uses it: ``label``, ``scenario`` and ``block(steps) -> seconds``
(a ``ResidentSide``, or a stand-in in tests)."""


def compare_resident(
    open_pair: Callable[..., contextlib.AbstractContextManager[tuple[Side, Side]]],
    tolerance: float,
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
    stop_early: bool = True,
    extension_s: float = 0.0,
    confirm: bool = False,
    deadline: SuiteDeadline | None = None,
) -> ResidentComparison:
    """Run fresh worker pairs (``open_pair(candidate_first=...)``) until the pooled interval decides (``stop_early``) or ``budget_s``
    is spent; an inconclusive verdict then gets ``extension_s`` more, once (``bench.gate.paired``).
    With ``confirm``, a comparison that would fail the gate (``paired.fails``) is confirmed: as many
    fresh pairs again, and the verdict is read over all of them (``bench.gate.paired``, Confirmation).
    ``deadline``: the gate's time limit, which the extension (with one pair past it) and the
    confirmation's pairs must fit in (``bench.ab.deadline``), a pair taking what the last one took.

    Each pair: one unrecorded warm block per side, then ``B`` blocks of one side bracketed by ``B + 1``
    of the other (``WorkerPairBlocks``), the sides changing places from pair to pair;
    ``B`` starts at ``paired.MIN_BLOCKS_PER_PAIR`` and is set once, after ``paired.MIN_WORKER_PAIRS``
    pairs, by ``paired.blocks_per_pair`` from the measured variance components and costs. The first
    pair's one-step probes size the blocks (``TARGET_BLOCK_S``) for every pair.
    """
    start = clock()
    run = _PairRunner(open_pair, clock)
    blocks, ends_s, stopped_by = paired.MIN_BLOCKS_PER_PAIR, budget_s, "budget"
    while True:
        result = run.pair(blocks)
        n = len(result.pairs)
        _estimate(result, tolerance)
        if stop_early and result.estimate is not None and paired.decided_pooled(result.estimate, tolerance):
            stopped_by = "decided"
            if deadline is not None and ends_s == budget_s:
                deadline.budget_spent(unused_s=budget_s - (clock() - start))
            break
        if clock() - start >= ends_s and n >= paired.MIN_WORKER_PAIRS:
            if ends_s == budget_s and deadline is not None:
                deadline.budget_spent()
            if result.verdict != "inconclusive" or ends_s > budget_s or extension_s <= 0:
                break
            if deadline is not None and deadline.left_s() < extension_s + run.last_pair_s:
                stopped_by, result.extension_refused = "deadline", True
                logger.info(f"  inconclusive after {n} worker pairs: the gate's time limit leaves no room to extend")
                break
            ends_s, stopped_by = budget_s + extension_s, "extension"
            logger.info(f"  inconclusive after {n} worker pairs: extending by {extension_s:g} s, once")
        if n == paired.MIN_WORKER_PAIRS and result.estimate is not None:
            blocks = paired.blocks_per_pair(result.estimate, blocks, run.pair_s, run.block_pair_s)
        _log_estimate(result)
    assert result.estimate is not None  # the loop stops after paired.MIN_WORKER_PAIRS pairs at least
    if confirm and paired.fails(result.estimate, tolerance):
        n = len(result.pairs)
        result.unconfirmed = result.estimate
        logger.info(
            f"  {result.verdict} at x{1 + result.estimate.slowdown:.3f} after {n} worker pairs: "
            f"confirming on {n} fresh pairs"
        )
        _log_estimate(result)
        for _ in range(n):
            if deadline is not None and deadline.left_s() < run.last_pair_s:
                logger.info(
                    f"  the gate's time limit holds no more pairs: confirmed on {result.confirmation_pairs} of {n}"
                )
                break
            result = run.pair(blocks)
            _estimate(result, tolerance)
        stopped_by = "confirmation"
    result.stopped_by = stopped_by
    result.seconds = clock() - start
    return result


def _estimate(result: ResidentComparison, tolerance: float) -> None:
    """The pooled estimate and verdict over the pairs run so far (from two pairs on)."""
    if len(result.pairs) >= 2:
        result.estimate = paired.pooled([pair.log_ratios for pair in result.pairs])
        result.verdict = paired.verdict(result.estimate, tolerance)


def _log_estimate(result: ResidentComparison) -> None:
    if result.estimate is not None:
        lo, hi = result.estimate.interval
        logger.info(
            f"  {len(result.pairs)} worker pairs: x{1 + result.estimate.slowdown:.3f} [{1 + lo:.3f}, {1 + hi:.3f}], "
            f"pair spread {result.estimate.between_sd:.2%}, block spread {result.estimate.within_sd:.2%}"
        )


class _PairRunner:
    """Runs one worker pair after another for ``compare_resident``, and keeps what they cost."""

    def __init__(self, open_pair: Callable[..., contextlib.AbstractContextManager[tuple[Side, Side]]], clock):
        self.open_pair, self.clock = open_pair, clock
        self.result: ResidentComparison | None = None
        self.pair_s = 0.0
        """Seconds to start and warm the last pair of workers."""
        self.block_pair_s = 0.0
        """Seconds of one block pair in the last pair."""
        self.last_pair_s = 0.0
        """Seconds the last pair took, start-up to close."""

    def pair(self, blocks: int) -> ResidentComparison:
        """One fresh worker pair with ``blocks`` block pairs, added to the comparison (returned)."""
        pair_started = self.clock()
        index = len(self.result.pairs) if self.result is not None else 0
        # The sides take turns at the outer place, pair by pair, so that neither is always first.
        times = WorkerPairBlocks(outer="baseline" if index % 2 == 0 else "candidate")
        # Which worker starts first changes every two pairs, and the outer place every pair: the four
        # combinations come round every four pairs, so an effect of either cancels over them.
        with self.open_pair(candidate_first=index // 2 % 2 == 1) as (baseline, candidate):
            if self.result is None:
                probe = [baseline.block(1), candidate.block(1)]
                steps = max(1, round(TARGET_BLOCK_S / max(min(probe), 1e-6)))
                self.result = ResidentComparison(baseline.scenario.name, steps)
            steps = self.result.steps_per_block
            outer, inner = (baseline, candidate) if times.outer == "baseline" else (candidate, baseline)
            # One unrecorded block of the final size per side: the first blocks of a process still grow
            # its allocator pools and caches. The inner side warms last, so that every recorded block
            # follows the other side's: a side that runs twice in a row finds its data still in the
            # caches (under the old AB, BA order, A/A calibrations of e8-skewed-fp32 leaned about 1%
            # toward the side that did, on a 2-core AMD EPYC).
            outer.block(steps), inner.block(steps)
            blocks_started = self.clock()
            self.pair_s = blocks_started - pair_started
            record = {baseline.label: times.baseline_s, candidate.label: times.candidate_s}
            record[outer.label].append(outer.block(steps))
            for _ in range(blocks):
                record[inner.label].append(inner.block(steps))
                record[outer.label].append(outer.block(steps))
            self.block_pair_s = (self.clock() - blocks_started) / blocks
        self.last_pair_s = self.clock() - pair_started
        self.result.pairs.append(times)
        return self.result
