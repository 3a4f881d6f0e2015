"""Trends: each scenario's headline metrics across every version of a results folder.

A scenario (on one machine) has a trend when it finished ok in two versions or more. Its headline
metrics are its throughput and its peak memory (the first of each list below that its results have;
else its first gated metric). A point is the version's pooled median (``ResultSet.groups``: as the
gate pools); its spread is the interquartile range of the pooled samples (the band) and their min and
max; a metric recorded with one sample has no spread.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.metrics import MEMORY_PREFERENCE, THROUGHPUT_PREFERENCE
from bench.report.collect import ResultSet
from bench.report.ordering import sort_versions


@dataclass(frozen=True)
class TrendPoint:
    version: str
    median: float
    q1: float | None
    """Lower quartile of the samples; None for a metric with one sample."""
    q3: float | None
    low: float | None
    """Smallest sample; None for one sample."""
    high: float | None
    samples: int
    values: tuple[float, ...] = ()
    """The pooled samples themselves."""


@dataclass(frozen=True)
class TrendSeries:
    metric: str
    unit: str
    better: str | None
    points: tuple[TrendPoint, ...]


@dataclass(frozen=True)
class Trend:
    scenario: str
    machine: str
    versions: tuple[str, ...]
    """The versions the scenario finished ok in, in version order."""
    series: tuple[TrendSeries, ...]


def _point(version: str, entry: dict) -> TrendPoint:
    samples = [float(v) for v in entry["samples"]]
    if entry["spread"] is None or len(samples) < 2:
        return TrendPoint(version, float(entry["median"]), None, None, None, None, len(samples), tuple(samples))
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")  # as bench.results.metric
    return TrendPoint(version, float(entry["median"]), q1, q3, min(samples), max(samples), len(samples), tuple(samples))


def headline_metrics(metric_sets: list[dict[str, dict]]) -> list[str]:
    """Throughput and peak memory (the first name of each list present), else the first gated metric."""
    present = set().union(*(m.keys() for m in metric_sets)) if metric_sets else set()
    chosen = [
        next(n for n in names if n in present)
        for names in (THROUGHPUT_PREFERENCE, MEMORY_PREFERENCE)
        if any(n in present for n in names)
    ]
    if chosen:
        return chosen
    gated = sorted({n for m in metric_sets for n, e in m.items() if e["better"] is not None})
    return gated[:1]


def trends(results: ResultSet, min_versions: int = 2, every_metric: bool = False) -> list[Trend]:
    """Every (scenario, machine) with ok results in ``min_versions`` versions or more, by scenario then
    machine: its headline metrics (``every_metric``: each metric with samples, in the order first seen)."""
    by_key: dict[tuple[str, str], dict[str, dict[str, dict]]] = {}
    for version in results.versions:
        for key, group in results.ok_groups(version).items():
            by_key.setdefault(key, {})[version] = group.metrics
    found = []
    for (scenario, machine), per_version in sorted(by_key.items()):
        if len(per_version) < min_versions:
            continue
        versions = sort_versions(per_version)
        metric_sets = [per_version[v] for v in versions]
        if every_metric:
            names = list(dict.fromkeys(n for m in metric_sets for n, e in m.items() if e.get("samples")))
        else:
            names = headline_metrics(metric_sets)
        series = []
        for name in names:
            points = [_point(v, per_version[v][name]) for v in versions if name in per_version[v]]
            last = next(per_version[v][name] for v in reversed(versions) if name in per_version[v])
            series.append(TrendSeries(name, last["unit"], last["better"], tuple(points)))
        found.append(Trend(scenario, machine, tuple(versions), tuple(series)))
    return found


def single_version_scenarios(results: ResultSet) -> list[tuple[str, str, str]]:
    """(scenario, machine, version) of the scenarios with ok results in one version only."""
    seen: dict[tuple[str, str], list[str]] = {}
    for version in results.versions:
        for key in results.ok_groups(version):
            seen.setdefault(key, []).append(version)
    return [(s, m, vs[0]) for (s, m), vs in sorted(seen.items()) if len(vs) == 1]
