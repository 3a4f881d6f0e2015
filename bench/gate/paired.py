"""The A/B gate's statistics: paired log-ratios of block times within one pair of workers, pooled
over several fresh pairs of workers with the pair bias as a random effect; the verdict and the
stopping rule. Pure arithmetic.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

MIN_PAIRS = 8
"""Block pairs below which one pair of workers' own interval says nothing (k >= 1 needs about 8)."""
MIN_WORKER_PAIRS = 3
"""Worker pairs before the stopping rule may stop: with two, the t interval has one degree of
freedom (t = 12.7) and a single wild pair decides."""
MIN_BLOCKS_PER_PAIR, MAX_BLOCKS_PER_PAIR = 2, 16
"""Bounds of the blocks-per-pair rule: two give each pair a centre robust to nothing worse than one
slow block's half; past sixteen, more blocks buy nothing the next pair would not buy better."""
Z_95 = 1.959963984540054
EXACT_UP_TO = 60
"""Pairs up to which the signed-rank critical value comes from its exact distribution."""


class LogInterval:
    """An estimate of log(t_candidate / t_baseline) and its 95% interval, read as ratios."""

    estimate: float
    low: float
    high: float

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


@dataclass(frozen=True)
class PairedEstimate(LogInterval):
    """The slowdown of the candidate, from paired block times."""

    pairs: int
    """Block pairs."""
    estimate: float
    """Hodges-Lehmann estimate of log(t_candidate / t_baseline)."""
    low: float
    """Lower bound of the 95% interval (log space)."""
    high: float
    """Upper bound of the 95% interval (log space)."""


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


def verdict(est: LogInterval, tolerance: float) -> str:
    """regressed / improved / unchanged / inconclusive (see docs/gate-statistics.md)."""
    bound = math.log1p(tolerance)
    if est.low > 0 and est.estimate > bound:
        return "regressed"
    if est.high < 0 and est.estimate < -bound:
        return "improved"
    if est.high < bound:
        return "unchanged"
    return "inconclusive"


def fails(est: LogInterval, tolerance: float) -> bool:
    """Whether a scenario's timing fails the gate: its estimate beyond the tolerance (regressed, or
    inconclusive with the estimate past it; see docs/gate-statistics.md for why the rest passes)."""
    return est.estimate > math.log1p(tolerance)


def fail_rates(slowdown: float, se: float, tolerance: float, steps: int = 4000) -> tuple[float, float]:
    """How often ``fails`` fails a candidate ``slowdown`` slower (0.05: 5%) whose estimate has standard
    error ``se`` (log space, normal): ``(once, confirmed)``, read once, and with the confirmation
    (the mean of a first estimate beyond the tolerance and an independent second one beyond it too).

    ``confirmed = integral over x > tol of pdf(x) * P(e2 > 2 tol - x)``, by the midpoint rule over
    twelve standard errors past the tolerance (``steps`` intervals).
    """
    delta, bound = math.log1p(slowdown), math.log1p(tolerance)

    def above(x: float) -> float:
        """P(estimate > x)."""
        return 0.5 * math.erfc((x - delta) / (se * math.sqrt(2)))

    width = 12 * se / steps
    confirmed = 0.0
    for i in range(steps):
        x = bound + (i + 0.5) * width
        density = math.exp(-0.5 * ((x - delta) / se) ** 2) / (se * math.sqrt(2 * math.pi))
        confirmed += density * above(2 * bound - x) * width
    return above(bound), confirmed


def warns(est: LogInterval, warn_above: float | None, tolerance: float) -> bool:
    """Whether a passing estimate is beyond the warning threshold: reported, never failed."""
    return warn_above is not None and math.log1p(warn_above) < est.estimate <= math.log1p(tolerance)


# --------------------------------------------------------------------------------------------
# The operating point: the suite's error budget (docs/gates-and-releases.md#the-operating-point)
# --------------------------------------------------------------------------------------------

