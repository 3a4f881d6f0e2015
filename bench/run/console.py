"""The runner's console: each scenario's progress as plain lines (CI, pipes) or a rich live display
on a terminal, and its outcome in lines no wider than ``CONSOLE_WIDTH``."""

from __future__ import annotations

import os
import sys
import textwrap
from typing import TYPE_CHECKING

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from rich.progress import TaskID

    from bench.run.runner import Outcome
    from bench.scenario import Scenario

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
