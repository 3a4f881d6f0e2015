"""The A/B gate's paired statistics against published tables and hand-computed values."""

from __future__ import annotations

import math
import random

import pytest

from bench.gate import paired

# Two-sided 5% critical values of the Wilcoxon signed-rank statistic (the largest T rejected), as
# printed in the standard tables (e.g. Wilcoxon, Katti & Wilcox 1970).
PUBLISHED_CRITICAL = {6: 0, 7: 2, 8: 3, 9: 5, 10: 8, 12: 13, 15: 25, 20: 52, 25: 89, 30: 137}


@pytest.mark.parametrize("n, critical", sorted(PUBLISHED_CRITICAL.items()))
def test_signed_rank_critical_values_match_the_tables(n, critical):
    assert paired.signed_rank_k(n) - 1 == critical


def test_the_normal_approximation_continues_the_exact_values():
    exact = paired.signed_rank_k(paired.EXACT_UP_TO)
    approx = max(
        1,
        math.floor(
            paired.EXACT_UP_TO * (paired.EXACT_UP_TO + 1) / 4
            - paired.Z_95 * math.sqrt(paired.EXACT_UP_TO * (paired.EXACT_UP_TO + 1) * (2 * paired.EXACT_UP_TO + 1) / 24)
        ),
    )
    assert abs(exact - approx) <= 2


def test_hodges_lehmann_by_hand():
    values = [0.0, 0.1, 0.3]
    # Walsh averages: 0, .05, .15, .1, .2, .3 -> sorted 0, .05, .1, .15, .2, .3; median (.1 + .15) / 2.
    est = paired.hodges_lehmann(values)
    assert est.estimate == pytest.approx(0.125)
    assert paired.walsh_averages(values) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.3])


def test_interval_ends_are_the_walsh_averages_at_rank_k():
    rng = random.Random(11)
    values = [rng.gauss(0.02, 0.05) for _ in range(10)]
    walsh = sorted((values[i] + values[j]) / 2 for i in range(10) for j in range(i, 10))
    est = paired.hodges_lehmann(values)
    # n = 10: T <= 8 is rejected, so the interval runs from the 9th to the 47th of the 55 averages.
    assert (est.low, est.high) == (walsh[8], walsh[46])


def test_an_outlier_moves_the_estimate_little():
    values = [0.01, 0.02, 0.0, 0.015, 0.01, 0.02, 0.005, 0.012]
    spiked = values[:-1] + [0.9]  # one block run while another job held a core
    assert abs(paired.hodges_lehmann(spiked).estimate - paired.hodges_lehmann(values).estimate) < 0.01
    assert abs(sum(spiked) / 8 - sum(values) / 8) > 0.1  # the mean would have moved ten times as much


def test_a_worker_pairs_centre_ignores_one_outlier_block():
    """The pooled gate's per-pair centre is the Hodges-Lehmann estimate, not the mean: one block slowed
    40% by another job does not move it (Walsh averages of [0, 0, 0, 0.4]: six 0, three 0.2, one 0.4)."""
    assert paired.centre([0.0, 0.0, 0.0, 0.4]) == 0.0
    # Ten Walsh averages 0.01 .. 0.5; their median (0.025 + 0.03) / 2, where the mean is 0.14.
    assert paired.centre([0.01, 0.02, 0.03, 0.5]) == pytest.approx(0.0275)
    # Over worker pairs: one wild block in one pair leaves the pooled estimate where the others put it.
    pairs = [[0.01, 0.01, 0.01, 0.01], [0.0, 0.0, 0.0, 0.4], [-0.01, -0.01, -0.01, -0.01]]
    assert paired.pooled(pairs).estimate == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "estimate, low, high, expected",
    [
        (0.08, 0.06, 0.10, "regressed"),  # interval excludes 0, estimate beyond log(1.05)
        (0.03, 0.01, 0.045, "unchanged"),  # excludes 0 but within tolerance, interval narrow
        (0.06, -0.01, 0.13, "inconclusive"),  # wide: a 5% change could hide in it
        (-0.08, -0.10, -0.06, "improved"),
        (0.0, -0.02, 0.02, "unchanged"),
        (0.047, 0.03, 0.06, "inconclusive"),  # log(1.05) = 0.0488: the estimate is inside, the interval is not
        (0.047, 0.045, 0.048, "unchanged"),  # the whole interval inside
        (0.050, 0.03, 0.06, "regressed"),  # the estimate just beyond
        (0.0, -0.02, 0.05, "inconclusive"),  # centred on no change, but it admits the tolerance
        (-0.02, -0.09, 0.03, "unchanged"),  # admits an improvement only: no regression hides in it
    ],
)
def test_verdicts(estimate, low, high, expected):
    assert paired.verdict(paired.PairedEstimate(20, estimate, low, high), 0.05) == expected