SUITE_FALSE_ALARMS = 0.05
"""The share of CI runs on identical code that the whole suite may fail, after the confirmation."""
PLANTED_SLOWDOWN, PLANTED_CAUGHT = 0.10, 0.95
"""A slowdown of ``PLANTED_SLOWDOWN`` in any one scenario is caught in ``PLANTED_CAUGHT`` of runs."""


def scenario_level(suite_rate: float, scenarios: int) -> float:
    """The false-alarm rate per scenario that keeps a suite of independent scenarios at ``suite_rate``
    (Sidak: ``1 - (1 - suite_rate)^(1/m)``; 1.274% for 5% over four, Bonferroni's 5%/4 = 1.25% below it)."""
    return 1 - (1 - suite_rate) ** (1 / scenarios)


def suite_rate(rates: list[float]) -> float:
    """The share of suite runs that fail when scenario i fails with ``rates[i]``, independently."""
    return 1 - math.prod(1 - p for p in rates)


LIMIT_STEPS = 400
"""Midpoint steps of ``fail_rates`` inside the bisections (the rates to about 1e-5: the limits to 0.01%)."""


def _largest_se(holds, low: float = 1e-4, high: float = 0.2) -> float:
    """The largest standard error at which ``holds(se)`` (true below it, false above), by bisection."""
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low


def se_limit_false_alarms(tolerance: float, level: float) -> float:
    """The largest standard error at which identical code fails the confirmed rule in at most ``level``."""
    return _largest_se(lambda se: fail_rates(0.0, se, tolerance, LIMIT_STEPS)[1] <= level)


def se_limit_detection(tolerance: float, slowdown: float = PLANTED_SLOWDOWN, caught: float = PLANTED_CAUGHT) -> float:
    """The largest standard error at which ``slowdown`` fails the confirmed rule in at least ``caught`` of runs."""
    return _largest_se(lambda se: fail_rates(slowdown, se, tolerance, LIMIT_STEPS)[1] >= caught)


@dataclass(frozen=True)
class OperatingPoint:
    """The tolerance at which the suite's two targets hold over the widest range of noise."""

    tolerance: float
    """The blocking threshold (a fraction): an estimate beyond it fails, confirmed."""
    se_limit: float
    """The standard error of a scenario's estimate (log space) up to which both targets hold."""
    level: float
    """The false-alarm rate per scenario (``scenario_level``)."""


def operating_point(
    scenarios: int,
    suite_false_alarms: float = SUITE_FALSE_ALARMS,
    slowdown: float = PLANTED_SLOWDOWN,
    caught: float = PLANTED_CAUGHT,
) -> OperatingPoint:
    """The tolerance where the noise limits of the two targets meet: a lower tolerance catches the
    slowdown at more noise but keeps the false alarms at less, a higher one the other way round."""
    level = scenario_level(suite_false_alarms, scenarios)
    low, high = 0.0, slowdown
    for _ in range(20):
        middle = (low + high) / 2
        if se_limit_false_alarms(middle, level) < se_limit_detection(middle, slowdown, caught):
            low = middle
        else:
            high = middle
    tolerance = (low + high) / 2
    return OperatingPoint(tolerance, se_limit_false_alarms(tolerance, level), level)


def decided(est: PairedEstimate, tolerance: float) -> bool:
    """One pair of workers' stopping rule: enough block pairs, and an interval narrower than the tolerance."""
    return est.pairs >= MIN_PAIRS and est.width < math.log1p(tolerance)


