"""The paired pipeline plan against torch's own plan: the same actions in the same order, paired only
where two microbatches may run side by side, and a plan torch can lower."""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    _add_send_recv,
    generate_stage_to_rank_mapping,
)

from moe_engine.parallel.paired_plan import (
    PairCounts,
    backwards_one_forward_later,
    pair_counts,
    paired_actions,
    paired_plan,
    torch_plan,
)

LAYOUTS = [
    ("interleaved1f1b", 2, 2, 4),
    ("interleaved1f1b", 4, 3, 8),
    ("interleaved1f1b", 8, 7, 64),
    ("dualpipev", 2, 2, 4),
    ("dualpipev", 4, 2, 8),
    ("dualpipev", 8, 2, 64),
]


def _name(action) -> str:
    if action.sub_actions is not None:
        return "[" + "&".join(_name(a) for a in action.sub_actions) + "]"
    return f"{action.computation_type.value[0]}{action.stage_index}.{action.microbatch_index}"


def _flat(actions):
    for action in actions:
        if action.sub_actions is not None:
            yield from action.sub_actions
        else:
            yield action


def _whole(names):
    """Names with each input and weight backward as the full backward they split from."""
    return sorted({"B" + n[1:] if n[0] in "IW" else n for n in names})


@pytest.mark.parametrize("schedule, pp, v, m", LAYOUTS)
def test_pairing_keeps_torchs_actions_and_order(schedule, pp, v, m):
    for rank in range(pp):
        plan = torch_plan(schedule, pp, v, m, rank)
        assert list(_flat(paired_actions(plan))) == list(_flat([a for a in plan if a is not None]))
        # The shipped plan: the same actions (each backward at most one forward later, a cool-down's
        # backward as its input and weight backwards).
        shipped = [_name(a) for a in _flat(paired_plan(schedule, plan))]
        torchs = [_name(a) for a in _flat([a for a in plan if a is not None])]
        assert len(shipped) == len(set(shipped))
        assert _whole(shipped) == _whole(torchs)
        added = {kind: {n[1:] for n in set(shipped) - set(torchs) if n[0] == kind} for kind in "IWB"}
        removed = {n[1:] for n in set(torchs) - set(shipped)}
        assert added["I"] == added["W"] == removed and not added["B"]


@pytest.mark.parametrize("schedule, pp, v, m", LAYOUTS)
def test_pairs_hold_a_forward_and_a_backward_of_two_microbatches(schedule, pp, v, m):
    for rank in range(pp):
        paired = paired_plan(schedule, torch_plan(schedule, pp, v, m, rank))
        for action in paired:
            if action.sub_actions is None:
                continue
            first, second = action.sub_actions
            kinds = (first.computation_type, second.computation_type)
            if BACKWARD_WEIGHT in kinds:
                # A weight backward beside a later backward (it hands over), never its own input's.
                assert schedule == "interleaved1f1b" and kinds in (
                    (BACKWARD_INPUT, BACKWARD_WEIGHT),
                    (FULL_BACKWARD, BACKWARD_WEIGHT),
                )
                assert (first.stage_index, first.microbatch_index) != (second.stage_index, second.microbatch_index)
                assert kinds[0] == BACKWARD_INPUT or first.stage_index == 0, _name(action)
                continue
            assert first.microbatch_index != second.microbatch_index, _name(action)
            assert {first.computation_type, second.computation_type} == {FORWARD, FULL_BACKWARD}, _name(action)
        if schedule == "interleaved1f1b":
            # Every forward next to a backward of another microbatch is in a pair.
            for x, y in itertools.pairwise(paired):
                if x.sub_actions is None and y.sub_actions is None:
                    kinds = {x.computation_type, y.computation_type}
                    assert not (kinds == {FORWARD, FULL_BACKWARD} and x.microbatch_index != y.microbatch_index), (
                        _name(x),
                        _name(y),
                    )


@pytest.mark.parametrize("schedule, pp, v, m", LAYOUTS)
def test_torch_lowers_the_paired_plan(schedule, pp, v, m):
    stages = pp * v
    style = "v" if schedule == "dualpipev" else "loop"
    to_rank = generate_stage_to_rank_mapping(pp, stages, style=style)
    paired = {rank: paired_plan(schedule, torch_plan(schedule, pp, v, m, rank)) for rank in range(pp)}
    lowered = _add_send_recv({r: list(a) for r, a in paired.items()}, lambda s: to_rank[s], stages)
    for rank, actions in paired.items():
        assert [a for a in lowered[rank] if a.is_compute_op] == actions


def test_interleaved_plan_paired_as_it_stands_by_hand():
    # torch's interleaved 1F1B, pp 2, two stages per rank, 4 microbatches, rank 1 (stages 1 and 3):
    # F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3. Stage 3 holds the
    # loss: F3.0 and B3.0 are one microbatch, so F3.0 runs alone and B3.0 pairs with F3.1.
    paired = paired_actions(torch_plan("interleaved1f1b", 2, 2, 4, 1))
    assert " ".join(map(_name, paired)) == (
        "F1.0 F1.1 F3.0 [B3.0&F3.1] [B3.1&F1.2] [B1.0&F1.3] [B1.1&F3.2] [B3.2&F3.3] B3.3 B1.2 B1.3"
    )
    assert pair_counts(paired) == PairCounts(pairs=5, forward_alone=3, backward_alone=3)


def test_backwards_move_one_forward_later_by_hand():
    # Rank 0 of the same layout: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2
    # B0.3. Each backward passes the forward after it (the cool-down's have none to pass), then pairs
    # with it.
    plan = backwards_one_forward_later(torch_plan("interleaved1f1b", 2, 2, 4, 0))
    assert " ".join(map(_name, plan)) == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 F0.3 B2.0 F2.2 B2.1 F2.3 B0.0 B0.1 B2.2 B2.3 B0.2 B0.3"
    )
    paired = paired_actions(plan)
    assert " ".join(map(_name, paired)) == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 [F0.3&B2.0] [F2.2&B2.1] [F2.3&B0.0] B0.1 B2.2 B2.3 B0.2 B0.3"
    )
    # The cool-down's backwards after B0.1 (stage 0: whole, nothing waiting) split: I2.2 alone, W2.2
    # beside I2.3, W2.3 beside B0.2 (stage 0's full backward), B0.3 whole and nothing left waiting.
    shipped = paired_plan("interleaved1f1b", torch_plan("interleaved1f1b", 2, 2, 4, 0))
    assert " ".join(map(_name, shipped)) == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 [F0.3&B2.0] [F2.2&B2.1] [F2.3&B0.0] B0.1 I2.2 [I2.3&W2.2] [B0.2&W2.3] B0.3"
    )
    assert pair_counts(shipped) == PairCounts(
        pairs=3, forward_alone=5, backward_alone=3, input_beside_weight=1, backward_beside_weight=1
    )


def test_a_cool_down_ending_in_a_later_stage_leaves_its_last_weight_backward_alone():
    # Rank 1 of the same layout (stages 1 and 3): its cool-down B3.3 B1.2 B1.3 splits whole; W1.3 has
    # no backward after it.
    shipped = paired_plan("interleaved1f1b", torch_plan("interleaved1f1b", 2, 2, 4, 1))
    assert " ".join(map(_name, shipped)).endswith("I3.3 [I1.2&W3.3] [I1.3&W1.2] W1.3")


def test_dualpipev_runs_as_torch_plans_it():
    # pp 2, 4 microbatches, rank 0: torch's own OVERLAP_F_B actions, I and W steps, nothing added.
    plan = torch_plan("dualpipev", 2, 2, 4, 0)
    paired = paired_plan("dualpipev", plan)
    assert paired == [a for a in plan if a is not None]
    assert " ".join(map(_name, paired)) == (
        "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 [F0.3&B3.1] [F3.2&B0.0] B3.2 [F3.3&B0.1] B3.3 I0.2 W0.2 I0.3 W0.3"
    )
    assert pair_counts(paired) == PairCounts(pairs=3, forward_alone=5, backward_alone=5)


def test_unpaired_schedule_is_refused():
    with pytest.raises(ValueError, match="not paired"):
        torch_plan("zbv", 2, 2, 4, 0)
    with pytest.raises(ValueError, match="not paired"):
        paired_plan("1f1b", [])
