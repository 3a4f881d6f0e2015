"""``moe-bench report``: one self-contained HTML page of a results folder.
More: docs/report.md.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from bench.gate.compare import DEFAULT_TOLERANCE, MetricRow
from bench.gate.verdict import accepted_lines
from bench.release.record import Release, ReleaseError, load_releases
from bench.report.collect import ReportError, ResultSet, choose_versions, load_result_set, problems
from bench.report.comparisons import PairComparison
from bench.report.experiments import (
    EXPERTS,
    RECOMPUTE,
    pair_charts,
    plan_memory,
    projection_stacks,
    variation_groups,
)
from bench.report.release_table import ReleaseComparison, release_comparison
from bench.report.trends import single_version_scenarios, trends
from bench.results import ResultFileError, write_text_atomic
from bench.units import format_percent, format_signed_percent, format_value

if TYPE_CHECKING:
    from bench.report.charts import Chart

__all__ = ["PAGE_NAME", "Report", "ReportError", "build_report"]

PAGE_NAME = "index.html"


@dataclass
class Report:
    """What ``build_report`` wrote."""

    path: Path
    charts: list[str] = field(default_factory=list)
    """The kind of each chart on the page, in page order (trend, pair, sweep, ...)."""
    figures: list[Chart] = field(default_factory=list)
    """The charts themselves (figure, series, hover texts), in the same order."""
    warnings: list[str] = field(default_factory=list)
    """Problems with the input that did not stop the page (unreadable files, the release record)."""
    comparison: ReleaseComparison | None = None


class _Page:
    """The page's HTML, built section by section; charts are numbered as they are added."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.charts: list[str] = []
        self.figures: list[Chart] = []
        # heavy: matplotlib, loaded once a page is drawn (not for ``moe-bench --help``)
        from bench.report import charts

        self.draw = charts

    def add(self, text: str) -> None:
        self.parts.append(text)

    def chart(self, chart: Chart) -> None:
        self.charts.append(chart.kind)
        self.figures.append(chart)
        self.add(
            f'<figure class="chart" id="chart-{len(self.charts)}" data-chart="{chart.kind}" '
            f'data-series="{len(chart.series)}">{chart.svg()}<figcaption>{_e(chart.caption)}</figcaption></figure>'
        )


def _e(text: object) -> str:
    return html.escape(str(text))