@pytest.mark.parametrize(
    "estimate, low, high, expected",
    [
        (0.08, 0.06, 0.10, True),  # regressed
        (0.06, -0.01, 0.13, True),  # inconclusive, the estimate beyond log(1.05) = 0.0488
        (0.047, 0.03, 0.06, False),  # inconclusive, the estimate within
        (0.0, -0.02, 0.05, False),  # inconclusive, centred on no change
        (0.03, 0.01, 0.045, False),  # unchanged
        (-0.08, -0.10, -0.06, False),  # improved
    ],
)
def test_what_fails_the_gate_is_an_estimate_beyond_the_tolerance(estimate, low, high, expected):
    assert paired.fails(paired.PairedEstimate(20, estimate, low, high), 0.05) is expected


def test_stopping_rule_waits_for_the_minimum_of_pairs():
    narrow = paired.PairedEstimate(paired.MIN_PAIRS - 1, 0.0, -0.001, 0.001)
    assert not paired.decided(narrow, 0.05)
    assert paired.decided(paired.PairedEstimate(paired.MIN_PAIRS, 0.0, -0.001, 0.001), 0.05)
    assert not paired.decided(paired.PairedEstimate(40, 0.0, -0.05, 0.05), 0.05)


def test_false_alarm_rate_of_identical_sides_is_at_most_5_percent():
    """Simulated A/A: heavy-tailed block noise, no true change; the rule regresses rarely."""
    rng = random.Random(20261201)
    alarms = 0
    for _ in range(400):
        values = []
        while True:
            noise = rng.gauss(0, 0.04) + (rng.random() < 0.05) * rng.choice([-1, 1]) * rng.uniform(0.2, 0.8)
            values.append(noise)
            if len(values) >= 2:
                est = paired.hodges_lehmann(values)
                if paired.decided(est, 0.05) or len(values) >= 60:
                    break
        alarms += paired.verdict(est, 0.05) == "regressed"
    assert alarms / 400 <= 0.05


def test_a_planted_slowdown_is_found():
    rng = random.Random(7)
    found = 0
    for _ in range(100):
        values = [math.log(1.10) + rng.gauss(0, 0.04) for _ in range(30)]
        found += paired.verdict(paired.hodges_lehmann(values), 0.05) == "regressed"
    assert found >= 95


# ---- over worker pairs --------------------------------------------------------------------------

# Two-sided 5% critical values of Student's t, as printed in the standard tables.
PUBLISHED_T = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 10: 2.228, 20: 2.086, 30: 2.042}


@pytest.mark.parametrize("df, critical", sorted(PUBLISHED_T.items()))
def test_t_critical_values_match_the_tables(df, critical):
    assert paired.t_critical(df) == pytest.approx(critical, abs=5e-4)


def test_student_t_cdf_by_hand():
    assert paired.student_t_cdf(0.0, 7) == pytest.approx(0.5)
    assert paired.student_t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert paired.student_t_cdf(1.0, 2) == pytest.approx(0.5 + 1 / (2 * math.sqrt(3)))  # 1/2 + t / (2 sqrt(2 + t^2))
    assert paired.student_t_cdf(-1.0, 2) == pytest.approx(0.5 - 1 / (2 * math.sqrt(3)))
    assert paired.t_critical(1000) == pytest.approx(1.962, abs=5e-4)  # toward the normal's 1.960


