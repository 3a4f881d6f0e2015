"""The runner's console: each scenario's progress as plain lines (CI, pipes) or a rich live display
on a terminal, and its outcome in lines no wider than ``CONSOLE_WIDTH``.

``TraceBars`` draws a projection's stage traces (``moe-bench project``) from its log records.

A worker's output lines reach the runner's console as records of ``bench.run.process.OUTPUT``: while a ``Reporter`` is
open it takes them (and they reach no other handler), so they show under their scenario.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import textwrap
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from bench.run.process import OUTPUT

if TYPE_CHECKING:
    from rich.progress import TaskID

    from bench.run.runner import Outcome
    from bench.scenario import Scenario

CONSOLE_WIDTH = 120
"""The widest line the runner's own messages take (logs are read in terminals and editors)."""


class _Lines(logging.Handler):
    """Hands each relayed output line to the reporter."""

    def __init__(self, reporter: Reporter):
        super().__init__()
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        self.reporter.line(record.getMessage())


class Reporter:
    """Progress output: plain lines (CI, pipes) or a rich live display on a terminal. It takes the
    relayed worker lines (``OUTPUT``) from its creation until ``close``."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stdout
        self._lines = _Lines(self)
        self._before = OUTPUT.level, OUTPUT.propagate
        OUTPUT.addHandler(self._lines)
        OUTPUT.setLevel(logging.INFO)
        OUTPUT.propagate = False
        self.rich = self.stream.isatty() and not os.environ.get("CI")
        self.total, self.index = total, 0
        self._progress = None
        if self.rich:
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

    def finish(self, outcome: Outcome) -> None:
        message = f"  -> {outcome.status} in {outcome.seconds:.1f}s: {outcome.path}"
        if outcome.error:
            message += f"\n     {outcome.error}"
        if outcome.noisy:
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
        OUTPUT.removeHandler(self._lines)
        OUTPUT.setLevel(self._before[0])
        OUTPUT.propagate = self._before[1]
        if self._progress:
            self._progress.stop()


class SilentReporter(Reporter):
    """For the ranks of a launch other than rank 0: rank 0 reports for everyone."""

    def __init__(self, total: int):
        super().__init__(total, stream=open(os.devnull, "w"))  # noqa: SIM115 (the stream lives as long as the reporter)


TRACE_LOGGERS = ("bench.run.project", "bench.run.trace")
"""Whose records a ``TraceBars`` takes while it is open: the stages' (``bench.run.project.StageLog``) and
the lines of the stage being traced."""


class TraceBars(logging.Handler):
    """A projection's stage traces on a terminal, drawn from its log records (``TRACE_LOGGERS``) while
    open: a rich bar for the stages and one per stage with its ops traced so far and its time; a line per
    finished stage stays above them. The records reach no other handler meanwhile."""

    def __init__(self, stream):
        super().__init__(logging.DEBUG)
        self._bars = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=Console(file=stream),
            transient=True,
        )
        self._overall: TaskID | None = None
        self._tasks: dict[int, TaskID] = {}
        self._current: int | None = None
        self._saved: list[tuple[logging.Logger, int, bool]] = []

    def __enter__(self) -> TraceBars:
        self._bars.start()
        for name in TRACE_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.level, logger.propagate))
            # Every count of ops is a debug record: the bars take each one.
            logger.setLevel(logging.DEBUG)
            logger.propagate = False
            logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for logger, level, propagate in self._saved:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate
        self._saved = []
        self._bars.stop()

    def emit(self, record: logging.LogRecord) -> None:
        fields = record.__dict__  # the ``extra`` of StageLog's records
        event, stage = fields.get("stage_event"), fields.get("stage", 0)
        if event == "begin":
            self._bars.console.print(record.getMessage(), highlight=False, soft_wrap=True)
            self._overall = self._bars.add_task(f"{fields['scenario']}: stages", total=fields["stages"], detail="")
        elif event == "stage":
            self._current = stage
            self._tasks[stage] = self._bars.add_task(
                f"  stage {stage} of {fields['stages']} (rank {fields['rank']})", total=None, detail=fields["detail"]
            )
        elif event == "ops" and stage in self._tasks:
            self._bars.update(self._tasks[stage], detail=fields["detail"])
        elif event == "done":
            if stage in self._tasks:
                self._bars.remove_task(self._tasks.pop(stage))
            if self._overall is not None:
                self._bars.advance(self._overall)
            self._bars.console.print(record.getMessage(), highlight=False, soft_wrap=True)
        elif record.levelno >= logging.WARNING:
            self._bars.console.print(record.getMessage(), highlight=False, soft_wrap=True)
        elif self._current in self._tasks and record.levelno >= logging.INFO:
            # A line of the trace itself (building the rank, tracing the step): the stage's detail.
            self._bars.update(self._tasks[self._current], detail=record.getMessage())


def trace_display(stream) -> TraceBars | contextlib.nullcontext:
    """Bars on a terminal (not under CI); elsewhere nothing, and the records are plain log lines."""
    if stream.isatty() and not os.environ.get("CI"):
        return TraceBars(stream)
    return contextlib.nullcontext()