def _table(header: list[str], rows: list[list[str]], attrs: str = "") -> str:
    """An HTML table; cells are HTML already (escape text with ``_e``)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table {attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def build_report(
    results_dir: Path,
    out_dir: Path,
    base: str | None = None,
    new: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    releases: list[str | Release] | None = None,
    on_warning: Callable[[str], None] | None = None,
    comparisons: list[PairComparison] | None = None,
) -> Report:
    """Write ``out_dir/index.html`` from the documents under ``results_dir``.

    ``releases``: the releases to compare against and mark (default: ``releases.json``); a ``Release``
    brings its accepted changes, a version string none.
    ``comparisons``: the pairs to chart (default: the comparisons of ``scenarios/suites.yaml``).
    ``on_warning`` gets each problem that does not stop the page (an unreadable file, named).
    """
    warnings: list[str] = []

    def warn(text: str) -> None:
        warnings.append(text)
        if on_warning is not None:
            on_warning(text)

    if releases is None:
        try:
            releases = list(load_releases())
        except ReleaseError as err:
            warn(f"{err}; no releases marked")
            releases = []
    acceptances = [a for r in releases if isinstance(r, Release) for a in r.accepted]

    def skipped(err: ResultFileError) -> None:
        warn(f"{err}; skipped")

    results = load_result_set(
        Path(results_dir), [r.version if isinstance(r, Release) else r for r in releases], on_bad_file=skipped
    )
    versions = choose_versions(results, base, new)
    comparison = release_comparison(results, versions, tolerance, acceptances) if versions else None

    page = _Page()
    _header(page, results, warnings)
    _problems(page, results)
    _comparison(page, results, comparison, {r.version: r for r in releases if isinstance(r, Release)})
    _trends(page, results)
    _experiments(page, results, comparisons)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PAGE_NAME
    write_text_atomic(path, _document("\n".join(page.parts)))
    return Report(path, page.charts, page.figures, warnings, comparison)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def _machine_text(machine: dict) -> str:
    gpu = f"{machine.get('gpu_count')} x {machine.get('gpu_name')}" if machine.get("gpu_count") else "no GPU"
    cpu = f"{machine.get('cpu_model', '?')} ({machine.get('cpu_cores', '?')} cores)"
    return f"{cpu}, {gpu}, torch {machine.get('torch', '?')}"


def _header(page: _Page, results: ResultSet, warnings: list[str]) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    releases = [v for v in results.versions if v in results.releases]
    page.add(
        f"<h1>moe-bench results</h1><p class='lead'>{len(results.docs)} result documents from "
        f"<code>{_e(results.root)}</code>: versions {_e(', '.join(results.versions))}"
        f" (releases among them: {_e(', '.join(releases) or 'none')}); generated {stamp}.</p>"
    )
    machines = {d.machine: d.data["machine"] for d in results.docs}
    page.add(
        _table(
            ["machine", "what it is"],
            [[_e(n), _e(_machine_text(m))] for n, m in sorted(machines.items())],
            "class='machines'",
        )
    )
    page.add(
        "<nav><a href='#problems'>Problems</a> · <a href='#comparison'>Release comparison</a> · "
        "<a href='#trends'>Trends</a> · <a href='#experiments'>Reference experiments</a></nav>"
    )
    if warnings:
        items = "".join(f"<li>{_e(w)}</li>" for w in warnings)
        page.add(f"<div class='warnings' id='warnings'><b>Not read:</b><ul>{items}</ul></div>")


def _problems(page: _Page, results: ResultSet) -> None:
    found = problems(results)
    page.add("<h2 id='problems'>Problems</h2>")
    if not found:
        page.add("<p class='ok'>Every scenario's newest run in every version finished ok.</p>")
        return
    rows = [
        [
            f"<span class='status status-{_e(p.status)}'>{_e(p.status)}</span>",
            _e(p.scenario),
            _e(p.machine),
            _e(p.version),
            f"<pre>{_e(p.error or '')}</pre>",
            f"<code>{_e(p.path or '')}</code>",
        ]
        for p in found
    ]
    page.add(
        f"<p>{len(found)} scenario run{'s' * (len(found) != 1)} did not finish ok (the newest run of each "
        "scenario in each version):</p>"
    )
    page.add(_table(["status", "scenario", "machine", "version", "error", "file"], rows, "class='problems'"))


def _noise(row: MetricRow) -> str:
    if row.noise is None:
        return "-"
    if row.exact and not row.noise:
        return "exact value"
    sides = [
        f"{side} IQR {format_percent(v, 1)}"
        for side, v in (("base", row.base_rel_iqr), ("new", row.cand_rel_iqr))
        if v is not None
    ]
    return f"{format_percent(row.noise, 1)}" + (f" ({', '.join(sides)})" if sides else "")


def _comparison(
    page: _Page, results: ResultSet, comparison: ReleaseComparison | None, releases_by_version: dict | None = None
) -> None:
    releases_by_version = releases_by_version or {}
    page.add("<h2 id='comparison'>Release comparison</h2>")
    if comparison is None:
        page.add(f"<p>One version only ({_e(results.versions[0])}): nothing to compare yet.</p>")
        return
    v = comparison.versions
    gate = comparison.gate
    page.add(
        f"<p><b>{_e(v.base)} → {_e(v.new)}</b>: {_e(v.why)}. Verdicts of <code>moe-bench gate --baseline "
        f"&lt;{_e(v.base)} results&gt; --candidate &lt;{_e(v.new)} results&gt;</code> at tolerance "
        f"{_e(format_percent(comparison.comparison.tolerance))}: a change counts when it is larger than both "
        "the tolerance and the measured noise (the two runs' interquartile ranges added).</p>"
    )
    if comparison.sources:
        page.add(
            "<ul class='small comparison-sources'>"
            + "".join(f"<li>Compared from {_e(line)}</li>" for line in comparison.sources)
            + "</ul>"
        )
    for version in v.unmeasured:
        release = releases_by_version.get(version)
        where = release.baseline_text() if release else f"compare with moe-bench ab --baseline-ref v{version}"
        page.add(
            f"<p class='unmeasured-release' data-release='{_e(version)}'><b>Release {_e(version)}: not compared, "
            f"it has no results in this folder.</b> {_e(where)}.</p>"
        )
    if comparison.one_version_machines:
        alone = "; ".join(f"{m} ({version} only)" for m, version in comparison.one_version_machines)
        page.add(
            f"<p class='small one-version-machines'>Compared on the machines that ran both versions; measured "
            f"in one version only, so not compared: {_e(alone)}.</p>"
        )
    _banner(page, comparison)
    if gate.failures:
        page.add("<ul class='failures'>" + "".join(f"<li>{_e(line)}</li>" for line in gate.failures) + "</ul>")
    accepted = accepted_lines(comparison.comparison)
    if accepted:
        page.add("<ul class='accepted'>" + "".join(f"<li>{_e(line)}</li>" for line in accepted) + "</ul>")
    notes = [i.describe() for i in comparison.issues if not i.fails_gate and i.kind != "missing_in_baseline"]
    notes += [line for line in gate.work if not line.startswith("REGRESSION")]
    if notes:
        page.add("<ul class='notes'>" + "".join(f"<li>{_e(line)}</li>" for line in notes) + "</ul>")
    if not comparison.tables:
        changed = len(comparison.comparison.mismatched)
        why = (
            f" {changed} scenario{'s' * (changed != 1)} ran in both, with specs that differ (the scenario hash "
            "covers the spec with every default filled in): not like for like, so not compared."
            if changed
            else ""
        )
        page.add(
            f"<p>No scenario to compare metric by metric: none finished ok in both {_e(v.base)} and "
            f"{_e(v.new)} on the same machine with the same spec.{_e(why)}</p>"
        )
    for table in comparison.tables:
        rows = []
        for row in table.rows:
            change = (
                format_signed_percent(row.change) if row.change is not None and abs(row.change) != float("inf") else "-"
            )
            rows.append(
                [
                    _e(row.metric),
                    _e(format_value(row.base, row.unit)),
                    _e(format_value(row.cand, row.unit)),
                    _e(f"{row.ratio:.3f}" if row.ratio is not None else "-"),
                    _e(change),
                    _e(_noise(row)),
                    _e(format_percent(row.threshold, 1) if row.threshold is not None else "-"),
                    f"<span class='verdict verdict-{row.verdict}'>{row.verdict}</span>"
                    + (f"<span class='reason'>: {_e(row.accepted)}</span>" if row.accepted else ""),
                ]
            )
        hidden = f"; {table.info_metrics} reported, never gated, not listed" if table.info_metrics else ""
        page.add(
            f"<h3>{_e(table.scenario)} <small>on {_e(table.machine)}: {_e(v.base)} → {_e(v.new)}{hidden}</small></h3>"
        )
        attrs = (
            f"class='comparison' data-scenario='{_e(table.scenario)}' data-machine='{_e(table.machine)}' "
            f"data-base='{_e(v.base)}' data-new='{_e(v.new)}'"
        )
        page.add(
            _table(
                [
                    "metric",
                    f"base ({_e(v.base)})",
                    f"new ({_e(v.new)})",
                    "ratio",
                    "change",
                    "noise",
                    "threshold",
                    "verdict",
                ],
                rows,
                attrs,
            )
        )
    _new_scenarios(page, comparison)


def _new_scenarios(page: _Page, comparison: ReleaseComparison) -> None:
    """Scenarios only in the new version: one collapsed list below the tables (they compare nothing)."""
    new = comparison.comparison.missing_in_baseline
    if not new:
        return
    items = "".join(f"<li>{_e(i.scenario)} <small>on {_e(i.machine)} ({_e(i.cand_status)})</small></li>" for i in new)
    page.add(
        f"<details class='new-scenarios'><summary>{len(new)} scenario{'s' * (len(new) != 1)} new in "
        f"{_e(comparison.versions.new)}: nothing to compare against</summary><ul>{items}</ul></details>"
    )


_BANNER_WORDS = {
    "regressed": "Regressed",
    "missing": "Missing",
    "not-compared": "Not compared",
    "not-ok": "Not ok",
    "inconclusive": "Inconclusive",
    "accepted": "Passed with accepted changes",
    "pass": "Passed",
}


def _banner(page: _Page, comparison: ReleaseComparison) -> None:
    """The verdict first, then what adds up to it, each kind counted apart; the gate's own line below."""
    compared = comparison.comparison
    counts = compared.counts()
    missing = len(compared.missing_in_candidate)
    parts = [
        ("regressed", f"{counts['regressed']} regressed"),
        ("accepted", f"{counts['accepted']} accepted"),
        ("inconclusive", f"{counts['inconclusive']} inconclusive"),
        ("missing", f"{missing} scenario{'s' * (missing != 1)} missing in {comparison.versions.new}"),
        ("not-ok", f"{sum(i.fails_gate for i in compared.not_ok + compared.mismatched)} not ok or changed"),
        ("improved", f"{counts['improved']} improved"),
        ("unchanged", f"{counts['unchanged']} unchanged"),
        ("one-side", f"{counts['missing']} metric{'s' * (counts['missing'] != 1)} on one side only"),
    ]
    if compared.not_compared:
        parts.insert(4, ("not-compared", _not_compared_text(compared.not_compared)))
    spans = " · ".join(f"<span class='count' data-count='{kind}'>{_e(text)}</span>" for kind, text in parts)
    outcome = comparison.outcome
    page.add(
        f"<div class='gate gate-{outcome}' data-gate='{outcome}'><b>{_BANNER_WORDS[outcome]}</b>: {spans}"
        f"<div class='gate-line'>{_e(comparison.header)}</div></div>"
    )


