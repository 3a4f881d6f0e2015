"""The comparisons of the reference release: ratios of one metric between the two scenarios of a pair.

The pairs are data, the ``comparisons`` section of ``scenarios/suites.yaml``: each comparison names a
metric (or alternatives: the first one both results have) and pairs of scenario names, numerator
first. ``pair_ratios`` turns a set of results into the ratio of each pair whose two scenarios are
among them. The summary of ``moe-bench run`` and the report's index both show these rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.results import REPO_ROOT

COMPARISONS_PATH = REPO_ROOT / "scenarios" / "suites.yaml"
COMPARISONS_KEY = "comparisons"


class ComparisonError(ValueError):
    """A comparisons section that cannot be used: ``<file>: comparisons.<i>.<field>: <reason>``."""


@dataclass(frozen=True)
class Comparison:
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

    comparison: Comparison
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


def load_comparisons(path: Path | None = None) -> list[Comparison]:
    """The comparisons section of ``path`` (default: scenarios/suites.yaml); a malformed entry raises
    ComparisonError naming its field."""
    path = Path(path or COMPARISONS_PATH)
    section = (yaml.safe_load(path.read_text()) or {}).get(COMPARISONS_KEY, [])
    if not isinstance(section, list):
        raise ComparisonError(f"{path}: {COMPARISONS_KEY}: must be a list")
    comparisons, names = [], set()
    for i, entry in enumerate(section):
        where = f"{path}: {COMPARISONS_KEY}.{i}"
        if not isinstance(entry, dict):
            raise ComparisonError(f"{where}: must be a mapping")
        for key in ("name", "label", "metric", "mirrors", "reference", "pairs"):
            if key not in entry:
                raise ComparisonError(f"{where}.{key}: missing")
        metric = entry["metric"]
        metrics = (metric,) if isinstance(metric, str) else tuple(metric)
        if not metrics or not all(isinstance(m, str) and m for m in metrics):
            raise ComparisonError(f"{where}.metric: a metric name or a list of them")
        pairs = entry["pairs"]
        if not isinstance(pairs, list) or not pairs:
            raise ComparisonError(f"{where}.pairs: a non-empty list of [numerator, denominator]")
        for j, pair in enumerate(pairs):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
                raise ComparisonError(f"{where}.pairs.{j}: must be [numerator, denominator] scenario names")
            if pair[0] == pair[1]:
                raise ComparisonError(f"{where}.pairs.{j}: compares {pair[0]} with itself")
        if entry["name"] in names:
            raise ComparisonError(f"{where}.name: duplicate comparison {entry['name']!r}")
        names.add(entry["name"])
        comparisons.append(Comparison(
            name=str(entry["name"]), label=str(entry["label"]), metrics=metrics, mirrors=str(entry["mirrors"]),
            reference=str(entry["reference"]), pairs=tuple((a, b) for a, b in pairs),
        ))
    return comparisons


def pair_ratios(
    comparisons: list[Comparison], results: Mapping[str, tuple[str, Mapping[str, Any]]]
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
            bad = [f"{name} {status}" for name, status in ((numerator, num_status), (denominator, den_status))
                   if status != "ok"]
            if bad:
                rows.append(PairRatio(comparison, numerator, denominator, None, None, ", ".join(bad)))
                continue
            metric = next((m for m in comparison.metrics if m in num_metrics and m in den_metrics), None)
            if metric is None:
                rows.append(PairRatio(comparison, numerator, denominator, None, None,
                                      f"no {' or '.join(comparison.metrics)} on both sides"))
                continue
            num, den = num_metrics[metric]["median"], den_metrics[metric]["median"]
            if not den:
                rows.append(PairRatio(comparison, numerator, denominator, metric, None, f"{denominator} {metric} is 0"))
                continue
            rows.append(PairRatio(comparison, numerator, denominator, metric, num / den))
    return rows
