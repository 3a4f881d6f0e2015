"""Resident A/B comparisons on fake sides: alternation, bracketing, the stopping rule and the confirmation."""

from __future__ import annotations

import math

import pytest
from fake_sides import run_fake

from bench.gate import paired


def test_each_pair_warms_then_brackets_one_side_by_the_other_and_is_closed():
    result, order = run_fake(0.01, 0.01, tolerance=0.05, budget_s=60, stop_early=False)
    assert abs(result.steps_per_block - 60) <= 1  # 0.6 s blocks from the faster probe of a 0.01 s step (1% jitter)
    segments, current = [], []
    for event in order:
        if event == "closed":
            segments.append(current)
            current = []
        else:
            current.append(event)
    assert len(segments) == len(result.pairs) >= 4
    b, c, blocks = "baseline", "candidate", paired.MIN_BLOCKS_PER_PAIR
    # The first pair's probes size the blocks; then one unrecorded block each (the inner side last),
    # then O I O I ... O. The outer place changes every pair, the first to start every two pairs.
    assert segments[0] == ["baseline first", b, c, b, c, *[b, c] * blocks, b]
    assert segments[1] == ["baseline first", c, b, *[c, b] * blocks, c]
    assert segments[2] == ["candidate first", b, c, *[b, c] * blocks, b]
    # From the fourth pair on, the blocks per pair follow the measured variance components.
    later = len(result.pairs[3].log_ratios)
    assert segments[3] == ["candidate first", c, b, *[c, b] * later, c]
    assert [p.outer for p in result.pairs[:4]] == [b, c, b, c]
    assert [len(p.log_ratios) for p in result.pairs[:3]] == [blocks] * 3


def test_bracketing_by_hand():
    from bench.ab.resident import WorkerPairBlocks

    pair = WorkerPairBlocks([1.0, 1.2], [1.21], outer="baseline")
    assert pair.log_ratios == pytest.approx([math.log(1.21) - (math.log(1.0) + math.log(1.2)) / 2])
    flipped = WorkerPairBlocks([1.1], [1.0, 1.44], outer="candidate")
    assert flipped.log_ratios == pytest.approx([math.log(1.2) - math.log(1.1)])  # sqrt(1.0 * 1.44) = 1.2
    with pytest.raises(ValueError, match="2 inner blocks need 3 outer blocks"):
        _ = WorkerPairBlocks([1.0, 1.0], [1.0, 1.0]).log_ratios


@pytest.mark.parametrize("effect", [dict(repeat=0.97), dict(drift=0.002)])
def test_cache_and_drift_effects_do_not_bias_identical_code(effect):
    """A side that runs twice in a row 3% faster, or a machine that slows steadily: identical code
    still compares at x1.000 (a fixed AB, BA order hands the repeat to one side in every pair)."""
    result, _ = run_fake(0.01, 0.01, tolerance=0.05, budget_s=600, noise=1e-9, **effect)
    assert result.estimate.slowdown == pytest.approx(0.0, abs=0.002)
    assert result.verdict == "unchanged"


def test_identical_sides_stop_at_the_minimum_of_worker_pairs_unchanged():
    result, _ = run_fake(0.01, 0.01, tolerance=0.05, budget_s=600)
    assert (result.verdict, result.stopped_by) == ("unchanged", "decided")
    assert paired.MIN_WORKER_PAIRS <= len(result.pairs) <= paired.MIN_WORKER_PAIRS + 1


def test_a_slower_candidate_regresses():
    result, _ = run_fake(0.01, 0.0112, tolerance=0.05, budget_s=600)
    assert result.verdict == "regressed" and result.estimate.slowdown == pytest.approx(0.12, abs=0.01)


def test_the_budget_ends_an_undecided_comparison():
    """Without the stopping rule (calibration), pairs run until the budget is spent."""
    result, _ = run_fake(0.01, 0.01, tolerance=0.0, budget_s=30, stop_early=False)
    assert result.stopped_by == "budget" and result.seconds >= 30


def test_an_inconclusive_verdict_gets_one_extension():
    # A pair bias of 5% cannot be resolved to 1% in 60 s: the budget runs out, the extension too.
    result, _ = run_fake(0.01, 0.01, tolerance=0.01, budget_s=60, extension_s=60, pair_bias=0.05, seed=4)
    assert result.verdict == "inconclusive" and result.stopped_by == "extension"
    assert 120 <= result.seconds < 120 + 30  # one more pair at most past the extension
    once, _ = run_fake(0.01, 0.01, tolerance=0.01, budget_s=60, pair_bias=0.05, seed=4)
    assert once.stopped_by == "budget" and 60 <= once.seconds < 90


SEEDS = range(40)


def test_pair_bias_is_in_the_interval_a_regression_is_caught_and_identical_code_is_not_flagged():
    """A pair bias of 8% between workers (block noise 1%): the pooled interval catches a 10% slowdown
    and does not flag identical code, run after run (40 seeded runs each, the rates a 5% gate needs)."""
    common = dict(tolerance=0.03, budget_s=3000, pair_bias=0.08, noise=0.01, start_s=5.0)
    slower = [run_fake(0.01, 0.011, seed=seed, **common)[0].verdict for seed in SEEDS]
    same = [run_fake(0.01, 0.01, seed=seed, **common)[0].verdict for seed in SEEDS]
    assert slower.count("regressed") >= 38, slower
    assert same.count("regressed") <= 2 and same.count("unchanged") >= 36, same


def test_a_failing_estimate_is_confirmed_on_as_many_fresh_pairs_and_read_over_all():
    result, order = run_fake(0.01, 0.0112, tolerance=0.05, budget_s=600, confirm=True, pair_bias=0.01, noise=0.01)
    first = result.unconfirmed
    assert first is not None and result.stopped_by == "confirmation"
    assert len(result.pairs) == 2 * first.worker_pairs == order.count("closed")
    # The first reading is the estimate over the first pairs; the verdict is the one over all of them.
    assert first == paired.pooled([p.log_ratios for p in result.pairs[: first.worker_pairs]])
    assert result.estimate == paired.pooled([p.log_ratios for p in result.pairs])
    assert result.verdict == "regressed" and paired.fails(result.estimate, 0.05)
    # The fresh pairs go on with the rotation of places and starting order.
    assert [p.outer for p in result.pairs] == ["baseline", "candidate"] * first.worker_pairs


def test_nothing_to_confirm_where_nothing_fails():
    result, _ = run_fake(0.01, 0.01, tolerance=0.05, budget_s=600, confirm=True)
    assert result.unconfirmed is None and result.stopped_by == "decided"


def test_the_confirmation_withdraws_most_false_alarms_of_a_pair_bias_and_keeps_a_regression():
    """A pair bias of 8% against a 3% tolerance in a 40 s budget: read once, identical code fails about
    one run in six; confirmed, a third as often, while a 10% slowdown still fails every time (100
    seeded runs each)."""
    common = dict(tolerance=0.03, budget_s=40, extension_s=40, confirm=True, pair_bias=0.08, noise=0.01)
    same = [run_fake(0.01, 0.01, seed=seed, **common)[0] for seed in range(100)]
    slower = [run_fake(0.01, 0.011, seed=seed, **common)[0] for seed in range(100)]
    failed_once = sum(r.unconfirmed is not None for r in same)
    failed = sum(paired.fails(r.estimate, 0.03) for r in same)
    assert failed_once >= 12 and failed <= failed_once / 2, (failed_once, failed)
    assert sum(paired.fails(r.estimate, 0.03) for r in slower) >= 95