def _not_compared_text(issues) -> str:
    noisy = sum(i.kind == "noisy" for i in issues)
    apart = len(issues) - noisy
    return f"{noisy} noisy, {apart} on different machines: not compared"


def _trends(page: _Page, results: ResultSet) -> None:
    page.add("<h2 id='trends'>Trends</h2>")
    found = trends(results)
    if not found:
        page.add("<p>No scenario finished ok in two versions yet.</p>")
    for trend in found:
        page.chart(page.draw.trend_chart(trend, results.releases))
    single = single_version_scenarios(results)
    if single:
        items = "".join(f"<li>{_e(s)} <small>({_e(v)}, {_e(m)})</small></li>" for s, m, v in single)
        page.add(
            f"<details class='single-version'><summary>{len(single)} scenario{'s' * (len(single) != 1)} in one "
            f"version only, so no trend</summary><ul>{items}</ul></details>"
        )


def _experiments(page: _Page, results: ResultSet, comparisons: list[PairComparison] | None) -> None:
    """Each experiment the results can draw gets its section; the others are named once, at the end, with
    what they would need (so a page never shows an empty section)."""
    page.add(
        "<h2 id='experiments'>Reference experiments</h2><p>The comparisons the reference release published, "
        "drawn from whatever results this folder holds (each at the newest version that has it).</p>"
    )
    undrawn: list[tuple[str, str]] = []
    sweep = [g for g in variation_groups(results, EXPERTS) if g.throughput_metric or g.memory_metric]
    if sweep:
        page.add("<h3>Expert-count sweep</h3>")
    else:
        undrawn.append(
            (
                "Expert-count sweep",
                "scenarios identical except model.moe.num_experts (e.g. smoke/e8-random-bf16 and e64-random-bf16)",
            )
        )
    # A plan's GiB and a CPU run's MiB never share an axis, nor do two machines a chart.
    for mode, machine in dict.fromkeys((g.mode, g.machine) for g in sweep):
        page.chart(page.draw.sweep_chart([g for g in sweep if (g.mode, g.machine) == (mode, machine)]))
    pairs = pair_charts(results, comparisons)
    if pairs:
        page.add(
            "<h3>Pair comparisons</h3><p class='small'>Each ratio's interval is the 95% interval from the two "
            "runs' own step samples: it shows what step-to-step noise could do, not the difference between two "
            "processes of the same code, which only repeated runs measure (<code>moe-bench ab</code>).</p>"
        )
    else:
        undrawn.append(
            (
                "Pair comparisons",
                "both scenarios of a pair in scenarios/suites.yaml's comparisons (the "
                "default suite runs them; e.g. e8-ep2-nosync-bf16 and e8-dp2-fsdp-bf16)",
            )
        )
    for chart in pairs:
        if chart.bars:
            page.chart(page.draw.pair_chart(chart))
        if chart.unmeasured:
            notes = "; ".join(
                f"{b.numerator} / {b.denominator} ({b.machine}, {b.version}): {b.note}" for b in chart.unmeasured
            )
            page.add(f"<p class='small'>{_e(chart.comparison.label)}, no ratio: {_e(notes)}.</p>")
    recompute = [g for g in variation_groups(results, RECOMPUTE) if g.throughput_metric or g.memory_metric]
    if recompute:
        page.add("<h3>Activation recompute</h3>")
        page.chart(page.draw.recompute_chart(recompute))
    else:
        undrawn.append(
            (
                "Activation recompute",
                "scenarios identical except their recompute section (the "
                "default suite plans them; e.g. olmo-core3/moe-128e-47b-zero1 and moe-128e-47b-zero1-recompute-full)",
            )
        )
    plans = plan_memory(results)
    if plans:
        page.add("<h3>Plan memory per rank</h3>")
    else:
        undrawn.append(("Plan memory per rank", "plan results of scenarios with a cluster (scenarios/olmo-core3)"))
    for machine, stacks in plans.items():
        page.chart(page.draw.plan_memory_chart(machine, stacks))
    projections = projection_stacks(results)
    if projections:
        page.add("<h3>Projection breakdowns</h3>")
        page.chart(page.draw.projection_chart(projections))
    else:
        undrawn.append(("Projection breakdowns", "proxy results (the proxy suite)"))
    if undrawn:
        items = "".join(f"<li><b>{_e(name)}</b>: needs {_e(need)}</li>" for name, need in undrawn)
        page.add(
            f"<details class='undrawn'><summary>Not drawn from these results: "
            f"{_e(', '.join(name for name, _ in undrawn))}</summary><ul>{items}</ul></details>"
        )


