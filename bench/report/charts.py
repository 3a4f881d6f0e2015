"""The report's charts, each drawn by one function with matplotlib: the page (``bench.report.page``)
embeds a chart as inline SVG, ``moe-bench plot`` (``bench.report.plot``) writes the same chart as PNG.

Each function turns what ``bench.report.trends`` or ``bench.report.experiments`` found into one
``Chart``. Axes carry units people read (``bench.units.axis_scale``). Every data series is tagged in
the SVG (``series-N``, a bar ``series-N-J``) with a hover text that names the machine and the version
of the number it shows, so a browser shows it as a tooltip and a test can count what was drawn.
"""

from __future__ import annotations

import html
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: charts are only ever written to files
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, Formatter, FuncFormatter, NullLocator

from bench.metrics import title as metric_title
from bench.report.experiments import MemoryStack, PairBar, PairChart, ProjectionStack, VariationGroup, variation_order
from bench.report.ordering import sort_versions
from bench.report.trends import Trend
from bench.units import GIB, AxisScale, axis_scale, format_gib, format_percent, format_value

WIDTH_IN = 12.0
"""Every chart's width, inches: 1,150 px on the page at its 1,250 px column."""
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D", "#BAB0AC", "#EECA3B")
SVG_SALT = "moe-bench"
"""``svg.hashsalt``: the SVG's clip-path and marker ids derive from it, so the same data gives the same page."""
PNG_DPI = 100


@dataclass
class Chart:
    """One figure of the report and what its SVG carries beside the drawing."""

    kind: str
    """What it shows: trend, summary, sweep, pair, recompute, plan-memory, projection."""
    name: str
    """Its file name without the suffix (``moe-bench plot``)."""
    title: str
    caption: str
    figure: Figure
    series: list[str] = field(default_factory=list)
    """The name of each data series, in the order of their ``series-N`` tags."""
    tips: dict[str, str] = field(default_factory=dict)
    """Hover text by SVG id."""

    def add(self, name: str, drawn: Any, tips: str | list[str]) -> None:
        """Tag ``drawn`` (a line, a scatter or a ``BarContainer``) as the next series: one tip for the
        whole of it, or one per bar."""
        k = len(self.series)
        self.series.append(name)
        if isinstance(drawn, BarContainer):
            for j, (patch, tip) in enumerate(zip(drawn.patches, tips)):
                patch.set_gid(f"series-{k}-{j}")
                self.tips[f"series-{k}-{j}"] = tip
        else:
            drawn.set_gid(f"series-{k}")
            self.tips[f"series-{k}"] = tips if isinstance(tips, str) else "\n".join(tips)

    def svg(self) -> str:
        """The chart as an ``<svg>`` element for an HTML page: the same bytes for the same data."""
        for i, ax in enumerate(self.figure.axes):
            ax.set_gid(f"axes-{i}")  # the browser check finds each plot area and the marks in it
            ax.patch.set_gid(f"area-{i}")
        buffer = io.StringIO()
        with matplotlib.rc_context({"svg.hashsalt": SVG_SALT, "svg.fonttype": "path"}):
            self.figure.savefig(buffer, format="svg", metadata={"Date": None})
        text = buffer.getvalue()
        text = text[text.index("<svg") :]  # the XML prolog and doctype have no place inside HTML
        return re.sub(
            r'<g id="(series-[0-9-]+)">',
            lambda m: f"{m.group(0)}<title>{html.escape(self.tips[m.group(1)])}</title>",
            text,
        )

    def save_png(self, path: Path) -> Path:
        self.figure.savefig(path, format="png", dpi=PNG_DPI, metadata={"Software": None})
        return path


def _chart(kind: str, name: str, title: str, caption: str, height_in: float) -> Chart:
    figure = Figure(figsize=(WIDTH_IN, height_in), layout="constrained", facecolor="white")
    figure.suptitle(title, x=0.01, ha="left", fontsize=13)
    return Chart(kind, _file_name(name), title, caption, figure)


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "chart"


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _style(ax, grid_axis: str = "y") -> None:
    ax.grid(True, axis=grid_axis, color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=9)


