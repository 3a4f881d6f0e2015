"""The comparisons of the reference release: ratios of one metric between the two scenarios of a pair.
More: docs/report.md.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from bench.results import REPO_ROOT

COMPARISONS_PATH = REPO_ROOT / "scenarios" / "suites.yaml"
COMPARISONS_KEY = "comparisons"
EXACT_UP_TO = 400
"""Largest n*m whose interval uses the exact Mann-Whitney table; larger ones the normal approximation."""


class PairComparisonError(ValueError):
    """A comparisons section that cannot be used: ``<file>: comparisons.<i>.<field>: <reason>``."""


@dataclass(frozen=True)
class PairComparison:
    """One published comparison and the scenario pairs that measure it."""

    name: str
    """Identifier, unique in the section."""
    label: str
    """What the ratio is, for people (``DDP+EP / FSDP tokens/s``)."""
    metrics: tuple[str, ...]
    """The metric compared; alternatives in order, the first one both results have."""
    mirrors: str
    """The published comparison of the reference release it mirrors."""
    reference: str
    """The published figure, as text (``2.68 (52,000 / 19,400 tokens/s per GPU)``, ``none published``)."""
    pairs: tuple[tuple[str, str], ...]
    """(numerator, denominator) scenario names."""


@dataclass(frozen=True)
class PairRatio:
    """One pair's ratio in a set of results, or why there is none."""

    comparison: PairComparison
    """The comparison the pair belongs to."""
    numerator: str
    """Scenario name of the numerator."""
    denominator: str
    """Scenario name of the denominator."""
    metric: str | None
    """The metric compared (None when no ratio)."""
    ratio: float | None
    """median(numerator) / median(denominator), None when it cannot be computed."""
    note: str | None = None
    """Why there is no ratio (a side not ok, the metric missing)."""
    interval: tuple[float, float] | None = None
    """95% interval of the ratio from both runs' samples (``ratio_interval``); None when exact or too few."""
    exact: bool = False
    """Both sides are single exact values (peak memory, counts): the ratio has no noise."""

    def describe(self) -> str:
        """The ratio with its interval, for people: ``1.156 [1.102, 1.213]``, ``0.987 [0.95, 1.02], within
        noise``, ``1.500 (exact values)``."""
        if self.ratio is None:
            return f"n/a ({self.note})"
        if self.exact:
            return f"{self.ratio:.3f} (exact values)"
        if self.interval is None:
            return f"{self.ratio:.3f} (too few samples for an interval)"
        low, high = self.interval
        return f"{self.ratio:.3f} [{low:.3f}, {high:.3f}]" + (", within noise" if self.within_noise else "")

    @property
    def within_noise(self) -> bool:
        """The interval holds 1: the two runs' own noise could make this ratio."""
        return self.interval is not None and self.interval[0] <= 1.0 <= self.interval[1]


CONSOLE_WIDTH = 120
"""The widest line ``comparison_lines`` writes (logs are read in terminals and editors)."""


def published_text(comparison: PairComparison) -> str:
    """The published figure, labelled as what it is: every figure the reference release published was
    measured on GPUs (B300 clusters), none on a CPU."""
    if comparison.reference.strip().lower().startswith("none"):
        return "none published"
    return f"published GPU figure {comparison.reference} ({comparison.mirrors})"


def comparison_lines(rows: Sequence[PairRatio], on_cpu: bool = False, width: int = CONSOLE_WIDTH) -> list[str]:
    """The console's comparisons: one heading per comparison with its published figure (a GPU figure,
    so said), its pairs below it, every line at most ``width`` columns. ``on_cpu``: the runs ran on a
    CPU, whose ratios a GPU's published figures do not predict (another machine balance), said once."""

    if not rows:
        return []
    lines = ["comparisons (numerator / denominator: ratio of the medians [95% interval from the two runs' steps]):"]
    if on_cpu:
        lines += textwrap.wrap(
            "measured on a CPU: the published figures are GPU figures, which a CPU is not expected to match "
            "(compare the ratios' direction, not their size)",
            width,
            initial_indent="  ",
            subsequent_indent="  ",
        )
    by_comparison: dict[str, list[PairRatio]] = {}
    for row in rows:
        by_comparison.setdefault(row.comparison.name, []).append(row)
    for group in by_comparison.values():
        comparison = group[0].comparison
        lines += textwrap.wrap(
            f"{comparison.label}: {published_text(comparison)}", width, initial_indent="  ", subsequent_indent="      "
        )
        for row in group:
            lines += textwrap.wrap(
                f"{row.numerator} / {row.denominator} = {row.describe()}",
                width,
                initial_indent="    ",
                subsequent_indent="        ",
                break_on_hyphens=False,
            )
    return lines


def load_comparisons(path: Path | None = None) -> list[PairComparison]:
    """The comparisons section of ``path`` (default: scenarios/suites.yaml); a malformed entry raises
    PairComparisonError naming its field."""
    path = Path(path or COMPARISONS_PATH)
    section = (yaml.safe_load(path.read_text()) or {}).get(COMPARISONS_KEY, [])
    if not isinstance(section, list):
        raise PairComparisonError(f"{path}: {COMPARISONS_KEY}: must be a list")
    comparisons, names = [], set()
    for i, entry in enumerate(section):
        where = f"{path}: {COMPARISONS_KEY}.{i}"
        if not isinstance(entry, dict):
            raise PairComparisonError(f"{where}: must be a mapping")
        for key in ("name", "label", "metric", "mirrors", "reference", "pairs"):
            if key not in entry:
                raise PairComparisonError(f"{where}.{key}: missing")
        metric = entry["metric"]
        metrics = (metric,) if isinstance(metric, str) else tuple(metric)
        if not metrics or not all(isinstance(m, str) and m for m in metrics):
            raise PairComparisonError(f"{where}.metric: a metric name or a list of them")
        pairs = entry["pairs"]
        if not isinstance(pairs, list) or not pairs:
            raise PairComparisonError(f"{where}.pairs: a non-empty list of [numerator, denominator]")
        for j, pair in enumerate(pairs):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
                raise PairComparisonError(f"{where}.pairs.{j}: must be [numerator, denominator] scenario names")
            if pair[0] == pair[1]:
                raise PairComparisonError(f"{where}.pairs.{j}: compares {pair[0]} with itself")
        if entry["name"] in names:
            raise PairComparisonError(f"{where}.name: duplicate comparison {entry['name']!r}")
        names.add(entry["name"])
        comparisons.append(
            PairComparison(
                name=str(entry["name"]),
                label=str(entry["label"]),
                metrics=metrics,
                mirrors=str(entry["mirrors"]),
                reference=str(entry["reference"]),
                pairs=tuple((a, b) for a, b in pairs),
            )
        )
    return comparisons


