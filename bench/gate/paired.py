"""The A/B gate's statistics: paired log-ratios of block times, a Hodges-Lehmann estimate and the
Wilcoxon signed-rank confidence interval, the verdict and the stopping rule. Pure arithmetic.

Why this test. A block pair (baseline block, candidate block, run seconds apart) gives one
log-ratio ``r = log(t_candidate / t_baseline)``. On a shared machine the distribution of ``r`` has
heavy tails: another job lands on a core for a second and one block is 2x slower. The mean (and a
bootstrap of it) follows those outliers; the Hodges-Lehmann estimator (the median of the Walsh
averages ``(r_i + r_j) / 2, i <= j``) keeps 95% of the mean's efficiency on normal data and ignores
a few wild blocks. Its distribution-free confidence interval comes from the Wilcoxon signed-rank
statistic: with ``M = n(n+1)/2`` Walsh averages sorted, the interval is ``[W_(k), W_(M+1-k)]`` where
``k - 1`` is the two-sided 5% critical value of the signed-rank statistic (from its exact
distribution up to 60 pairs, the normal approximation ``floor(M/2 - 1.96 sqrt(n(n+1)(2n+1)/24))``
beyond). It assumes the
log-ratios are symmetric about their centre, which alternating the order inside pairs (AB, BA, AB,
...) makes reasonable: drift within a pair then cancels over pairs.

Verdict, for a tolerance ``tol`` (a slowdown of ``tol`` is ``log(1 + tol)`` in log space):
- ``regressed``: the interval excludes no change (lower bound > 0) and the estimate exceeds the
  tolerance;
- ``improved``: the interval excludes no change (upper bound < 0) and the estimate is below
  ``-log(1 + tol)``;
- ``unchanged``: neither, and the interval is narrower than the tolerance (so a change of the
  tolerance would have been seen);
- ``inconclusive``: neither, and the interval is still wider than the tolerance when the time
  budget runs out: the gate says so rather than guessing.

Stopping rule: after at least ``MIN_PAIRS`` pairs, stop as soon as the interval is narrower than
the tolerance, or when the budget is spent; the verdict is read once, at the stop. The rule looks
only at the interval's width, never at where it lies, so stopping early does not pick the moment
the interval happens to exclude no change (which repeated looks at the location would, raising the
false-alarm rate above the nominal 2.5% per side).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MIN_PAIRS = 8
"""Fewer pairs give no useful interval (the normal approximation and k >= 1 need about 8)."""
Z_95 = 1.959963984540054
EXACT_UP_TO = 60
"""Pairs up to which the signed-rank critical value comes from its exact distribution."""


@dataclass(frozen=True)
class PairedEstimate:
    """The slowdown of the candidate, from paired block times."""

    pairs: int
    """Block pairs."""
    estimate: float
    """Hodges-Lehmann estimate of log(t_candidate / t_baseline)."""
    low: float
    """Lower bound of the 95% interval (log space)."""
    high: float
    """Upper bound of the 95% interval (log space)."""

    @property
    def slowdown(self) -> float:
        """The estimate as a ratio - 1: 0.05 is 5% slower."""
        return math.expm1(self.estimate)

    @property
    def interval(self) -> tuple[float, float]:
        """The interval as ratios - 1."""
        return math.expm1(self.low), math.expm1(self.high)

    @property
    def width(self) -> float:
        return self.high - self.low


def log_ratios(baseline_s: list[float], candidate_s: list[float]) -> list[float]:
    if len(baseline_s) != len(candidate_s):
        raise ValueError("paired block times need as many baseline as candidate blocks")
    return [math.log(c / b) for b, c in zip(baseline_s, candidate_s)]


def walsh_averages(values: list[float]) -> list[float]:
    n = len(values)
    return sorted((values[i] + values[j]) / 2 for i in range(n) for j in range(i, n))


def signed_rank_k(n: int, z: float = Z_95, alpha: float = 0.05) -> int:
    """The rank of the interval's lower end among the M = n(n+1)/2 Walsh averages (1-based).

    k - 1 is the largest signed-rank statistic T with P(T <= k - 1) <= alpha / 2 under no change:
    from the exact distribution up to ``EXACT_UP_TO`` pairs, the normal approximation beyond.
    """
    if n <= EXACT_UP_TO:
        counts = [1]  # counts[s]: subsets of {1..i} whose ranks sum to s
        for i in range(1, n + 1):
            grown = counts + [0] * i
            for s, c in enumerate(counts):
                grown[s + i] += c
            counts = grown
        total, cumulative, k = 2**n, 0, 0
        for s, c in enumerate(counts):
            cumulative += c
            if cumulative / total > alpha / 2:
                break
            k = s + 1
        return max(1, k)
    m = n * (n + 1) / 2
    return max(1, math.floor(m / 2 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24)))


def hodges_lehmann(values: list[float], z: float = Z_95) -> PairedEstimate:
    """Estimate and interval of the centre of ``values`` (at least 2)."""
    if len(values) < 2:
        raise ValueError("at least two pairs are needed")
    walsh = walsh_averages(values)
    estimate = statistics.median(walsh)
    k = signed_rank_k(len(values), z)
    return PairedEstimate(len(values), estimate, walsh[k - 1], walsh[len(walsh) - k])


def verdict(est: PairedEstimate, tolerance: float) -> str:
    """regressed / improved / unchanged / inconclusive (see the module docstring)."""
    bound = math.log1p(tolerance)
    if est.low > 0 and est.estimate > bound:
        return "regressed"
    if est.high < 0 and est.estimate < -bound:
        return "improved"
    if est.width < bound:
        return "unchanged"
    return "inconclusive"


def decided(est: PairedEstimate, tolerance: float) -> bool:
    """The stopping rule: enough pairs, and an interval narrower than the tolerance."""
    return est.pairs >= MIN_PAIRS and est.width < math.log1p(tolerance)
