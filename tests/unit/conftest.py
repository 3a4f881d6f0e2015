"""What holds for every unit test: it runs in this one process (tests/README.md), and a tiny run under it
calibrates the machine once per session rather than twice per scenario."""

from __future__ import annotations

import os
import sys
from functools import cache

import pytest

from bench.machine import calibrate
from bench.run import conditions

# Facts a run records about its machine and checkout; each answers in milliseconds.
ALLOWED_COMMANDS = frozenset({"git", "lscpu", "uname", "nvidia-smi"})

_watching = False
_started: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if not _watching:
        return
    if event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        command = os.path.basename(str(args[0] or argv[0]))
        if command not in ALLOWED_COMMANDS:
            _started.append(" ".join(map(str, argv))[:120])
    elif event in ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec"):
        _started.append(event)


sys.addaudithook(_audit)


def _in_this_process(item):
    """Runs one phase of a test and fails it if the phase started a process (an interpreter, a compiler, a fork).

    Not on a GPU: there Triton compiles each kernel with ptxas as it first runs."""
    global _watching
    _started.clear()
    _watching = item.get_closest_marker("cuda") is None
    try:
        result = yield
    finally:
        _watching = False
    if _started:
        raise AssertionError(
            f"a unit test started {_started}: tests that start processes go under tests/integration (tests/README.md)"
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _in_this_process(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _in_this_process(item))


@cache
def _session_calibration() -> dict:
    return calibrate()


@pytest.fixture(autouse=True)
def calibrated_once(monkeypatch):
    """A run's start and end calibrations are this machine's, measured once: two 0.1 s matmul timings per tiny
    scenario were 12 s of the unit tests, and what a calibration measures is tested in tests/unit/bench/test_machine.py."""
    monkeypatch.setattr(conditions, "calibrate", _session_calibration)
