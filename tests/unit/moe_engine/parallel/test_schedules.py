"""Zero-bubble and overlapped schedules train exactly as 1F1B / the plain data-parallel step.

Each case trains STEPS optimizer steps on gloo ranks and compares, in fp32, the losses and the
parameters after the steps (the updates, with lr = 1 and eps = 1 nearly proportional to the
gradients, and clipped to a global norm so that a gradient counted twice changes every update)
with the reference layout's: 1F1B with the same pp, dp and ep, or the plain step of the same
layout. Every rank records its collectives (which group, which op, in order): the members of each
group must issue the same sequence. Overlapped runs also record each expert all-to-all's start and
wait beside the hand-overs between the two microbatches, and every all-to-all must have the other
microbatch's compute between its start and its wait (``overlap_violations``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from moe_engine.config import ExpertOverlap, ParallelConfig, PipelineSchedule
from moe_engine.parallel import overlap

SEQUENCES, STEPS = 8, 2


def overlap_violations(events: list[tuple]) -> list[str]:
    """Expert all-to-alls waited for with nothing of the other microbatch run since their start, where
    the rule does not allow it.

    ``events``: ("run", p) when program p takes over, ("done", p), ("start", p[, id]) and ("wait", p[, id])
    for an all-to-all program p started / waits for; outside an overlapped region p is -1 (not checked).
    An all-to-all started while the other program still had work must see that program run (a
    ("run", other) event) before its wait, unless it is waited at once inside a chain, as routing
    counts or as a side buffer: then the program must still have an all-to-all in flight when it
    hands over (``moe_engine.moe.dispatch.HandOver``). One started after the other finished has
    nothing to hide behind."""
    problems, pending = [], {0: [], 1: []}
    done = {0: False, 1: False}
    runs = {0: 0, 1: 0}
    # Per program: exchanges waited at once in the current slice.
    unfollowed: dict[int, list[int]] = {0: [], 1: []}
    for index, (kind, p, *exchange) in enumerate(events):
        if kind == "run":
            other = 1 - p
            if unfollowed[other] and not pending[other] and not done[p]:
                problems.append(f"program {other} waited at once at events {unfollowed[other]} and handed over")
            unfollowed[other] = []
            runs[p] += 1
            continue
        if kind == "done":
            done[p] = True
            continue
        if p < 0:
            continue
        other = 1 - p
        if kind == "start":
            pending[p].append((index, runs[other], done[other], exchange))
        elif kind == "wait":
            # Paired by the exchange's id where recorded (one waited at once may have started after one
            # still in flight), else first in, first out.
            at = next(i for i, entry in enumerate(pending[p]) if entry[3] == exchange) if exchange else 0
            _, runs_then, other_done, _ = pending[p].pop(at)
            if not other_done and runs[other] == runs_then:
                unfollowed[p].append(index)
    if any(pending.values()):
        problems.append(f"all-to-alls never waited for: {pending}")
    return problems


class _Recorder:
    """Records this rank's collectives per group and the expert all-to-alls' starts and waits."""

    def __init__(self):
        self.collectives: dict[tuple[int, ...], list[str]] = {}
        self.events: list[tuple] = []

    def install(self) -> None:
        for name in ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
        events = self.events
        overlap.Interleaver._record = lambda self, kind, p: events.append((kind, p))  # type: ignore[method-assign]

    def _wrap(self, name, fn):
        recorder = self

        def wrapped(*args, group=None, async_op=False, **kwargs):
            ranks = (
                tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
            )
            recorder.collectives.setdefault(ranks, []).append(name)
            program = recorder._program()
            exchange = len(recorder.events)
            if name == "all_to_all_single":
                recorder.events.append(("start", program, exchange))
            work = fn(*args, group=group, async_op=async_op, **kwargs)
            if name != "all_to_all_single":
                return work
            if not async_op:
                recorder.events.append(("wait", program, exchange))
                return work
            return _RecordedWork(work, recorder, program, exchange)

        return wrapped

    @staticmethod
    def _program() -> int:
        from moe_engine.moe import dispatch

        hook = dispatch.in_flight_hook
        return hook.__self__.active if hook is not None else -1  # type: ignore[union-attr]


class _RecordedWork:
    def __init__(self, work, recorder: _Recorder, program: int, exchange: int):
        self.work, self.recorder, self.program, self.exchange = work, recorder, program, exchange

    def wait(self, *args, **kwargs):
        self.recorder.events.append(("wait", self.program, self.exchange))
        return self.work.wait(*args, **kwargs)


# ---- the overlap checker on hand-written sequences ---------------------------------------------------


def test_overlap_checker_accepts_a_hidden_exchange_and_refuses_an_early_wait():
    hidden = [("run", 0), ("start", 0), ("run", 1), ("start", 1), ("run", 0), ("wait", 0), ("done", 0), ("wait", 1)]
    assert overlap_violations(hidden) == []
    # The wait moved before the hand-over: nothing of program 1 ran while program 0's exchange moved.
    early = [("run", 0), ("start", 0), ("wait", 0), ("run", 1), ("start", 1), ("run", 0), ("done", 0), ("wait", 1)]
    assert len(overlap_violations(early)) == 1
    # A chain: the first exchange waited at once, the second started before the hand-over and hidden.
    chain = [("run", 0), ("start", 0), ("wait", 0), ("start", 0), ("run", 1), ("start", 1), ("run", 0), ("wait", 0)]
    assert overlap_violations(chain + [("done", 0), ("wait", 1)]) == []
    # The same chain handing over with nothing in flight: both waits at once.
    unhidden = [("run", 0), ("start", 0), ("wait", 0), ("start", 0), ("wait", 0), ("run", 1), ("start", 1)]
    assert len(overlap_violations(unhidden + [("run", 0), ("done", 0), ("wait", 1)])) == 1
    # After the other program finished there is nothing to hide behind: waiting at once is right.
    alone = [("run", 0), ("done", 0), ("run", 1), ("start", 1), ("wait", 1), ("done", 1)]
    assert overlap_violations(alone) == []


# ---- pipelines: zero bubble and DualPipeV against 1F1B -------------------------------------------------


# ---- the overlapped data-parallel step (pp = 1) ----------------------------------------------------------


# ---- configuration -----------------------------------------------------------------------------------------


def test_auto_overlap_follows_the_layout():
    def resolved(**kwargs) -> ExpertOverlap:
        return ParallelConfig(**kwargs).resolved_overlap

    assert resolved(dp=2, ep=1, microbatches=2) is ExpertOverlap.NONE
    assert resolved(dp=2, ep=2, microbatches=1) is ExpertOverlap.NONE
    assert resolved(dp=2, ep=2, microbatches=1, a2a_chunks=2) is ExpertOverlap.CHUNKS
    assert resolved(dp=2, ep=2, microbatches=2) is ExpertOverlap.MICROBATCHES
    assert resolved(pp=2, dp=2, ep=2, microbatches=4) is ExpertOverlap.NONE
    assert resolved(pp=2, dp=2, ep=2, microbatches=4, schedule="zbv", virtual_stages=2) is ExpertOverlap.NONE
    dualpipev = dict(pp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev", virtual_stages=2)
    assert resolved(**dualpipev) is ExpertOverlap.MICROBATCHES
    assert resolved(**dualpipev, overlap="none") is ExpertOverlap.NONE


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(pp=2, schedule="zbv", microbatches=4), "exactly two stages per rank"),
        (dict(pp=2, schedule="dualpipev", virtual_stages=3, microbatches=6), "exactly two stages per rank"),
        (dict(pp=2, schedule="1f1b", virtual_stages=2, microbatches=4), "more than one stage per rank"),
        (dict(dp=2, ep=2, microbatches=1, overlap="microbatches"), "two or more microbatches"),
        (dict(pp=2, schedule="1f1b", microbatches=4, overlap="microbatches"), "schedule dualpipev"),
        (dict(dp=2, microbatches=2, overlap="microbatches", dp_mode="fsdp"), "dp_mode ddp"),
    ],
)
def test_layouts_the_schedules_refuse(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(pp=2, schedule="dualpipev", virtual_stages=2, microbatches=3), "at least 4 microbatches"),
        (dict(pp=3, schedule="zbv", virtual_stages=2, microbatches=4), "at least 5 microbatches"),
        (dict(pp=4, schedule="interleaved-zb", virtual_stages=2, microbatches=9), "do not split"),
    ],
)
def test_microbatch_counts_the_schedules_refuse(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields).validate_executable()


def test_v_schedules_put_the_first_and_last_stage_on_rank_zero():
    from moe_engine.parallel.pipeline import rank_stages

    parallel = ParallelConfig(pp=3, schedule=PipelineSchedule.ZBV, virtual_stages=2, microbatches=6)
    assert [rank_stages(parallel, r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    looped = dataclasses.replace(parallel, schedule=PipelineSchedule.INTERLEAVED_ZB)
    assert [rank_stages(looped, r) for r in range(3)] == [[0, 3], [1, 4], [2, 5]]