_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1250px;
       color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
h3 small { font-weight: normal; color: #666; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
table.comparison td:nth-child(n+2):nth-child(-n+7) { text-align: right; font-variant-numeric: tabular-nums; }
pre { margin: 0; white-space: pre-wrap; max-width: 50em; font-size: 0.9em; }
.lead { color: #444; } .small { font-size: 0.85em; color: #555; } .absent { color: #777; font-style: italic; }
.warnings { background: #fff4e0; border: 1px solid #f0c070; padding: 0.5em 1em; }
.status, .verdict { font-weight: 600; padding: 0.1em 0.4em; border-radius: 3px; }
.status-failed, .status-oom, .status-timeout { background: #fde0e0; color: #a00; }
.status-skipped { background: #eee; color: #555; }
.verdict-regressed { background: #fde0e0; color: #a00; } .verdict-improved { background: #e0f5e0; color: #060; }
.verdict-missing { background: #fff4d0; color: #850; } .verdict-unchanged { color: #555; font-weight: normal; }
.verdict-accepted { background: #e0ecfa; color: #035; } .verdict-inconclusive { background: #f0e6fa; color: #527; }
.reason { font-size: 0.85em; color: #035; }
.gate { padding: 0.4em 0.8em; border-radius: 4px; } .gate-line { font-size: 0.85em; color: #444; margin-top: 0.3em; }
.gate-pass { background: #e0f5e0; } .gate-accepted { background: #e0ecfa; } .gate-inconclusive { background: #f0e6fa; }
.gate-regressed, .gate-not-ok { background: #fde0e0; } .gate-not-compared { background: #fff4d0; } .gate-missing { background: #fff4d0; }
.ok { color: #060; } figure.chart { margin: 1em 0 2em; } figcaption { font-size: 0.85em; color: #555; }
figure.chart svg { display: block; max-width: 100%; height: auto; }
nav { margin: 1em 0; }
"""


def _document(body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>moe-bench results</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )
