"""Overlapped pairs in a pipeline plan: the plan of a rank's forwards and backwards that runs one
microbatch's forward beside another's full backward as one ``OVERLAP_F_B`` action, each hiding the
other's expert all-to-alls (``moe_engine.parallel.overlap``).

torch's ``ScheduleDualPipeV`` plans its pairs itself, and runs as torch plans it. torch's
``ScheduleInterleaved1F1B`` pairs nothing; its steady state alternates a forward and a backward. A pair
starts when both its inputs have arrived and hands on both outputs when it ends, so pairing that
forward with the backward after it, as the plan stands, would make neighbouring ranks take turns:
rank r's backward waits for rank r+1's pair, which waits for the forward rank r is pairing it with.
Each backward first moves past the forward after it (one more forward in the warm-up, one more stage
chunk of activations held), so its gradient is on its way a pair earlier; then each backward pairs with
the forward it moved past. Nothing else pairs: two forwards side by side (the warm-up's) would hold back the
first one's output and lengthen the pipeline's fill by more than they hide, and two backwards cannot
run side by side on a GPU (autograd runs a device's backwards on one thread, which the first one's
hand-over would block). ``bench.predict.pipeline_replay`` replays the plans. Only the order of torch's
plan is read and rewritten; torch lowers it (sends, receives) and runs it.
More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Whether two neighbouring actions may run side by side: a forward and a full backward of two
    microbatches (one microbatch's actions depend on each other)."""
    return (
        first.sub_actions is None
        and second.sub_actions is None
        and {first.computation_type, second.computation_type} == {FORWARD, FULL_BACKWARD}
        and first.microbatch_index != second.microbatch_index
    )


def paired_actions(actions: Sequence[_Action | None]) -> list[_Action]:
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


def backwards_one_forward_later(actions: Sequence[_Action | None]) -> list[_Action]:
    """The plan with each full backward moved past the forward after it (of another microbatch), left to
    right: the steady state's F B F B becomes F F B F B, one more forward in the warm-up."""
    plan = [a for a in actions if a is not None]
    i = 0
    while i + 1 < len(plan):
        backward, forward = plan[i], plan[i + 1]
        if (
            backward.computation_type == FULL_BACKWARD
            and forward.computation_type == FORWARD
            and backward.microbatch_index != forward.microbatch_index
        ):
            plan[i], plan[i + 1] = forward, backward
            i += 2
        else:
            i += 1
    return plan


def paired_plan(schedule: str, actions: Sequence[_Action | None]) -> list[_Action]:
    """What the engine runs for torch's plan ``actions`` of one rank under ``schedule``: interleaved
    1F1B's backwards one forward later, each then paired with the forward it moved past; DualPipeV's plan
    as torch plans it (its own pairs)."""
    if schedule not in PAIRED_SCHEDULES:
        raise ValueError(f"paired plan: schedule {schedule} is not paired (one of {', '.join(PAIRED_SCHEDULES)})")
    if schedule == "interleaved1f1b":
        return paired_actions(backwards_one_forward_later(actions))
    return [a for a in actions if a is not None]


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

    pairs: int
    """Pairs of a forward beside a full backward."""
    forward_alone: int
    """Forwards run alone."""
    backward_alone: int
    """Full or input backwards run alone (weight backwards, which send nothing, not counted)."""


def pair_counts(actions: list[_Action]) -> PairCounts:
    """Count a paired plan's actions by kind."""
    pairs = sum(1 for a in actions if a.sub_actions is not None)
    forwards = sum(1 for a in actions if a.computation_type == FORWARD)
    backwards = sum(1 for a in actions if a.computation_type in (FULL_BACKWARD, BACKWARD_INPUT))
    return PairCounts(pairs=pairs, forward_alone=forwards, backward_alone=backwards)
