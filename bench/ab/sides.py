"""One side of the A/B gate: one ``moe-bench run`` of a scenario with the code of a checkout (``run_side``),
its result document as the gate reads it (``SideRun``), in a process session killed whole on timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.results import ResultFileError, load_results
from bench.run.process import kill_process_group
from bench.scenario import Scenario

__all__ = ["START_MARGIN_S", "SideRun", "run_side", "side_summary"]

START_MARGIN_S = 120.0  # start-up of a side (imports, CPU peak measurement) on top of the scenario's timeout


@dataclass(frozen=True)
class SideRun:
    """One ``moe-bench run`` of one scenario on one side."""

    status: str
    error: str | None
    metrics: dict[str, dict[str, Any]]
    version: str | None = None
    mode: str = "execute"
    """The scenario's mode: a plan's figures are arithmetic, so they are compared but never gated."""
    details: dict[str, Any] = field(default_factory=dict)
    """The result document's details (the work census among them)."""


def run_side(root: Path, scenario: Scenario, out: Path, device: str) -> SideRun:
    """One ``moe-bench run`` of ``scenario`` with the code at ``root``; its result document, or why none."""
    if scenario.file is None:
        raise ValueError(f"scenario {scenario.name}: an A/B side runs a scenario file, and this one has none")
    command = [
        sys.executable,
        "-m",
        "bench.cli",
        "run",
        str(Path(scenario.file).resolve()),
        "--out",
        str(out),
        "--no-plots",
        "--device",
        device,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    returncode, output = _run(command, root, env, scenario.run.timeout_s + START_MARGIN_S)
    try:
        docs = load_results(out) if out.is_dir() else []
    except ResultFileError as err:  # the side wrote a file that cannot be read back
        return SideRun("failed", str(err), {})
    if len(docs) == 1:
        doc = docs[0]
        return SideRun(
            doc.status,
            doc.data.get("error"),
            doc.metrics,
            doc.version,
            doc.data.get("mode", "execute"),
            doc.data.get("details", {}),
        )
    last = output.strip().splitlines()[-1:] or ["no output"]
    reason = "timed out" if returncode is None else f"moe-bench exited with code {returncode}: {last[0]}"
    return SideRun("failed", reason, {})


def side_summary(run: SideRun) -> str:
    """One line on a side's run, as the A/B gate's log prints it."""
    if run.status != "ok":
        return f"{run.status} ({run.error})"
    tput = run.metrics.get("tokens_per_s_per_gpu")
    return f"ok, {tput['median']:,.0f} tokens/s/GPU" if tput else "ok"


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run in a new session; on timeout or interrupt kill the whole session. (exit code or None, output)."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        kill_process_group(process)
        return None, process.stdout.read() if process.stdout else ""
    except BaseException:
        kill_process_group(process)
        raise
