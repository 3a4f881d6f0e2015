"""``moe-bench plot``: the report's charts as PNG files, with an ``index.html`` of them.

The charts are the page's own (``bench.report.charts``, one function per chart), from the same pooled
results (``bench.report.collect``), plus a summary and a trend of every metric of every scenario.
More: docs/report.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.release.record import ReleaseError, load_releases
from bench.report import charts
from bench.report.collect import ResultSet
from bench.report.comparisons import PairComparison
from bench.report.experiments import (
    EXPERTS,
    RECOMPUTE,
    pair_charts,
    plan_memory,
    projection_stacks,
    variation_groups,
)
from bench.report.plot_index import INDEX_NAME, comparison_rows, write_index
from bench.report.trends import trends
from bench.results import ResultFileError, load_results

__all__ = ["all_charts", "plot_results"]


def all_charts(results: ResultSet, comparisons: list[PairComparison] | None = None) -> list[charts.Chart]:
    """The summary, a trend of every metric of each (scenario, machine) with an ok result, then each
    reference experiment the results can draw, as the page draws them."""
    found = [charts.summary_chart(trends(results, min_versions=1))]
    found += [charts.trend_chart(t, results.releases) for t in trends(results, min_versions=1, every_metric=True)]
    sweep = [g for g in variation_groups(results, EXPERTS) if g.throughput_metric or g.memory_metric]
    for place in dict.fromkeys((g.mode, g.machine) for g in sweep):
        found.append(charts.sweep_chart([g for g in sweep if (g.mode, g.machine) == place]))
    found += [charts.pair_chart(pairs) for pairs in pair_charts(results, comparisons) if pairs.bars]
    recompute = [g for g in variation_groups(results, RECOMPUTE) if g.throughput_metric or g.memory_metric]
    if recompute:
        found.append(charts.recompute_chart(recompute))
    found += [charts.plan_memory_chart(machine, stacks) for machine, stacks in plan_memory(results).items()]
    projections = projection_stacks(results)
    if projections:
        found.append(charts.projection_chart(projections))
    return found


def plot_results(
    results_dir: Path,
    out_dir: Path,
    on_bad_file: Callable[[ResultFileError], None] | None = None,
    comparisons: list[PairComparison] | None = None,
) -> list[Path]:
    """Write every chart of ``all_charts`` as ``<name>.png`` and ``index.html`` into ``out_dir``; returns
    the files written, ``index.html`` last. A file that cannot be read as a result document is skipped,
    passed to ``on_bad_file`` (to warn) and listed in the index."""
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    skipped: list[ResultFileError] = []

    def skip(err: ResultFileError) -> None:
        skipped.append(err)
        if on_bad_file is not None:
            on_bad_file(err)

    try:
        releases = [r.version for r in load_releases()]
    except ReleaseError:  # the plots mark no release then; the report page warns about the record
        releases = []
    docs = load_results(results_dir, on_bad_file=skip)
    results = ResultSet(results_dir, tuple(docs), tuple(skipped), tuple(releases))
    out_dir.mkdir(parents=True, exist_ok=True)
    written, used = [], {INDEX_NAME}
    figures = []
    for chart in all_charts(results, comparisons):
        name, i = f"{chart.name}.png", 2
        while name in used:
            name, i = f"{chart.name}-{i}.png", i + 1
        used.add(name)
        written.append(chart.save_png(out_dir / name))
        figures.append((written[-1], chart.caption))
    written.append(write_index(out_dir, figures, docs, results_dir, skipped, comparison_rows(results, comparisons)))
    return written
