"""The Interleaver alone (no process groups): strict alternation at each all-to-all, errors, host-sync guard."""

import pytest
import torch

from moe_engine.host_sync import HostSyncError, forbid_host_sync
from moe_engine.moe import dispatch
from moe_engine.parallel.overlap import Interleaver


def _program(name: str, steps: int, log: list[str]):
    def run():
        for k in range(steps):
            log.append(f"{name}{k}")
            # Where the dispatcher starts an all-to-all and would wait for it.
            dispatch.in_flight_hook()
        log.append(f"{name}-end")
        return name

    return run


def test_programs_alternate_at_each_all_to_all_and_the_survivor_runs_alone():
    log: list[str] = []
    events: list = []
    results = Interleaver(events).run(_program("a", 3, log), _program("b", 1, log))
    assert results == ("a", "b")
    assert log == ["a0", "b0", "a1", "b-end", "a2", "a-end"]
    assert events == [("run", 0), ("run", 1), ("run", 0), ("run", 1), ("done", 1), ("run", 0), ("done", 0)]
    assert dispatch.in_flight_hook is None


def test_an_error_in_either_program_reaches_the_caller_and_releases_the_other():
    log: list[str] = []

    def failing():
        dispatch.in_flight_hook()
        raise ValueError("planted")

    with pytest.raises(ValueError, match="planted"):
        Interleaver().run(failing, _program("b", 3, log))
    assert log[-1] == "b-end" and dispatch.in_flight_hook is None


def test_the_programs_run_under_the_callers_host_sync_guard():
    x = torch.ones(2)

    def syncs():
        dispatch.in_flight_hook()
        return x.sum().item()

    with forbid_host_sync(), pytest.raises(HostSyncError):
        Interleaver().run(lambda: x * 2, syncs)
    assert Interleaver().run(lambda: x * 2, syncs)[1] == 2.0


def test_the_programs_keep_the_callers_grad_mode():
    w = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        out, _ = Interleaver().run(lambda: w * 2, lambda: None)
    assert not out.requires_grad
    out, _ = Interleaver().run(lambda: w * 2, lambda: None)
    assert out.requires_grad
