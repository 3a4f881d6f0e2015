"""Schedules in one process: the overlap checker (``overlap_violations``) on hand-written sequences,
the layout's automatic overlap, the layouts and microbatch counts the schedules refuse, and where the
V schedules put the stages. Zero-bubble and overlapped schedules training exactly as 1F1B / the plain
data-parallel step on gloo ranks: tests/integration/distributed/test_schedules_ranks.py."""

from __future__ import annotations

import dataclasses

import pytest
from overlap_checks import overlap_violations

from moe_engine.config import ExpertOverlap, ParallelConfig, PipelineSchedule

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
    interleaved = dict(pp=2, dp=2, ep=2, microbatches=4, schedule="interleaved1f1b", virtual_stages=2)
    assert resolved(**interleaved) is ExpertOverlap.MICROBATCHES
    assert resolved(**dict(interleaved, ep=1)) is ExpertOverlap.NONE


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(pp=2, schedule="zbv", microbatches=4), "exactly two stages per rank"),
        (dict(pp=2, schedule="dualpipev", virtual_stages=3, microbatches=6), "exactly two stages per rank"),
        (dict(pp=2, schedule="1f1b", virtual_stages=2, microbatches=4), "more than one stage per rank"),
        (dict(dp=2, ep=2, microbatches=1, overlap="microbatches"), "two or more microbatches"),
        (dict(pp=2, schedule="1f1b", microbatches=4, overlap="microbatches"), "interleaved1f1b or dualpipev"),
        (dict(pp=2, schedule="zbv", virtual_stages=2, microbatches=4, overlap="microbatches"), "or dualpipev"),
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
