"""The A/B gate's whole-suite time limit (``bench.ab.deadline``): its arithmetic by hand, and what it cuts
of a comparison on fake sides (an extension, a confirmation's pairs) and what it leaves alone."""

from __future__ import annotations

import pytest
from fake_sides import run_fake

from bench.ab.deadline import SuiteDeadline
from bench.gate import paired


def test_the_limit_left_keeps_a_reserve_for_each_scenario_after_by_hand():
    now = [0.0]
    deadline = SuiteDeadline(600, ["a", "b", "c"], clock=lambda: now[0])
    deadline.scenario_starts("a")
    now[0] = 100.0
    deadline.budget_spent()  # a took 100 s to the end of its budget: the reserve for b and c
    assert deadline.left_s() == pytest.approx(600 - 2 * 100 - 100)
    now[0] = 250.0
    deadline.scenario_starts("b")
    now[0] = 330.0
    deadline.budget_spent()  # 80 s: the reserve stays the most any took
    assert deadline.reserve_s == 100.0
    assert deadline.left_s() == pytest.approx(600 - 1 * 100 - 330)
    now[0] = 400.0
    deadline.scenario_starts("c")
    now[0] = 450.0
    assert deadline.left_s() == pytest.approx(600 - 450)  # the last one may use all that is left
    deadline.scenario_starts("plan-only")  # not an execute scenario: every execute one is still to come
    assert deadline.scenarios_after == 3


def test_a_limit_must_be_positive_over_distinct_scenarios():
    with pytest.raises(ValueError, match="deadline"):
        SuiteDeadline(0, ["a"])
    with pytest.raises(ValueError, match="distinct"):
        SuiteDeadline(600, ["a", "a"])


def test_a_scenario_that_decides_early_reserves_its_whole_budget():
    # Decided 25 s before its budget's end: a later scenario may need those 25 s, so they are reserved.
    now = [0.0]
    deadline = SuiteDeadline(600, ["a", "b"], clock=lambda: now[0])
    deadline.scenario_starts("a")
    now[0] = 50.0
    deadline.budget_spent(unused_s=25.0)
    assert deadline.reserve_s == 75.0
    clock = [0.0]
    limited = _deadline(10_000, clock, later=1)
    result, _ = run_fake(0.01, 0.01, tolerance=0.05, budget_s=600, deadline=limited, clock=clock)
    assert result.stopped_by == "decided" and result.seconds < 600
    assert limited.reserve_s == pytest.approx(600)


def _deadline(limit_s: float, clock: list[float], later: int = 0) -> SuiteDeadline:
    names = [f"s{i}" for i in range(later + 1)]
    deadline = SuiteDeadline(limit_s, names, clock=lambda: clock[0])
    deadline.scenario_starts(names[0])
    return deadline


# An inconclusive comparison (a 5% pair bias against a 1% tolerance) that its extension runs to 128 s.
INCONCLUSIVE = dict(tolerance=0.01, budget_s=60, extension_s=60, pair_bias=0.05, seed=4)


def test_no_room_to_extend_ends_the_comparison_at_its_budget():
    clock = [0.0]
    # One scenario after this one: it is reserved what this one took to its budget (about 75 s).
    result, _ = run_fake(0.01, 0.01, deadline=_deadline(200, clock, later=1), clock=clock, **INCONCLUSIVE)
    assert (result.verdict, result.stopped_by) == ("inconclusive", "deadline")
    once, _ = run_fake(0.01, 0.01, **{**INCONCLUSIVE, "extension_s": 0.0})
    assert len(result.pairs) == len(once.pairs) and result.estimate == once.estimate


def test_a_refused_extension_is_kept_when_a_confirmation_follows():
    # 2% slower against a 1% tolerance: inconclusive beyond the tolerance at the budget, no room to extend,
    # so the confirmation runs (3 fresh pairs fit) and says what ended the comparison; the refusal is kept.
    clock = [0.0]
    result, _ = run_fake(
        0.01, 0.0102, deadline=_deadline(200, clock, later=1), clock=clock, confirm=True, **{**INCONCLUSIVE, "seed": 0}
    )
    assert result.stopped_by == "confirmation" and result.extension_refused
    assert result.unconfirmed is not None and result.confirmation_pairs == 3


def test_a_limit_with_room_changes_nothing():
    clock = [0.0]
    limited, _ = run_fake(0.01, 0.01, deadline=_deadline(10_000, clock, later=3), clock=clock, **INCONCLUSIVE)
    free, _ = run_fake(0.01, 0.01, **INCONCLUSIVE)
    assert limited.stopped_by == free.stopped_by == "extension"
    assert limited.estimate == free.estimate and limited.seconds == free.seconds
    confirm = dict(tolerance=0.05, budget_s=600, confirm=True, pair_bias=0.01, noise=0.01)
    clock = [0.0]
    limited, _ = run_fake(0.01, 0.0112, deadline=_deadline(10_000, clock), clock=clock, **confirm)
    free, _ = run_fake(0.01, 0.0112, **confirm)
    assert limited.confirmation_pairs == free.confirmation_pairs == free.unconfirmed.worker_pairs
    assert limited.estimate == free.estimate


def test_the_confirmation_runs_the_pairs_the_limit_holds_and_reads_over_them():
    # The first reading takes 5 pairs, about 72 s, each about 14.4 s: a 110 s limit holds two fresh pairs.
    clock = [0.0]
    confirm = dict(tolerance=0.05, budget_s=600, confirm=True, pair_bias=0.01, noise=0.01)
    result, order = run_fake(0.01, 0.0112, deadline=_deadline(110, clock), clock=clock, **confirm)
    first = result.unconfirmed
    assert first is not None and first.worker_pairs == 5 and result.stopped_by == "confirmation"
    assert result.confirmation_pairs == 2 and len(result.pairs) == 7 == order.count("closed")
    assert clock[0] <= 110
    assert result.estimate == paired.pooled([p.log_ratios for p in result.pairs])
    assert paired.fails(result.estimate, 0.05)


def test_a_suite_of_inconclusive_scenarios_ends_within_the_limit():
    """Four scenarios, each with 20 s of full runs and an inconclusive comparison that its extension takes
    to about 128 s: about 590 s without a limit; under a 480 s limit the extensions that do not fit are
    refused, and the gate ends within it (one pair past it at most)."""

    def gate(limit_s: float | None) -> tuple[float, list[str]]:
        clock = [0.0]
        names = ["s1", "s2", "s3", "s4"]
        deadline = SuiteDeadline(limit_s, names, clock=lambda: clock[0]) if limit_s else None
        stops = []
        for name in names:
            if deadline is not None:
                deadline.scenario_starts(name)
            clock[0] += 20.0  # the two full runs
            result, _ = run_fake(0.01, 0.01, deadline=deadline, clock=clock, **INCONCLUSIVE)
            stops.append(result.stopped_by)
        return clock[0], stops

    free_s, free_stops = gate(None)
    assert free_s > 560 and free_stops == ["extension"] * 4
    limited_s, stops = gate(480)
    assert limited_s <= 480 + 20
    assert "deadline" in stops and stops[0] == "extension"  # the first one had room