# --------------------------------------------------------------------------------------------
# Over worker pairs
# --------------------------------------------------------------------------------------------


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` (a positive integer) degrees of freedom.

    The closed forms of Abramowitz & Stegun 26.7.3 (odd ``df``) and 26.7.4 (even ``df``) for
    ``A(t|df) = P(|T| <= t)``, with ``theta = atan(t / sqrt(df))``.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    theta = math.atan(t / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    if df % 2:
        term = total = sin * cos
        for i in range(3, df, 2):
            term *= cos * cos * (i - 1) / i
            total += term
        central = (2 / math.pi) * (theta + (total if df > 1 else 0.0))
    else:
        term = total = 1.0
        for i in range(2, df, 2):
            term *= cos * cos * (i - 1) / i
            total += term
        central = sin * total
    return 0.5 + central / 2


@functools.cache
def t_critical(df: int, alpha: float = 0.05) -> float:
    """The two-sided ``alpha`` critical value of Student's t (12.706 for one degree of freedom at 5%)."""
    low, high = 0.0, 1e4
    for _ in range(100):  # bisection to far below the printed tables' three decimals
        middle = (low + high) / 2
        if student_t_cdf(middle, df) < 1 - alpha / 2:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True)
class PooledEstimate(LogInterval):
    """The slowdown of the candidate over several fresh worker pairs, pair bias included."""

    worker_pairs: int
    """Worker pairs (``P``)."""
    block_pairs: int
    """Block pairs over all worker pairs."""
    estimate: float
    """Mean of the pairs' Hodges-Lehmann centres of log(t_candidate / t_baseline)."""
    low: float
    """Lower bound of the 95% t interval over the pair centres (log space)."""
    high: float
    """Upper bound of that interval (log space)."""
    between_sd: float
    """Standard deviation of the pair centres (log space): pair bias and block noise together."""
    within_sd: float
    """Pooled standard deviation of one block pair's log-ratio around its pair's centre (log space)."""

    @property
    def se(self) -> float:
        """The standard error of the estimate (log space): the pair centres' spread over sqrt(P)."""
        return self.between_sd / math.sqrt(self.worker_pairs)


def centre(values: list[float]) -> float:
    """The Hodges-Lehmann centre of one pair's log-ratios (the value itself for one)."""
    if not values:
        raise ValueError("a worker pair without block pairs has no centre")
    return statistics.median(walsh_averages(values))


def pooled(pairs: list[list[float]]) -> PooledEstimate:
    """The t interval over the worker pairs' centres; ``pairs``: each pair's block log-ratios (at least two pairs)."""
    if len(pairs) < 2:
        raise ValueError("at least two worker pairs are needed")
    centres = [centre(values) for values in pairs]
    p = len(centres)
    mean = statistics.fmean(centres)
    # stdev in floats: statistics.stdev sums exact fractions, a third of a gate simulation's time.
    sd = math.sqrt(math.fsum((c - mean) ** 2 for c in centres) / (p - 1))
    half = t_critical(p - 1) * sd / math.sqrt(p)
    residuals = [(v - c) ** 2 for values, c in zip(pairs, centres) for v in values]
    dof = sum(len(values) - 1 for values in pairs)
    within = math.sqrt(sum(residuals) / dof) if dof > 0 else 0.0
    return PooledEstimate(p, sum(len(v) for v in pairs), mean, mean - half, mean + half, sd, within)


def decided_pooled(est: PooledEstimate, tolerance: float) -> bool:
    """The stopping rule over worker pairs: enough of them, and an interval narrower than the tolerance."""
    return est.worker_pairs >= MIN_WORKER_PAIRS and est.width < math.log1p(tolerance)


def blocks_per_pair(est: PooledEstimate, blocks: int, pair_s: float, block_pair_s: float) -> int:
    """Block pairs per worker pair for the next pairs: Cochran's optimum ``(sigma / tau) sqrt(c_pair / c_block)``.

    ``blocks``: the block pairs each pair ran so far; ``pair_s``: seconds to start and warm a pair;
    ``block_pair_s``: seconds of one block pair. ``tau^2`` is the between-pair variance less the
    block noise it carries (``sigma^2 / blocks``); with no pair bias left to see, blocks are cheaper
    than pairs and the bound applies.
    """
    sigma2 = est.within_sd**2
    tau2 = est.between_sd**2 - sigma2 / blocks
    if tau2 <= 0:
        return MAX_BLOCKS_PER_PAIR
    best = math.sqrt(sigma2 / tau2) * math.sqrt(pair_s / max(block_pair_s, 1e-9))
    return max(MIN_BLOCKS_PER_PAIR, min(MAX_BLOCKS_PER_PAIR, round(best)))
