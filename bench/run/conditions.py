"""What the machine was doing while a scenario ran, and whether that makes the result ``noisy``.
More: docs/step-measurement.md.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import calibrate

SHARED_CORES = 0.10
"""Other processes' share of the run's core time (cores x wall time) above which it shared its cores.
An idle 2-core VM shows 0-3% (the kernel, the shell, a monitoring agent)."""
STEAL = 0.05
"""Steal's share of the run's core time above which the hypervisor took the cores."""
CALIBRATION_MOVE = 0.10
"""Relative change of the calibration between start and end above which the machine changed under
the run; one quiet machine repeats it within a few percent."""


@dataclass(frozen=True)
class Snapshot:
    """The machine's counters at one moment."""

    wall: float
    """time.monotonic()."""
    busy: float | None
    """Busy seconds of the run's cores (user, nice, system, irq, softirq), /proc/stat; None without it."""
    steal: float | None
    """Steal seconds of the run's cores."""
    own: float
    """CPU seconds of this process and of the children it waited for (os.times)."""
    load: float | None
    """1-minute load average."""


def _cpu_ids() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def _proc_stat(cpus: set[int]) -> tuple[float | None, float | None]:
    """(busy, steal) seconds summed over ``cpus``, from /proc/stat's per-CPU lines."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None, None
    tick = os.sysconf("SC_CLK_TCK")
    busy = steal = 0.0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]] + [0] * (8 - len(fields[:8]))
        user, nice, system, _idle, _iowait, irq, softirq, stolen = values
        busy += (user + nice + system + irq + softirq) / tick
        steal += stolen / tick
    return busy, steal


def snapshot() -> Snapshot:
    busy, steal = _proc_stat(_cpu_ids())
    times = os.times()
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:
        load = None
    own = times.user + times.system + times.children_user + times.children_system
    return Snapshot(time.monotonic(), busy, steal, own, load)


class Watch:
    """The conditions of one run: ``Watch.start()`` before it, ``finish()`` after."""

    def __init__(self, start: Snapshot, calibration: dict[str, Any]):
        self.start_snapshot = start
        self.start_calibration = calibration

    @classmethod
    def start(cls) -> Watch:
        calibration = calibrate()
        return cls(snapshot(), calibration)

    def finish(self) -> dict[str, Any]:
        """The ``conditions`` of the result document (results/schema.json)."""
        end = snapshot()
        end_calibration = calibrate()
        return conditions(self.start_snapshot, end, self.start_calibration, end_calibration, len(_cpu_ids()))


def conditions(
    start: Snapshot, end: Snapshot, start_cal: dict[str, Any], end_cal: dict[str, Any], cores: int
) -> dict[str, Any]:
    """The figures and the verdict (see the module doc) of a run between two snapshots."""
    wall = max(end.wall - start.wall, 1e-9)
    core_seconds = wall * cores
    other = steal = None
    if start.busy is not None and end.busy is not None:
        other = max(0.0, (end.busy - start.busy) - (end.own - start.own))
    if start.steal is not None and end.steal is not None:
        steal = max(0.0, end.steal - start.steal)
    move = end_cal["gflops"] / start_cal["gflops"] - 1.0 if start_cal["gflops"] else 0.0
    reasons = []
    if other is not None and other / core_seconds > SHARED_CORES:
        reasons.append(
            f"other processes used {other / core_seconds:.0%} of the {cores} core{'s' * (cores != 1)} "
            f"({other:.1f} CPU s in {wall:.1f} s; over {SHARED_CORES:.0%} means shared cores)"
        )
    if steal is not None and steal / core_seconds > STEAL:
        reasons.append(f"CPU steal {steal / core_seconds:.0%} of the run's core time (over {STEAL:.0%})")
    if abs(move) > CALIBRATION_MOVE:
        reasons.append(
            f"calibration moved {move:+.0%} during the run ({start_cal['gflops']:.1f} -> "
            f"{end_cal['gflops']:.1f} GFLOP/s; over {CALIBRATION_MOVE:.0%})"
        )
    return {
        "noisy": bool(reasons),
        "reasons": reasons,
        "cores": cores,
        "wall_s": wall,
        "load_before": start.load,
        "load_after": end.load,
        "other_cpu_s": other,
        "other_cpu_share": None if other is None else other / core_seconds,
        "steal_share": None if steal is None else steal / core_seconds,
        "calibration_start": start_cal,
        "calibration_end": end_cal,
        "thresholds": {"shared_cores": SHARED_CORES, "steal": STEAL, "calibration_move": CALIBRATION_MOVE},
    }
