"""The proxy's sync timeline: an optimizer's sync observer that reads the host clock at each event."""

from __future__ import annotations

import itertools

import pytest

from bench.run import sync_timeline
from bench.run.sync_timeline import SyncTimeline
from moe_engine.parallel.data_parallel import SyncObserver


def test_it_answers_every_event_of_the_observer_protocol():
    events = {name for name in vars(SyncObserver) if not name.startswith("_")}
    assert events and all(callable(getattr(SyncTimeline, name, None)) for name in events)


def test_windows_are_the_time_left_after_each_launch(monkeypatch: pytest.MonkeyPatch):
    ticks = itertools.count()
    monkeypatch.setattr(sync_timeline.time, "perf_counter", lambda: float(next(ticks)))
    timeline = SyncTimeline()
    timeline.reduce_launched(0)  # 0
    timeline.reduce_launched(1)  # 1
    timeline.backward_ended()  # 2
    timeline.reduce_launched(2)  # 3: after backward, nothing left to hide under
    timeline.reductions_waited()  # 4
    timeline.gather_launched(0)  # 5
    timeline.gather_launched(1)  # 6
    timeline.gather_launched(2)  # 7
    timeline.updates_ended()  # 8
    timeline.gathers_waited()  # 9
    assert timeline.reduce_windows_s() == [2.0, 1.0, 0.0]
    assert timeline.gather_windows_s() == [3.0, 2.0, 1.0]
    assert (timeline.reduce_waited_s, timeline.gather_waited_s) == (4.0, 9.0)


def test_before_a_step_there_are_no_windows():
    assert SyncTimeline().reduce_windows_s() == SyncTimeline().gather_windows_s() == []
