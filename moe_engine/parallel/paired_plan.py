"""Overlapped pairs in a pipeline plan: torch's plan of a rank's forwards and backwards, with each two
adjacent actions of different microbatches merged into one ``OVERLAP_F_B`` action, run side by side
(``moe_engine.parallel.overlap``).

torch's ``ScheduleDualPipeV`` pairs a forward with a backward in its steady state and runs the rest
alone; ``ScheduleInterleaved1F1B`` pairs nothing. Pairing the plan's neighbours hides one microbatch's
expert all-to-alls behind the other's compute in both: a steady state's forward and backward, and the
warm-up's forwards two by two. Two backwards are never paired: on a GPU autograd runs every backward of
a device on one thread, which the first backward's hand-over would block. Only the order of the plan
is read and rewritten; torch lowers it (sends, receives) and runs it. More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    _Action,
)

from moe_engine.config import PipelineSchedule

PAIRED_SCHEDULES = tuple(s.value for s in PipelineSchedule if s.pairs_microbatches)
"""The schedules whose plans are paired (``PipelineSchedule`` values)."""


def _pairable(first: _Action, second: _Action) -> bool:
    """Whether two neighbouring actions may run side by side: a forward beside a forward or a full
    backward, of two microbatches (one microbatch's actions depend on each other)."""
    kinds = (first.computation_type, second.computation_type)
    return (
        first.sub_actions is None
        and second.sub_actions is None
        and all(k in (FORWARD, FULL_BACKWARD) for k in kinds)
        and FORWARD in kinds
        and first.microbatch_index != second.microbatch_index
    )


def paired_actions(actions: list[_Action | None]) -> list[_Action]:
    """A rank's compute-only plan with its neighbours paired, left to right: an action joins the next
    when both may run side by side (``_pairable``), else runs alone. Idle slots (None) are dropped: the
    runtime waits for its inputs, not for slots."""
    plan = [a for a in actions if a is not None]
    paired: list[_Action] = []
    i = 0
    while i < len(plan):
        if i + 1 < len(plan) and _pairable(plan[i], plan[i + 1]):
            paired.append(_Action(-1, OVERLAP_F_B, None, (plan[i], plan[i + 1])))
            i += 2
        else:
            paired.append(plan[i])
            i += 1
    return paired


def torch_plan(schedule: str, pp: int, virtual_stages: int, microbatches: int, rank: int) -> list[_Action | None]:
    """torch's compute-only plan of one rank (what the schedule's constructor computes for each rank),
    without building stages."""
    if schedule == "dualpipev":
        state = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches)
        return ScheduleDualPipeV._calculate_single_rank_operations(state, rank)  # type: ignore[arg-type]
    if schedule == "interleaved1f1b":
        rounds = max(1, microbatches // pp)
        state = SimpleNamespace(
            pp_group_size=pp,
            _n_microbatches=microbatches,
            n_local_stages=virtual_stages,
            rank=rank,
            number_of_rounds=rounds,
            microbatches_per_round=microbatches // rounds,
        )
        return ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)  # type: ignore[arg-type]
    raise ValueError(f"paired plan: schedule {schedule} is not paired (one of {', '.join(PAIRED_SCHEDULES)})")


@dataclass(frozen=True)
class PairCounts:
    """What a rank's paired plan runs, in stage chunks (one stage's share of a microbatch)."""

    forward_backward: int
    """Pairs of a forward beside a backward."""
    forward_forward: int
    """Pairs of two forwards."""
    forward_alone: int
    """Forwards run alone."""
    backward_alone: int
    """Full or input backwards run alone (weight backwards, which send nothing, not counted)."""


def pair_counts(actions: list[_Action]) -> PairCounts:
    """Count a paired plan's actions by kind."""
    fb = ff = f = b = 0
    for action in actions:
        if action.sub_actions is not None:
            forwards = sum(1 for s in action.sub_actions if s.computation_type == FORWARD)
            ff += forwards == 2
            fb += forwards == 1
        elif action.computation_type == FORWARD:
            f += 1
        elif action.computation_type in (FULL_BACKWARD, BACKWARD_INPUT):
            b += 1
    return PairCounts(forward_backward=fb, forward_forward=ff, forward_alone=f, backward_alone=b)