def test_pooled_by_hand():
    pairs = [[0.01, 0.03], [0.05], [0.0, 0.02, 0.04]]
    # Centres (Hodges-Lehmann): 0.02, 0.05, 0.02; mean 0.03, sd sqrt(0.0003); t(2) = 4.303.
    est = paired.pooled(pairs)
    half = 4.302653 * math.sqrt(0.0003) / math.sqrt(3)
    assert (est.worker_pairs, est.block_pairs) == (3, 6)
    assert est.estimate == pytest.approx(0.03)
    assert (est.low, est.high) == (pytest.approx(0.03 - half), pytest.approx(0.03 + half))
    assert est.between_sd == pytest.approx(math.sqrt(0.0003))
    # Residuals around each centre: 0.0002 + 0 + 0.0008 over 1 + 0 + 2 degrees of freedom.
    assert est.within_sd == pytest.approx(math.sqrt(0.001 / 3))


def test_blocks_per_pair_is_cochrans_optimum():
    est = paired.PooledEstimate(4, 8, 0.0, -0.01, 0.01, between_sd=0.02, within_sd=0.02)
    # tau^2 = 0.02^2 - 0.02^2 / 2 = 0.0002; B = (0.02 / sqrt(0.0002)) * sqrt(30 s / 1 s) = 7.75
    assert paired.blocks_per_pair(est, 2, pair_s=30.0, block_pair_s=1.0) == 8
    assert paired.blocks_per_pair(est, 2, pair_s=1.0, block_pair_s=1.0) == paired.MIN_BLOCKS_PER_PAIR
    no_bias = paired.PooledEstimate(4, 8, 0.0, -0.01, 0.01, between_sd=0.01, within_sd=0.02)
    assert paired.blocks_per_pair(no_bias, 2, pair_s=1.0, block_pair_s=1.0) == paired.MAX_BLOCKS_PER_PAIR


def test_stopping_rule_over_worker_pairs_waits_for_the_minimum():
    def est(pairs: int, half: float) -> paired.PooledEstimate:
        return paired.PooledEstimate(pairs, 2 * pairs, 0.0, -half, half, 0.01, 0.01)

    assert not paired.decided_pooled(est(paired.MIN_WORKER_PAIRS - 1, 0.001), 0.05)
    assert paired.decided_pooled(est(paired.MIN_WORKER_PAIRS, 0.001), 0.05)
    assert not paired.decided_pooled(est(40, 0.03), 0.05)


def test_fail_rates_against_a_simulation_and_by_hand():
    """``paired.fail_rates`` against drawn pairs of estimates (seed 11), and at a slowdown equal to the
    tolerance by hand: once 1/2; confirmed P(X > 0, X + Y > 0) = 1/4 + asin(1/sqrt 2) / (2 pi) = 3/8."""
    rng, n, tol, se = random.Random(11), 200_000, 0.03, 0.015
    for slowdown in (0.0, 0.05):
        delta, bound = math.log1p(slowdown), math.log1p(tol)
        draws = [(rng.gauss(delta, se), rng.gauss(delta, se)) for _ in range(n)]
        once = sum(e1 > bound for e1, _ in draws) / n
        confirmed = sum(e1 > bound and e1 + e2 > 2 * bound for e1, e2 in draws) / n
        expected = paired.fail_rates(slowdown, se, tol)
        for simulated, computed in zip((once, confirmed), expected):
            binomial_se = math.sqrt(max(computed * (1 - computed), 1e-6) / n)
            assert abs(simulated - computed) < 4 * binomial_se, (slowdown, simulated, computed)
    once, confirmed = paired.fail_rates(tol, se, tol)
    assert once == pytest.approx(0.5, abs=1e-9) and confirmed == pytest.approx(3 / 8, abs=1e-4)