class _Ticks(Formatter):
    """Tick labels in the axis's format (a d3 format, as Python's mini-language spells it), with more
    decimals where that format would print two ticks alike (a range narrower than its precision)."""

    def __init__(self, scale: AxisScale) -> None:
        self.spec = scale.tickformat.replace("~", "")

    def __call__(self, x: float, pos: int | None = None) -> str:
        return format(x, self.spec)

    def format_ticks(self, values: list[float]) -> list[str]:
        labels = [format(v, self.spec) for v in values]
        for more in range(1, 6):
            if len(set(labels)) == len(labels):
                break
            spec = f",.{more}f" if self.spec.endswith("f") else f",.{3 + more}g"
            labels = [format(v, spec) for v in values]
        return labels


def _ticks(scale: AxisScale) -> Formatter:
    return _Ticks(scale)


def _legend(chart: Chart, handles: list, names: list[str]) -> None:
    """One legend under the plots, in as many columns as fit the width."""
    if not handles:
        return
    widest = max(len(n) for n in names) + 6
    columns = len(names) if sum(len(n) + 6 for n in names) <= 150 else max(1, 150 // widest)
    chart.figure.legend(handles, names, loc="outside lower center", ncols=columns, fontsize=9, frameon=False)


def _direction(better: str | None) -> str:
    return {"higher": "higher is better", "lower": "lower is better"}.get(better or "", "not gated")


def _version_axis(ax, versions: list[str]) -> None:
    ax.set_xticks(range(len(versions)), versions, rotation=30 if len(versions) > 4 else 0, ha="right")
    ax.set_xlim(-0.5, len(versions) - 0.5)


# --------------------------------------------------------------------------------------------
# Trends
# --------------------------------------------------------------------------------------------


def trend_chart(trend: Trend, releases: tuple[str, ...] | list[str] = ()) -> Chart:
    """A panel per metric: the median per version as a line, the IQR as a band, min..max as bars and
    each sample as a faint dot; releases marked with a dotted line and a diamond."""
    versions = list(trend.versions)
    position = {v: i for i, v in enumerate(versions)}
    released = [v for v in versions if v in releases]
    note = f"; releases ({', '.join(released)}) marked ◆" if released else ""
    columns = min(3, len(trend.series))
    rows = math.ceil(len(trend.series) / columns)
    chart = _chart(
        "trend",
        f"{trend.machine}--{trend.scenario}",
        f"{trend.scenario} on {trend.machine}: across versions{note}",
        f"{trend.scenario} on {trend.machine}: the pooled median of each version (as the gate pools its runs), "
        "the interquartile range as a band, min..max as bars, each sample as a dot; a metric with one sample "
        "has no spread.",
        1.2 + 3.3 * rows,
    )
    axes = chart.figure.subplots(rows, columns, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, series in zip(axes, trend.series):
        _style(ax)
        values = [v for p in series.points for v in (p.median, p.low, p.high) if v is not None]
        scale = axis_scale(series.unit, values)
        xs = [position[p.version] for p in series.points]
        spread = [(position[p.version], p.q1, p.q3) for p in series.points if p.q1 is not None and p.q3 is not None]
        if len(spread) >= 2:
            handles["interquartile range"] = ax.fill_between(
                [x for x, _, _ in spread],
                [q1 / scale.factor for _, q1, _ in spread],
                [q3 / scale.factor for _, _, q3 in spread],
                color=_color(0),
                alpha=0.18,
                linewidth=0,
            )
        dots = [(position[p.version] + 0.06, s / scale.factor) for p in series.points for s in p.values]
        if any(p.low is not None for p in series.points):
            ax.scatter(*zip(*dots), s=9, color="#999", alpha=0.5, linewidths=0, zorder=2)
        ranged = [p for p in series.points if p.low is not None and p.high is not None]
        if ranged:
            handles["min..max"] = ax.errorbar(
                [position[p.version] for p in ranged],
                [p.median / scale.factor for p in ranged],
                yerr=[
                    [(p.median - p.low) / scale.factor for p in ranged],  # type: ignore[operator]
                    [(p.high - p.median) / scale.factor for p in ranged],  # type: ignore[operator]
                ],
                fmt="none",
                ecolor=_color(0),
                elinewidth=1,
                capsize=3,
                zorder=3,
            )
        (line,) = ax.plot(xs, [p.median / scale.factor for p in series.points], "o-", color=_color(0), ms=5, zorder=4)
        handles["median"] = line
        chart.add(series.metric, line, [_trend_tip(trend, series.unit, p) for p in series.points])
        for p in series.points:
            if p.version in releases:
                ax.axvline(position[p.version], color="#888", linestyle=":", linewidth=1, zorder=1)
                ax.plot(position[p.version], p.median / scale.factor, "D", color=_color(0), ms=9, zorder=5)
        ax.set_title(f"{metric_title(series.metric)} ({_direction(series.better)})", fontsize=10)
        ax.set_ylabel(scale.label)
        ax.yaxis.set_major_formatter(_ticks(scale))
        _version_axis(ax, versions)
    for ax in axes[len(trend.series) :]:
        ax.set_visible(False)
    _legend(chart, list(handles.values()), list(handles))
    return chart


def _trend_tip(trend: Trend, unit: str, p) -> str:
    lines = [
        f"{trend.scenario} on {trend.machine}, version {p.version}",
        f"median {format_value(p.median, unit)} over {p.samples} sample{'s' * (p.samples != 1)}",
    ]
    if p.q1 is not None:
        lines.append(
            f"IQR {format_value(p.q1, unit)} - {format_value(p.q3, unit)}, "
            f"min {format_value(p.low, unit)}, max {format_value(p.high, unit)}"
        )
    else:
        lines.append("one sample: no spread")
    return "\n".join(lines)


def summary_chart(trends: list[Trend]) -> Chart:
    """Each scenario's first metric as a ratio to its first version, a line per (scenario, machine)."""
    versions = sort_versions(v for t in trends for v in t.versions)
    chart = _chart(
        "summary",
        "summary",
        "Headline metric across versions (ratio to each scenario's first version)",
        "Summary: each scenario's headline metric relative to its first version.",
        4.2 + 0.22 * len(trends),
    )
    ax = chart.figure.subplots()
    _style(ax)
    machines = {t.machine for t in trends}
    handles, names = [], []
    for i, trend in enumerate(trends):
        series = trend.series[0]
        base = next((p.median for p in series.points if p.median), None)
        if base is None:
            continue
        points = [p for p in series.points if p.median]
        (line,) = ax.plot(
            [versions.index(p.version) for p in points], [p.median / base for p in points], "o-", ms=4, color=_color(i)
        )
        where = trend.scenario if len(machines) == 1 else f"{trend.scenario} on {trend.machine}"
        name = f"{where} ({series.metric}, {_direction(series.better)})"
        tips = [
            f"{trend.scenario} on {trend.machine}, version {p.version}: {p.median / base:.3f} of the first "
            f"({format_value(p.median, series.unit)})"
            for p in points
        ]
        chart.add(name, line, tips)
        handles.append(line)
        names.append(name)
    ax.axhline(1.0, color="#888", linestyle="--", linewidth=0.8)
    _version_axis(ax, versions or ["-"])
    ax.set_ylabel("headline metric / first version")
    if not handles:
        ax.text(0.5, 0.5, "no ok results with a headline metric", ha="center", va="center", transform=ax.transAxes)
    _legend(chart, handles, names)
    return chart


# --------------------------------------------------------------------------------------------
# Pair comparisons
# --------------------------------------------------------------------------------------------


def pair_chart(pairs: PairChart) -> Chart:
    """Left, both scenarios of each pair as bars, side by side; right, each pair's ratio with its 95%
    interval as error bars against a line at 1 (an interval that crosses it is within noise)."""
    comparison, bars = pairs.comparison, pairs.bars
    unit = next((b.unit for b in bars if b.unit), "")
    scale = axis_scale(unit, [v for b in bars for v in (b.numerator_value, b.denominator_value) if v is not None])
    places = {(b.machine, b.version) for b in bars}
    chart = _chart(
        "pair",
        f"pair--{comparison.name}",
        f"{comparison.label}: measured ×ratio on each pair with its 95% interval; reference {comparison.reference}",  # noqa: RUF001 (the multiplication sign is meant for display)
        f"{comparison.label}, mirrors {comparison.mirrors}. Left, each pair's two scenarios in one version on one "
        "machine; right, the ratio with its 95% interval: "
        + "; ".join(f"{b.numerator} / {b.denominator} ({b.machine}, {b.version}) = {b.described}" for b in bars)
        + ".",
        4.6,
    )
    left, right = chart.figure.subplots(1, 2, width_ratios=[0.62, 0.38])
    for ax in (left, right):
        _style(ax)
    ticks, labels = [], []
    for side, offset in (("numerator", -0.2), ("denominator", 0.2)):
        xs = [i + offset for i in range(len(bars))]
        values = [getattr(b, f"{side}_value") for b in bars]
        drawn = left.bar(xs, [v / scale.factor for v in values], width=0.38, color=_color(side == "denominator"))
        names = [getattr(b, side) for b in bars]
        tips = [
            f"{name} on {b.machine}, version {b.version}\n{_pair_metric_title(b)}: {format_value(v, unit)}\n"
            f"{b.numerator} / {b.denominator} = {b.described}"
            for name, v, b in zip(names, values, bars)
        ]
        chart.add(side, drawn, tips)
        where = [f"\n{b.machine}, {b.version}" if len(places) > 1 else "" for b in bars]
        ticks += xs
        labels += [f"{n}{w}" for n, w in zip(names, where)]
    left.set_xticks(ticks, labels, rotation=20, ha="right", fontsize=8)
    left.set_title(_pair_metric_title(bars[0]), fontsize=10)
    left.set_ylabel(scale.label)
    left.yaxis.set_major_formatter(_ticks(scale))
    ratios = [b.ratio for b in bars]
    xs = list(range(len(bars)))
    right.errorbar(
        xs,
        ratios,
        yerr=[[_error_bar(b)[1] for b in bars], [_error_bar(b)[0] for b in bars]],
        fmt="none",
        ecolor=_color(0),
        capsize=4,
    )
    drawn = right.scatter(xs, ratios, s=40, color=_color(0), zorder=3)
    chart.add(
        "ratio",
        drawn,
        [f"{b.numerator} / {b.denominator} on {b.machine}, version {b.version}: {b.described}" for b in bars],
    )
    for x, r in zip(xs, ratios):
        right.annotate(f"×{r:.2f}", (x, r), xytext=(8, 0), textcoords="offset points", va="center", fontsize=9)  # noqa: RUF001 (the displayed ratio marker)
    right.axhline(1.0, color="#888", linestyle=":", linewidth=1)
    right.set_xlim(-0.6, len(bars) - 0.2)
    right.set_xticks(
        xs,
        [
            f"{b.numerator} /\n{b.denominator}" + (f"\n{b.machine}, {b.version}" if len(places) > 1 else "")
            for b in bars
        ],
        fontsize=8,
    )
    right.set_title("ratio, numerator / denominator", fontsize=10)
    return chart


def _pair_metric_title(bar: PairBar) -> str:
    assert bar.metric is not None  # PairChart.bars are the pairs with a ratio, hence a metric
    return metric_title(bar.metric)


def _error_bar(bar: PairBar) -> tuple[float, float]:
    """How far the bar's 95% interval reaches above and below its ratio; none without an interval."""
    if bar.interval is None or bar.ratio is None:  # a bar with an interval has a ratio
        return 0, 0
    return bar.interval[1] - bar.ratio, bar.ratio - bar.interval[0]


# --------------------------------------------------------------------------------------------
# Expert-count sweep and recompute modes
# --------------------------------------------------------------------------------------------


_PANELS = (("throughput", "throughput_metric"), ("memory", "memory_metric"))
_MODE_TEXT = {"execute": "Runs of scenarios", "plan": "Plans of layouts", "proxy": "Proxies of layouts"}


def _panels(groups: list[VariationGroup]) -> list[tuple[str, str, str, AxisScale]]:
    """(title, attribute, unit, axis) of each metric panel that some group has."""
    found = []
    for title, attr in _PANELS:
        drawn = [g for g in groups if getattr(g, attr)]
        if drawn:
            unit = drawn[0].members[0].metrics[getattr(drawn[0], attr)]["unit"]
            scale = axis_scale(unit, [v.metrics[getattr(g, attr)]["median"] for g in drawn for v in g.members])
            found.append((title, attr, unit, scale))
    return found


def sweep_chart(groups: list[VariationGroup]) -> Chart:
    """Throughput and memory against the number of experts on one machine, a line per group of scenarios
    (each of one version: the newest that has the group)."""
    versions = {g.version for g in groups}
    machine, mode = groups[0].machine, groups[0].mode
    plural = {"execute": "runs", "plan": "plans", "proxy": "proxies"}.get(mode, mode)
    only = f", version {next(iter(versions))}" if len(versions) == 1 else ""
    chart = _chart(
        "sweep",
        f"expert_sweep--{machine}--{mode}",
        f"Expert-count sweep ({plural} on {machine}{only}): the same active size, more experts",
        f"{_MODE_TEXT.get(mode, mode)} identical except for the number of experts (top-k and the expert size stay, "
        "so the active parameters per token do).",
        4.4 + 0.2 * len(groups),
    )
    panels = _panels(groups)
    counts = sorted({v.value for g in groups for v in g.members})
    names = [g.label + (f" ({g.version})" if len(versions) > 1 else "") for g in groups]
    handles: dict[str, Any] = {}
    for ax, (title, attr, unit, scale) in zip(chart.figure.subplots(1, len(panels), squeeze=False)[0], panels):
        _style(ax, "both")
        for i, group in enumerate(groups):
            metric = getattr(group, attr)
            if not metric:
                continue
            medians = [float(v.metrics[metric]["median"]) for v in group.members]
            (line,) = ax.plot(
                [v.value for v in group.members], [m / scale.factor for m in medians], "o-", color=_color(i)
            )
            tips = [
                f"{v.scenario} on {group.machine}, version {group.version}\n{v.value} experts: "
                f"{metric_title(metric)} {format_value(m, unit)}"
                for v, m in zip(group.members, medians)
            ]
            chart.add(f"{names[i]}: {title}", line, tips)
            handles.setdefault(names[i], line)
        metric = next(getattr(g, attr) for g in groups if getattr(g, attr))
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(counts))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xlabel("experts")
        ax.set_ylabel(f"{metric_title(metric)} ({scale.label})")
        ax.yaxis.set_major_formatter(_ticks(scale))
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
    _legend(chart, list(handles.values()), list(handles))
    return chart


def recompute_chart(groups: list[VariationGroup]) -> Chart:
    """Throughput and memory of each activation-recompute mode: a row per scenario, a bar per mode,
    one panel per metric under the other (the scenario names need the width)."""
    modes = [str(m) for m in sorted({v.value for g in groups for v in g.members}, key=variation_order)]
    places = {(g.machine, g.version) for g in groups}
    labels = [g.members[0].scenario + (f" ({g.machine}, {g.version})" if len(places) > 1 else "") for g in groups]
    where = "" if len(places) > 1 else " ({}, {})".format(*next(iter(places)))
    panels = _panels(groups)
    row_in = len(modes) * 0.16 + 0.12
    chart = _chart(
        "recompute",
        "recompute",
        f"Activation recompute: what each mode costs and saves{where}",
        "Scenarios identical except their recompute section (mode none when absent).",
        1.4 + len(panels) * (0.9 + row_in * len(groups)),
    )
    height = 0.8 / len(modes)
    handles: list[Any] = []
    for ax, (title, attr, unit, scale) in zip(chart.figure.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        _style(ax, "x")
        for i, mode in enumerate(modes):
            ys, xs, tips = [], [], []
            for row, group in enumerate(groups):
                metric = getattr(group, attr)
                for v in group.members:
                    if metric and str(v.value) == mode:
                        value = float(v.metrics[metric]["median"])
                        ys.append(row - 0.4 + height * (i + 0.5))
                        xs.append(value / scale.factor)
                        tips.append(
                            f"{v.scenario} on {group.machine}, version {group.version}\n"
                            f"recompute {mode}: {metric_title(metric)} {format_value(value, unit)}"
                        )
            drawn = ax.barh(ys, xs, height=height * 0.9, color=_color(i))
            chart.add(f"recompute {mode}: {title}", drawn, tips)
            if len(handles) < len(modes):
                handles.append(drawn)
        metric = next(getattr(g, attr) for g in groups if getattr(g, attr))
        ax.set_yticks(range(len(groups)), labels, fontsize=9)
        ax.set_ylim(len(groups) - 0.5, -0.5)
        ax.set_xlabel(f"{metric_title(metric)} ({scale.label})")
        ax.xaxis.set_major_formatter(_ticks(scale))
        ax.set_title(title, fontsize=10)
    _legend(chart, handles, [f"recompute {m}" for m in modes])
    return chart


# --------------------------------------------------------------------------------------------
# Plan memory and projection breakdowns
# --------------------------------------------------------------------------------------------


def plan_memory_chart(machine: str, stacks: list[MemoryStack]) -> Chart:
    """Each plan's memory per rank as a horizontal stacked bar, a row per plan, the GPU's memory marked
    across each row and the verdict written after it."""
    labels = list(dict.fromkeys(label for s in stacks for label, _ in s.segments))
    versions = {s.version for s in stacks}
    rows = [s.scenario + (f" ({s.version})" if len(versions) > 1 else "") for s in stacks]
    chart = _chart(
        "plan-memory",
        f"plan_memory--{machine}",
        f"Plan memory per rank (most loaded rank) against the GPU's memory: plans on {machine}",
        "The plan's memory of the most loaded rank, part by part as the plan adds it up (the larger of the "
        "backward's transient memory and the optimizer step's), against the cluster's GPU memory.",
        1.6 + 0.34 * len(stacks),
    )
    ax = chart.figure.subplots()
    _style(ax, "x")
    ys = list(range(len(stacks)))
    left = [0.0] * len(stacks)
    handles: list[Any] = []
    for i, label in enumerate(labels):
        values = [dict(s.segments).get(label, 0.0) for s in stacks]
        drawn = ax.barh(ys, [v / GIB for v in values], left=left, height=0.7, color=_color(i))
        tips = [
            f"{s.scenario} (plan, version {s.version}, on {machine})\n{label}: {format_gib(v)}, "
            f"{format_percent(v / s.total, 1)} of {format_gib(s.total)}"
            for s, v in zip(stacks, values)
        ]
        chart.add(label, drawn, tips)
        handles.append(drawn)
        left = [a + v / GIB for a, v in zip(left, values)]
    capacity = [_capacity(s) / GIB for s in stacks]
    (line,) = ax.plot(
        [x for c in capacity for x in (c, c, math.nan)],
        [y for row in ys for y in (row - 0.45, row + 0.45, math.nan)],
        color="black",
        linewidth=3,
    )
    chart.add(
        "GPU memory",
        line,
        [f"{s.scenario} (version {s.version}, on {machine}): GPU memory {format_gib(_capacity(s))}" for s in stacks],
    )
    handles.append(line)
    for row, s in zip(ys, stacks):
        fits = "fits" if s.total <= _capacity(s) else "does not fit"
        ax.annotate(
            f"{format_gib(s.total, decimals=1)}: {format_percent(s.total / _capacity(s), 0)} of "
            f"{format_gib(_capacity(s), decimals=1)} ({fits})",
            (max(s.total, _capacity(s)) / GIB, row),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    top = max(max(s.total, _capacity(s)) for s in stacks) / GIB
    ax.set_xlim(0, top * 1.6)  # room on the right of the longest bar for its verdict
    ax.set_yticks(ys, rows, fontsize=9)
    ax.set_ylim(len(stacks) - 0.5, -0.5)
    ax.set_xlabel("memory per GPU (GiB)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    _legend(chart, handles, [*labels, "GPU memory"])
    return chart


def _capacity(stack: MemoryStack) -> float:
    assert stack.capacity is not None  # plan_memory keeps only the plans with a cluster
    return stack.capacity


def projection_chart(stacks: list[ProjectionStack]) -> Chart:
    """Horizontal bars of each projected step, split into its parts as shares of the step."""
    rows = [f"{s.scenario} ({s.version})\n{s.target}" for s in stacks]
    labels = list(dict.fromkeys(label for s in stacks for label, _ in s.segments))
    chart = _chart(
        "projection",
        "projection",
        "Projected step, part by part",
        "Each proxy's projected step split into its parts (they add up to the step): on the scenario's cluster "
        "with the measuring machine's compute, and op by op on each device profile it was projected on.",
        1.8 + 0.55 * len(stacks),
    )
    ax = chart.figure.subplots()
    _style(ax, "x")
    ys = list(range(len(stacks)))
    left = [0.0] * len(stacks)
    handles: list[Any] = []
    for i, label in enumerate(labels):
        seconds = [dict(s.segments).get(label, 0.0) for s in stacks]
        shares = [t / s.step_s * 100 if s.step_s else 0.0 for s, t in zip(stacks, seconds)]
        drawn = ax.barh(ys, shares, left=left, height=0.7, color=_color(i))
        tips = [
            f"{s.scenario} on {s.target} (measured on {s.machine}, version {s.version})\n{label}: "
            f"{format_value(t, 's')} per step, {share:.1f}% of {format_value(s.step_s, 's')}"
            for s, t, share in zip(stacks, seconds, shares)
        ]
        chart.add(label, drawn, tips)
        handles.append(drawn)
        left = [a + b for a, b in zip(left, shares)]
    for row, s in zip(ys, stacks):
        speed = (
            f", {format_value(s.tokens_per_s_per_gpu, 'tokens/s')} per GPU"
            if s.tokens_per_s_per_gpu is not None and math.isfinite(s.tokens_per_s_per_gpu)
            else ""
        )
        ax.text(101, row, f"step {format_value(s.step_s, 's')}{speed}", va="center", fontsize=9)
    ax.set_xlim(0, 150)  # the axis ends at 100%; the rest is room for each bar's step time
    ax.set_xticks(range(0, 101, 20), [f"{t}%" for t in range(0, 101, 20)])
    ax.spines["bottom"].set_bounds(0, 100)
    ax.set_yticks(ys, rows, fontsize=9)
    ax.set_ylim(len(stacks) - 0.5, -0.5)
    ax.set_xlabel("share of the projected step (%)")
    _legend(chart, handles, labels)
    return chart