def pair_ratios(
    comparisons: list[PairComparison], results: Mapping[str, tuple[str, Mapping[str, Any]]]
) -> list[PairRatio]:
    """Every pair with a result on at least one side that ran, in the section's order.

    ``results`` maps a scenario name to its (status, metrics). A pair with a side missing from the
    results, or with neither side ok (both skipped on a host too small, say), is left out; a pair with
    one side not ok is listed without a ratio, with the reason.
    """
    rows = []
    for comparison in comparisons:
        for numerator, denominator in comparison.pairs:
            if numerator not in results or denominator not in results:
                continue
            (num_status, num_metrics), (den_status, den_metrics) = results[numerator], results[denominator]
            if num_status != "ok" and den_status != "ok":
                continue
            bad = [
                f"{name} {status}"
                for name, status in ((numerator, num_status), (denominator, den_status))
                if status != "ok"
            ]
            if bad:
                rows.append(PairRatio(comparison, numerator, denominator, None, None, ", ".join(bad)))
                continue
            metric = next((m for m in comparison.metrics if m in num_metrics and m in den_metrics), None)
            if metric is None:
                rows.append(
                    PairRatio(
                        comparison,
                        numerator,
                        denominator,
                        None,
                        None,
                        f"no {' or '.join(comparison.metrics)} on both sides",
                    )
                )
                continue
            num, den = num_metrics[metric]["median"], den_metrics[metric]["median"]
            if not den:
                rows.append(PairRatio(comparison, numerator, denominator, metric, None, f"{denominator} {metric} is 0"))
                continue
            num_samples, den_samples = _samples(num_metrics[metric]), _samples(den_metrics[metric])
            exact = len(num_samples) == 1 and len(den_samples) == 1
            interval = None if exact else ratio_interval(num_samples, den_samples)
            rows.append(PairRatio(comparison, numerator, denominator, metric, num / den, None, interval, exact))
    return rows


def _samples(entry: Mapping[str, Any]) -> list[float]:
    samples = entry.get("samples")
    # An old document may count its samples instead of listing them: the median stands for one sample.
    return [float(v) for v in samples] if isinstance(samples, list) and samples else [float(entry["median"])]


@cache
def _mann_whitney_counts(n: int, m: int) -> tuple[int, ...]:
    """How many of the C(n+m, n) orderings of two samples give each value of the Mann-Whitney U (0..n*m)."""
    if n == 0 or m == 0:
        return (1,)
    # U(n, m) = U(n-1, m) + m when the largest value is the first sample's, U(n, m-1) otherwise.
    first, second = _mann_whitney_counts(n - 1, m), _mann_whitney_counts(n, m - 1)
    counts = [0] * (n * m + 1)
    for u, c in enumerate(first):
        counts[u + m] += c
    for u, c in enumerate(second):
        counts[u] += c
    return tuple(counts)


def trimmed_differences(n: int, m: int, confidence: float = 0.95) -> int | None:
    """How many of the n*m sorted differences to step over at each end for the ``confidence`` interval:
    the largest k with P(U < k) <= (1 - confidence) / 2 under the null; None when even k = 1 is too
    many (too few samples for that confidence)."""
    if n * m > EXACT_UP_TO:
        # The normal approximation of U (mean nm/2, variance nm(n+m+1)/12) is within a count of the
        # exact table at these sizes, and the table would cost (nm)^2 steps.
        z = statistics.NormalDist().inv_cdf(1 - (1 - confidence) / 2)
        k = math.floor(n * m / 2 - z * math.sqrt(n * m * (n + m + 1) / 12))
        return k if k >= 1 else None
    counts = _mann_whitney_counts(n, m)
    total = sum(counts)
    tail, k = 0, 0
    while k < len(counts) and 2 * (tail + counts[k]) <= (1 - confidence) * total:
        tail += counts[k]
        k += 1
    return k if k >= 1 else None


def ratio_interval(
    numerator: Sequence[float], denominator: Sequence[float], confidence: float = 0.95
) -> tuple[float, float] | None:
    """The ``confidence`` interval of numerator / denominator from two independent samples (module
    docstring): the k-th smallest and k-th largest of the n*m ratios x_i / y_j, with k from the exact
    Mann-Whitney null distribution. None when the samples are too few for that confidence (at 95%,
    three samples a side are too few, four are enough) or hold a value that is not positive."""
    if min(len(numerator), len(denominator)) == 0 or any(v <= 0 for v in (*numerator, *denominator)):
        return None
    k = trimmed_differences(len(numerator), len(denominator), confidence)
    if k is None:
        return None
    logs = sorted(math.log(x) - math.log(y) for x in numerator for y in denominator)
    return math.exp(logs[k - 1]), math.exp(logs[-k])
