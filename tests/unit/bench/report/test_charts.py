"""bench.report.charts: each chart draws the numbers of the result documents, one tagged series each, and
its SVG (the page's) and PNG (``moe-bench plot``'s) come from the same figure.

The expected numbers are the ones ``report_results`` wrote by hand (its module doc works them out), not
read back through the report's own data functions.
"""

from __future__ import annotations

import math
import re

import pytest
from report_results import (
    BASE,
    DEVICE_PROJECTION,
    NEW,
    PROJECTION,
    TOKENS,
    write_comparisons,
    write_two_versions,
)

from bench.report import charts
from bench.report.collect import load_result_set
from bench.report.comparisons import load_comparisons
from bench.report.page import build_report
from bench.report.plot import all_charts, plot_results
from bench.report.trends import trends
from bench.results import load_results
from bench.units import GIB


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_two_versions(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def comparisons(tmp_path_factory):
    return load_comparisons(write_comparisons(tmp_path_factory.mktemp("c") / "comparisons.yaml"))


@pytest.fixture(scope="module")
def report(folder, comparisons, tmp_path_factory):
    return build_report(folder, tmp_path_factory.mktemp("page"), releases=[BASE], comparisons=comparisons)


def drawn(chart: charts.Chart, k: int) -> list:
    """What series ``k`` drew: a line's or a scatter's (x, y) points, a bar series' (x, y, width, height)."""
    found = chart.figure.findobj(lambda a: re.fullmatch(rf"series-{k}(-\d+)?", a.get_gid() or "") is not None)
    assert found, f"series {k} of {chart.title} is not drawn"
    if len(found) == 1 and hasattr(found[0], "get_xydata"):
        return [tuple(p) for p in found[0].get_xydata().tolist()]
    if len(found) == 1 and hasattr(found[0], "get_offsets"):
        return [tuple(p) for p in found[0].get_offsets().tolist()]
    return [(p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in found]


def same(points: list, expected: list) -> bool:
    return len(points) == len(expected) and all(p == pytest.approx(e) for p, e in zip(points, expected))


def one(report, kind: str, title_part: str) -> charts.Chart:
    (chart,) = [c for c in report.figures if c.kind == kind and title_part in c.title]
    return chart


def test_a_trend_draws_each_versions_median_per_metric(report):
    chart = one(report, "trend", "e8-random-bf16 on")
    assert chart.series == ["tokens_per_s_per_gpu", "peak_tensor_bytes"]
    tokens = [TOKENS[("e8-random-bf16", v)] for v in (BASE, NEW)]
    assert same(drawn(chart, 0), [(0, tokens[0]), (1, tokens[1])])
    assert same(drawn(chart, 1), [(0, 100), (1, 100)])  # MiB: the axis is in MiB
    assert [ax.get_ylabel() for ax in chart.figure.axes[:2]] == ["tokens/s", "MiB"]
    assert [t.get_text() for t in chart.figure.axes[0].get_xticklabels()] == [BASE, NEW]


def test_the_sweep_draws_throughput_and_memory_against_the_expert_count(report):
    chart = one(report, "sweep", "runs on")
    assert chart.series == [f"e8-random-bf16 / e64-random-bf16: {panel}" for panel in ("throughput", "memory")]
    new = [TOKENS[(s, NEW)] for s in ("e8-random-bf16", "e64-random-bf16")]
    assert same(drawn(chart, 0), [(8, new[0]), (64, new[1])])
    assert same(drawn(chart, 1), [(8, 100), (64, 300)])
    assert chart.figure.axes[0].get_xlabel() == "experts"


def test_a_pair_draws_both_sides_and_their_ratio(report):
    chart = one(report, "pair", "MXFP8 / BF16 tokens/s")
    assert chart.series == ["numerator", "denominator", "ratio"]
    (numerator,), (denominator,) = drawn(chart, 0), drawn(chart, 1)
    assert numerator[3] == pytest.approx(TOKENS[("e8-random-mxfp8", NEW)])
    assert denominator[3] == pytest.approx(TOKENS[("e8-random-bf16", NEW)])
    assert numerator[0] < denominator[0]  # the numerator first
    ((_, ratio),) = drawn(chart, 2)
    assert ratio == pytest.approx(960 / 800)


def test_the_recompute_chart_draws_a_bar_per_mode_and_metric(report):
    chart = one(report, "recompute", "")
    assert chart.series == [
        "recompute none: throughput",
        "recompute full: throughput",
        "recompute none: memory",
        "recompute full: memory",
    ]
    widths = [[bar[2] for bar in drawn(chart, k)] for k in range(4)]
    assert same(
        widths,
        [[TOKENS[("e8-ep2-nosync-bf16", NEW)]], [TOKENS[("e8-ep2-nosync-bf16-recompute-full", NEW)]], [80], [50]],
    )


def test_plan_memory_adds_up_to_the_plans_total(report, folder):
    chart = one(report, "plan-memory", "")
    totals = {
        d.name: d.metrics["memory_total_bytes"]["median"] / GIB
        for d in load_results(folder)
        if d.version == NEW and d.data["mode"] == "plan"
    }
    parts = chart.series[:-1]
    assert chart.series[-1] == "GPU memory"
    rows = [sum(drawn(chart, k)[row][2] for k in range(len(parts))) for row in range(len(totals))]
    assert rows == pytest.approx([totals["moe-128e-47b"], totals["moe-8e-4.6b"]])
    ends = [drawn(chart, k)[0][0] + drawn(chart, k)[0][2] for k in range(len(parts))]
    assert ends == sorted(ends)  # stacked: each part starts where the one before ended


def test_the_projection_draws_each_part_as_its_share_of_the_step(report):
    chart = one(report, "projection", "")
    for row, parts in enumerate((PROJECTION, DEVICE_PROJECTION)):
        shares = {name: drawn(chart, k)[row][2] for k, name in enumerate(chart.series)}
        assert sum(shares.values()) == pytest.approx(100)
        step = sum(parts.values())
        assert sorted(v for v in shares.values() if v) == pytest.approx(
            sorted(v / step * 100 for v in parts.values() if v)
        )


def _series_in_svg(svg: str) -> dict[int, list[str]]:
    """The SVG of each tagged series, by series number (a bar series: one group per bar)."""
    found: dict[int, list[str]] = {}
    for k, body in re.findall(r'<g id="series-(\d+)(?:-\d+)?">(.*?)</g>', svg, re.S):
        found.setdefault(int(k), []).append(body)
    return found


def test_the_page_svg_holds_every_series_with_every_point(report):
    """Each chart's SVG on the page has a group per series (per bar), and a line's path has as many
    vertices as the series has points: a series left out or cut short fails here."""
    page = report.path.read_text()
    svgs = re.findall(r'data-series="(\d+)">(<svg .*?</svg>)', page, re.S)
    assert len(svgs) == len(report.figures)
    for chart, (declared, svg) in zip(report.figures, svgs):
        groups = _series_in_svg(svg)
        assert int(declared) == len(chart.series) == len(groups), chart.title
        for k in range(len(chart.series)):
            points = drawn(chart, k)
            line = re.search(r'<path d="([^"]*)"', groups[k][0])
            if len(groups[k]) == 1 and line and "z" not in line.group(1) and len(points) > 1:
                vertices = re.findall(r"[ML] ", line.group(1))
                assert len(vertices) == sum(not math.isnan(p[0]) for p in points), (chart.title, k)  # NaN: a break
            elif len(groups[k]) > 1 or chart.kind in ("recompute", "plan-memory", "projection"):
                assert len(groups[k]) == len(points), (chart.title, k)
    trend = one(report, "trend", "e8-random-bf16 on")
    (path,) = re.findall(r'<path d="M ([\d.]+) ([\d.]+) \s*L ([\d.]+) ([\d.]+)', _series_in_svg(trend.svg())[0][0])
    x0, y0, x1, y1 = map(float, path)
    assert x0 < x1 and y0 < y1  # 1,000 then 800 tokens/s: left to right, downwards on the screen


def test_the_svg_is_the_same_for_the_same_data(folder):
    results = load_result_set(folder, [BASE])
    first, again = (charts.trend_chart(trends(results)[0], results.releases).svg() for _ in range(2))
    assert first == again
    assert first.startswith("<svg ") and "<dc:date>" not in first


def test_plot_writes_the_pages_charts_as_png(folder, comparisons, report, tmp_path):
    written = plot_results(folder, tmp_path / "plots", comparisons=comparisons)
    names = {p.stem for p in written if p.suffix == ".png"}
    assert {c.name for c in report.figures} <= names
    assert "summary" in names
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written if p.suffix == ".png")
    # Its trends show every metric with samples, the page's the headline ones.
    (trend,) = [
        c
        for c in charts_of(folder, comparisons)
        if c.kind == "trend" and c.name == one(report, "trend", "e8-random-bf16 on").name
    ]
    assert trend.series[:2] == ["tokens_per_s_per_gpu", "step_time_s"] and "loss" in trend.series
    assert same(drawn(trend, trend.series.index("peak_tensor_bytes")), [(0, 100), (1, 100)])


def charts_of(folder, comparisons):
    return all_charts(load_result_set(folder, [BASE]), comparisons)
