"""The pipeline replay against hand-worked timelines, and the paired plans it judges: pairing must not
make neighbouring ranks take turns."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    _Action,
)

from bench.predict.pipeline_replay import ChunkSeconds, replay, replay_idle_s
from bench.predict.plan.rank import in_flight_microbatches
from moe_engine.parallel.paired_plan import paired_actions, paired_plan, torch_plan

# Compute only: a forward 1 s, a backward 2 s (input 1 s, weight 1 s), a pair the sum of its two
# (nothing hidden).
PLAIN = ChunkSeconds(
    forward=1.0,
    backward=2.0,
    input_backward=1.0,
    weight_backward=1.0,
    forward_backward=3.0,
    input_beside_weight=2.0,
    backward_beside_weight=3.0,
)


def F(stage: int, mb: int) -> _Action:
    return _Action(stage, FORWARD, mb)


def B(stage: int, mb: int) -> _Action:
    return _Action(stage, FULL_BACKWARD, mb)


def pair(a: _Action, b: _Action) -> _Action:
    return _Action(-1, OVERLAP_F_B, None, (a, b))


def test_two_ranks_of_1f1b_by_hand():
    # Rank 1: F1.0 at 1-2 (after F0.0), B1.0 2-4, F1.1 4-5 (F0.1 arrived at 2), B1.1 5-7. Rank 0: F0.0
    # 0-1, F0.1 1-2, B0.0 waits for B1.0 (4): 4-6, B0.1 for B1.1 (7): 7-9. The step ends at 9; each
    # rank is busy 6 s, so rank 0 idles 3 s and rank 1 ends at 7.
    plans = {0: [F(0, 0), F(0, 1), B(0, 0), B(0, 1)], 1: [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]}
    assert replay(plans, 2, PLAIN) == {0: (9.0, 6.0), 1: (7.0, 6.0)}


def test_a_pair_waits_for_both_inputs_and_hands_on_both_at_its_end_by_hand():
    # Rank 1 pairs B1.0 with F1.1 (3 s): it starts at 2, when F1.0 and F0.1 are done, and B1.0's
    # gradient leaves at 5, not 4: rank 0's B0.0 runs 5-7, B0.1 (after B1.1, 5-7) 7-9.
    plans = {0: [F(0, 0), F(0, 1), B(0, 0), B(0, 1)], 1: [F(1, 0), pair(B(1, 0), F(1, 1)), B(1, 1)]}
    assert replay(plans, 2, PLAIN) == {0: (9.0, 6.0), 1: (7.0, 6.0)}
    # A pair faster than its parts (what it hides): 2 s instead of 3. Rank 1: F1.0 1-2, the pair 2-4,
    # B1.1 4-6; rank 0: B0.0 4-6, B0.1 6-8.
    quicker = ChunkSeconds(**{**PLAIN.__dict__, "forward_backward": 2.0})
    assert replay(plans, 2, quicker) == {0: (8.0, 6.0), 1: (6.0, 5.0)}


def test_a_weight_backward_beside_a_later_input_backward_by_hand():
    # Rank 1 holds the last stage: F1.0 1-2, I1.0 2-3 (its gradient leaves at 3, not at 4 as a full
    # backward's would), F1.1 3-4, then I1.1 beside W1.0 (2 s, PLAIN) 4-6 and W1.1 alone 6-7. Rank 0:
    # F0.0 0-1, F0.1 1-2, B0.0 after I1.0 3-5, B0.1 after the pair 6-8.
    W = lambda stage, mb: _Action(stage, BACKWARD_WEIGHT, mb)
    I = lambda stage, mb: _Action(stage, BACKWARD_INPUT, mb)  # noqa: E741
    plans = {
        0: [F(0, 0), F(0, 1), B(0, 0), B(0, 1)],
        1: [F(1, 0), I(1, 0), F(1, 1), pair(I(1, 1), W(1, 0)), W(1, 1)],
    }
    assert replay(plans, 2, PLAIN) == {0: (8.0, 6.0), 1: (7.0, 6.0)}


def test_a_plan_that_waits_for_itself_is_refused():
    plans = {0: [B(0, 0), F(0, 0)], 1: [F(1, 0), B(1, 0)]}
    with pytest.raises(ValueError, match="malformed"):
        replay(plans, 2, PLAIN)


def _end(plans: dict, stages: int) -> float:
    return max(end for end, _ in replay(plans, stages, PLAIN).values())


@pytest.mark.parametrize(
    "kind, pp, v, m",
    [
        ("interleaved1f1b", 2, 2, 4),
        ("interleaved1f1b", 4, 2, 8),
        ("interleaved1f1b", 8, 7, 16),
        ("dualpipev", 8, 2, 16),
    ],
)
def test_pairing_costs_the_fill_not_the_steady_state(kind, pp, v, m):
    # With nothing to hide (a pair takes its two actions' time) pairing can only cost: a pair's first
    # output leaves when the pair ends. That cost must stay in the pipeline's fill and drain, the same
    # for m and 2m microbatches. Pairing interleaved 1F1B's forward with the backward after it, as the
    # plan stands, makes neighbouring ranks take turns: a cost that grows with every microbatch.
    def cost(microbatches: int, pair) -> float:
        torch_plans = {r: [a for a in torch_plan(kind, pp, v, microbatches, r) if a is not None] for r in range(pp)}
        paired = {r: pair(torch_plan(kind, pp, v, microbatches, r)) for r in range(pp)}
        return _end(paired, pp * v) - _end(torch_plans, pp * v)

    shipped = cost(m, lambda plan: paired_plan(kind, plan)), cost(2 * m, lambda plan: paired_plan(kind, plan))
    assert shipped[0] == shipped[1], shipped
    if kind == "dualpipev":
        assert shipped[0] >= 0
    if kind == "interleaved1f1b":
        as_it_stands = cost(m, paired_actions), cost(2 * m, paired_actions)
        assert as_it_stands[1] > 2 * as_it_stands[0] > 0, as_it_stands


def test_idle_seconds_of_a_rank():
    # interleaved1f1b, pp 2, 2 stages per rank, 4 microbatches: each rank is busy 4 * 2 * 3 = 24 s.
    idle = [replay_idle_s("interleaved1f1b", 2, 2, 4, r, PLAIN) for r in range(2)]
    plans = {r: paired_plan("interleaved1f1b", torch_plan("interleaved1f1b", 2, 2, 4, r)) for r in range(2)}
    ends = replay(plans, 4, PLAIN)
    assert all(busy == 24.0 for _, busy in ends.values())
    assert idle == [max(e for e, _ in ends.values()) - 24.0] * 2
    assert idle[0] > 0


@pytest.mark.parametrize(
    "kind, pp, v, m", [("interleaved1f1b", 8, 7, 64), ("interleaved1f1b", 4, 3, 8), ("dualpipev", 8, 2, 64)]
)
def test_the_memory_plans_peak_is_the_paired_plans(kind, pp, v, m):
    # Stage chunks whose activations a rank holds: its forwards run less its backwards, at the most.
    for rank in range(pp):
        held = peak = 0
        for action in paired_plan(kind, torch_plan(kind, pp, v, m, rank)):
            for part in action.sub_actions or (action,):
                held += {FORWARD: 1, FULL_BACKWARD: -1}.get(part.computation_type, 0)
                held -= part.computation_type.value == "I"  # DualPipeV's input backward frees them too
                peak = max(peak, held)
        v_ = 2 if kind == "dualpipev" else v
        assert in_flight_microbatches(kind, pp, v_, m, rank, paired=True) * v_ == pytest.approx(peak), rank
