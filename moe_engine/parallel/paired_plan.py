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
hand-over would block). The cool-down's backwards, alone, split instead: each but the first stage's into
its input and weight backwards, and each weight backward runs beside the next backward, inside its
expert all-to-alls (a weight backward has none of its own, so it runs within the other's hand-overs on
the same thread). ``bench.predict.pipeline_replay`` replays the plans. Only the order of torch's plan is
read and rewritten; torch lowers it (sends, receives) and runs it.
More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
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


def weights_beside_backwards(actions: Sequence[_Action]) -> list[_Action]:
    """The paired plan with its cool-down (the full backwards alone at its end) split: each backward of a
    stage after the first into its input backward and its weight backward, the weight backward run beside
    the next backward of the cool-down (input, or the first stage's full backward, first in the pair:
    it is what hands over); the last weight backward alone. The first stage's backwards stay whole: its
    input backward computes nothing (no input gradient to send), so its weight backward would hold every
    all-to-all."""
    plan = list(actions)
    start = len(plan)
    while start > 0 and plan[start - 1].sub_actions is None and plan[start - 1].computation_type == FULL_BACKWARD:
        start -= 1
    split, waiting = plan[:start], None
    for backward in plan[start:]:
        stage, mb = backward.stage_index, backward.microbatch_index
        first = backward if stage == 0 else _Action(stage, BACKWARD_INPUT, mb)
        split.append(first if waiting is None else _Action(-1, OVERLAP_F_B, None, (first, waiting)))
        waiting = None if stage == 0 else _Action(stage, BACKWARD_WEIGHT, mb)
    if waiting is not None:
        split.append(waiting)
    return split


def paired_plan(schedule: str, actions: Sequence[_Action | None]) -> list[_Action]:
    """What the engine runs for torch's plan ``actions`` of one rank under ``schedule``: interleaved
    1F1B's backwards one forward later, each then paired with the forward it moved past, and its
    cool-down's weight backwards beside the backwards after them; DualPipeV's plan as torch plans it (its
    own pairs)."""
    if schedule not in PAIRED_SCHEDULES:
        raise ValueError(f"paired plan: schedule {schedule} is not paired (one of {', '.join(PAIRED_SCHEDULES)})")
    if schedule == "interleaved1f1b":
        return weights_beside_backwards(paired_actions(backwards_one_forward_later(actions)))
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
    input_beside_weight: int = 0
    """Input backwards with an earlier chunk's weight backward beside them."""
    backward_beside_weight: int = 0
    """Full backwards with an earlier chunk's weight backward beside them."""


def pair_kinds(action: _Action) -> frozenset:
    """The computation types of a pair's two actions (empty for an action alone)."""
    return frozenset(a.computation_type for a in action.sub_actions or ())


def pair_counts(actions: list[_Action]) -> PairCounts:
    """Count a paired plan's actions by kind."""
    kinds = [pair_kinds(a) for a in actions]
    return PairCounts(
        pairs=sum(FORWARD in k for k in kinds),
        forward_alone=sum(1 for a in actions if a.computation_type == FORWARD),
        backward_alone=sum(1 for a in actions if a.computation_type in (FULL_BACKWARD, BACKWARD_INPUT)),
        input_beside_weight=sum(k == {BACKWARD_INPUT, BACKWARD_WEIGHT} for k in kinds),
        backward_beside_weight=sum(k == {FULL_BACKWARD, BACKWARD_WEIGHT} for k in kinds),
    )
