"""Plotly figures of the report: trends, the reference experiments, plan memory, projection breakdowns.

Each function turns what ``bench.report.trends`` or ``bench.report.experiments`` found into one
``plotly.graph_objects.Figure``. Axes carry units people read (``bench.units.axis_scale``);
every hover label names the machine and the version of the number it shows.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bench.metrics import title as metric_title
from bench.report.experiments import MemoryStack, PairBar, PairChart, ProjectionStack, VariationGroup, variation_order
from bench.report.trends import Trend
from bench.units import GIB, axis_scale, format_gib, format_percent, format_value

HEIGHT = 400
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D", "#BAB0AC", "#EECA3B")


def _layout(fig: go.Figure, title: str, height: int = HEIGHT) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        height=height,
        template="plotly_white",
        margin={"l": 70, "r": 30, "t": 70, "b": 60},
        hoverlabel={"align": "left"},
        legend={"orientation": "h", "y": -0.2, "traceorder": "normal"},
    )
    return fig


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


# --------------------------------------------------------------------------------------------
# Trends
# --------------------------------------------------------------------------------------------


def trend_figure(trend: Trend, releases: tuple[str, ...]) -> go.Figure:
    """A panel per headline metric: median per version, the IQR as a band, min..max as bars; releases
    marked with a dotted line and a diamond."""
    versions = list(trend.versions)
    position = {v: i for i, v in enumerate(versions)}
    fig = make_subplots(
        rows=1,
        cols=len(trend.series),
        horizontal_spacing=0.12,
        subplot_titles=[f"{metric_title(s.metric)} ({_direction(s.better)})" for s in trend.series],
    )
    for col, series in enumerate(trend.series, start=1):
        values = [p.median for p in series.points] + [p.high for p in series.points if p.high is not None]
        scale = axis_scale(series.unit, values)
        xs = [position[p.version] for p in series.points]
        # (x, q1, q3) of the points with a spread (more than one sample: both quartiles are set).
        spread = [(position[p.version], p.q1, p.q3) for p in series.points if p.q1 is not None and p.q3 is not None]
        if len(spread) >= 2:
            band_x = [x for x, _, _ in spread]
            fig.add_trace(
                go.Scatter(
                    x=band_x,
                    y=[q3 / scale.factor for _, _, q3 in spread],
                    mode="lines",
                    line={"width": 0},
                    hoverinfo="skip",
                    showlegend=False,
                ),
                row=1,
                col=col,
            )
            fig.add_trace(
                go.Scatter(
                    x=band_x,
                    y=[q1 / scale.factor for _, q1, _ in spread],
                    mode="lines",
                    line={"width": 0},
                    fill="tonexty",
                    fillcolor="rgba(76,120,168,0.2)",
                    name="interquartile range",
                    hoverinfo="skip",
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        hover = []
        for p in series.points:
            lines = [
                f"<b>{trend.scenario}</b> on {trend.machine}, version {p.version}",
                f"median {format_value(p.median, series.unit)} over {p.samples} sample{'s' * (p.samples != 1)}",
            ]
            if p.q1 is not None:
                lines.append(
                    f"IQR {format_value(p.q1, series.unit)} - {format_value(p.q3, series.unit)}, "
                    f"min {format_value(p.low, series.unit)}, max {format_value(p.high, series.unit)}"
                )
            else:
                lines.append("one sample: no spread")
            hover.append("<br>".join(lines))
        error = {
            "type": "data",
            "symmetric": False,
            "color": "#4C78A8",
            "thickness": 1,
            "array": [(p.high - p.median) / scale.factor if p.high is not None else 0 for p in series.points],
            "arrayminus": [(p.median - p.low) / scale.factor if p.low is not None else 0 for p in series.points],
        }
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[p.median / scale.factor for p in series.points],
                mode="lines+markers",
                name="median",
                line={"color": "#4C78A8"},
                error_y=error,
                hovertext=hover,
                hoverinfo="text",
                showlegend=col == 1,
                marker={
                    "size": [11 if p.version in releases else 7 for p in series.points],
                    "symbol": ["diamond" if p.version in releases else "circle" for p in series.points],
                },
            ),
            row=1,
            col=col,
        )
        fig.update_yaxes(title_text=scale.label, tickformat=scale.tickformat, row=1, col=col)
        fig.update_xaxes(
            tickvals=list(range(len(versions))), ticktext=versions, range=[-0.5, len(versions) - 0.5], row=1, col=col
        )
        for version in versions:
            if version in releases:
                fig.add_vline(x=position[version], line={"dash": "dot", "color": "#888", "width": 1}, row=1, col=col)
    released = [v for v in versions if v in releases]
    note = f"; releases ({', '.join(released)}) marked ◆" if released else ""
    return _layout(fig, f"{trend.scenario} on {trend.machine}: across versions{note}")


def _direction(better: str | None) -> str:
    return {"higher": "higher is better", "lower": "lower is better"}.get(better or "", "not gated")


# --------------------------------------------------------------------------------------------
# Pair comparisons
# --------------------------------------------------------------------------------------------


def pair_figure(chart: PairChart) -> go.Figure:
    """Left, both scenarios of each pair as bars, grouped by pair; right, each pair's ratio with its 95%
    interval as error bars against a line at 1 (an interval that crosses it is within noise)."""
    comparison = chart.comparison
    unit = next((b.unit for b in chart.bars if b.unit), "")
    scale = axis_scale(unit, [v for b in chart.bars for v in (b.numerator_value, b.denominator_value) if v is not None])
    groups, used = [], set()
    for i, bar in enumerate(chart.bars):
        group = f"{bar.machine}, {bar.version}"
        if any((group, name) in used for name in (bar.numerator, bar.denominator)):
            group = f"{group} #{i + 1}"
        used |= {(group, bar.numerator), (group, bar.denominator)}
        groups.append(group)
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.1,
        subplot_titles=[_pair_metric_title(chart.bars[0]), "ratio, numerator / denominator"],
    )
    for side, color in (("numerator", _color(0)), ("denominator", _color(1))):
        names = [getattr(b, side) for b in chart.bars]
        values = [getattr(b, f"{side}_value") for b in chart.bars]
        hover = [
            f"<b>{name}</b> on {b.machine}, version {b.version}<br>{_pair_metric_title(b)}: "
            f"{format_value(v, unit)}<br>{b.numerator} / {b.denominator} = {b.described}"
            for name, v, b in zip(names, values, chart.bars)
        ]
        fig.add_trace(
            go.Bar(
                x=[groups, names],
                y=[v / scale.factor for v in values],
                name=side,
                marker_color=color,
                hovertext=hover,
                hoverinfo="text",
                showlegend=False,
            ),
            row=1,
            col=1,
        )
    labels = [f"{b.numerator} / {b.denominator}<br>{g}" for b, g in zip(chart.bars, groups)]
    ratios = [b.ratio for b in chart.bars]
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=ratios,
            mode="markers+text",
            marker={"color": _color(0), "size": 9},
            text=[f"×{r:.2f}" for r in ratios],  # noqa: RUF001 (the multiplication sign is the displayed ratio marker)
            textposition="middle right",
            showlegend=False,
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [_error_bar(b)[0] for b in chart.bars],
                "arrayminus": [_error_bar(b)[1] for b in chart.bars],
            },
            hovertext=[
                f"{b.numerator} / {b.denominator} on {b.machine}, version {b.version}: {b.described}"
                for b in chart.bars
            ],
            hoverinfo="text",
        ),
        row=1,
        col=2,
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888", row=1, col=2)
    fig.update_yaxes(title_text=scale.label, tickformat=scale.tickformat, row=1, col=1)
    fig.update_xaxes(tickfont={"size": 10}, row=1, col=2)
    title = f"{comparison.label}: measured ×ratio on each pair with its 95% interval; reference {comparison.reference}"  # noqa: RUF001 (the multiplication sign is meant for display)
    return _layout(fig, title, height=HEIGHT + 40)


def _pair_metric_title(bar: PairBar) -> str:
    """The metric title of a bar on a pair chart."""
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


ROW_PX = 22
"""Height of one legend row or one horizontal bar's row of text, pixels: 11-12 px text with air around it."""


def _legend_below(fig: go.Figure, names: list[str], height: int, plot_bottom_px: int = 70) -> int:
    """Put the legend under the plot, clear of the x axis's tick labels and title (``plot_bottom_px``
    below the plot area), one entry per row when the names would not fit one row; returns the figure's
    height grown by the legend's rows."""
    one_row = sum(len(n) * 7 + 40 for n in names) < 1100
    rows = 1 if one_row else len(names)
    bottom = plot_bottom_px + rows * ROW_PX + 10
    height += rows * ROW_PX
    plot_px = height - 80 - bottom
    fig.update_layout(
        height=height,
        margin={"b": bottom, "t": 80},
        legend={
            "orientation": "h" if one_row else "v",
            "yanchor": "top",
            "y": -plot_bottom_px / max(plot_px, 1),
            "x": 0,
            "traceorder": "normal",
        },
    )
    return height


def sweep_figure(groups: list[VariationGroup]) -> go.Figure:
    """Throughput and memory against the number of experts on one machine, a line per group of scenarios
    (each of one version: the newest that has the group)."""
    panels = [("throughput", "throughput_metric"), ("memory", "memory_metric")]
    panels = [(title, attr) for title, attr in panels if any(getattr(g, attr) for g in groups)]
    fig = make_subplots(rows=1, cols=len(panels), horizontal_spacing=0.12, subplot_titles=[t for t, _ in panels])
    counts = sorted({v.value for g in groups for v in g.members})
    versions = {g.version for g in groups}
    names = [g.label + (f" ({g.version})" if len(versions) > 1 else "") for g in groups]
    for col, (_, attr) in enumerate(panels, start=1):
        drawn = [g for g in groups if getattr(g, attr)]
        unit = drawn[0].members[0].metrics[getattr(drawn[0], attr)]["unit"]
        scale = axis_scale(unit, [v.metrics[getattr(g, attr)]["median"] for g in drawn for v in g.members])
        for i, group in enumerate(groups):
            name = getattr(group, attr)
            if not name:
                continue
            medians = [float(v.metrics[name]["median"]) for v in group.members]
            hover = [
                f"<b>{v.scenario}</b> on {group.machine}, version {group.version}<br>{v.value} experts: "
                f"{metric_title(name)} {format_value(m, unit)}"
                for v, m in zip(group.members, medians)
            ]
            fig.add_trace(
                go.Scatter(
                    x=[v.value for v in group.members],
                    y=[m / scale.factor for m in medians],
                    mode="lines+markers",
                    name=names[i],
                    line={"color": _color(i)},
                    hovertext=hover,
                    hoverinfo="text",
                    showlegend=col == 1,
                    legendgroup=str(i),
                ),
                row=1,
                col=col,
            )
        fig.update_yaxes(
            title_text=f"{metric_title(getattr(drawn[0], attr))} ({scale.label})",
            tickformat=scale.tickformat,
            rangemode="tozero",
            row=1,
            col=col,
        )
        fig.update_xaxes(
            type="log", tickvals=counts, ticktext=[str(c) for c in counts], title_text="experts", row=1, col=col
        )
    mode = {"execute": "runs", "plan": "plans", "proxy": "proxies"}.get(groups[0].mode, groups[0].mode)
    only = f", version {next(iter(versions))}" if len(versions) == 1 else ""
    _layout(fig, f"Expert-count sweep ({mode} on {groups[0].machine}{only}): the same active size, more experts")
    _legend_below(fig, names, HEIGHT)
    return fig


def recompute_figure(groups: list[VariationGroup]) -> go.Figure:
    """Throughput and memory of each activation-recompute mode: a row per scenario, a bar per mode,
    one panel per metric under the other (the scenario names need the width)."""
    panels = [
        (title, attr)
        for title, attr in (("throughput", "throughput_metric"), ("memory", "memory_metric"))
        if any(getattr(g, attr) for g in groups)
    ]
    modes = [str(m) for m in sorted({v.value for g in groups for v in g.members}, key=variation_order)]
    places = {(g.machine, g.version) for g in groups}
    labels = [g.members[0].scenario + (f" ({g.machine}, {g.version})" if len(places) > 1 else "") for g in groups]
    # Each panel holds a row of bars per scenario: as many bars as modes, ROW_PX / 2 apiece plus a gap.
    panel_px = len(groups) * (len(modes) * ROW_PX // 2 + 12) + 40
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        vertical_spacing=min(0.3, 90 / (panel_px * len(panels) + 90)),
        subplot_titles=[t for t, _ in panels],
    )
    for row, (_, attr) in enumerate(panels, start=1):
        drawn = [g for g in groups if getattr(g, attr)]
        unit = drawn[0].members[0].metrics[getattr(drawn[0], attr)]["unit"]
        scale = axis_scale(unit, [v.metrics[getattr(g, attr)]["median"] for g in drawn for v in g.members])
        for i, mode in enumerate(modes):
            ys: list[str] = []
            xs: list[float] = []
            hover: list[str] = []
            for group, label in zip(groups, labels):
                name = getattr(group, attr)
                for v in group.members:
                    if not name or str(v.value) != mode:
                        continue
                    value = float(v.metrics[name]["median"])
                    ys.append(label)
                    xs.append(value / scale.factor)
                    hover.append(
                        f"<b>{v.scenario}</b> on {group.machine}, version {group.version}<br>"
                        f"recompute {mode}: {metric_title(name)} {format_value(value, unit)}"
                    )
            fig.add_trace(
                go.Bar(
                    y=ys,
                    x=xs,
                    orientation="h",
                    name=f"recompute {mode}",
                    marker_color=_color(i),
                    hovertext=hover,
                    hoverinfo="text",
                    showlegend=row == 1,
                    legendgroup=mode,
                ),
                row=row,
                col=1,
            )
        fig.update_xaxes(
            title_text=f"{metric_title(getattr(drawn[0], attr))} ({scale.label})",
            tickformat=scale.tickformat,
            row=row,
            col=1,
        )
        fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(labels)), automargin=True, row=row, col=1)
    fig.update_layout(barmode="group")
    where = "" if len(places) > 1 else f" ({next(iter(places))[0]}, {next(iter(places))[1]})"
    _layout(fig, f"Activation recompute: what each mode costs and saves{where}")
    _legend_below(fig, [f"recompute {m}" for m in modes], 80 + panel_px * len(panels) + 90 * (len(panels) - 1) + 80)
    return fig


# --------------------------------------------------------------------------------------------
# Plan memory and projection breakdowns
# --------------------------------------------------------------------------------------------


def plan_memory_figure(machine: str, stacks: list[MemoryStack]) -> go.Figure:
    """Each plan's memory per rank as a horizontal stacked bar, a row per plan, the GPU's memory marked
    across each row and the verdict written after it."""
    fig = go.Figure()
    labels = list(dict.fromkeys(label for s in stacks for label, _ in s.segments))
    versions = {s.version for s in stacks}
    rows = [s.scenario + (f" ({s.version})" if len(versions) > 1 else "") for s in stacks]
    ys = list(range(len(stacks)))
    for i, label in enumerate(labels):
        values = [dict(s.segments).get(label, 0.0) for s in stacks]
        hover = [
            f"<b>{s.scenario}</b> (plan, version {s.version}, on {machine})<br>{label}: {format_gib(v)}, "
            f"{format_percent(v / s.total, 1)} of {format_gib(s.total)}"
            for s, v in zip(stacks, values)
        ]
        fig.add_trace(
            go.Bar(
                y=ys,
                x=[v / GIB for v in values],
                orientation="h",
                name=label,
                marker_color=_color(i),
                hovertext=hover,
                hoverinfo="text",
            )
        )
    line_x, line_y = [], []
    for y, s in zip(ys, stacks):
        line_x += [_capacity(s) / GIB, _capacity(s) / GIB, None]
        line_y += [y - 0.45, y + 0.45, None]
    fig.add_trace(
        go.Scatter(
            x=line_x,
            y=line_y,
            mode="lines",
            name="GPU memory",
            line={"color": "black", "width": 3},
            hoverinfo="skip",
        )
    )
    top = max(max(s.total, _capacity(s)) for s in stacks) / GIB
    for y, s in zip(ys, stacks):
        capacity = _capacity(s)
        fits = "fits" if s.total <= capacity else "does not fit"
        fig.add_annotation(
            x=max(s.total, capacity) / GIB,
            y=y,
            xanchor="left",
            xshift=6,
            showarrow=False,
            font={"size": 11},
            text=f"{format_gib(s.total, decimals=1)}: {format_percent(s.total / capacity, 0)} of {format_gib(capacity, decimals=1)} ({fits})",
        )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(tickvals=ys, ticktext=rows, autorange="reversed", automargin=True)
    # Room on the right of the longest bar for its verdict (about 230 px of text at 11 px).
    fig.update_xaxes(title_text="memory per GPU (GiB)", tickformat=",.0f", range=[0, top * 1.6])
    _layout(fig, f"Plan memory per rank (most loaded rank) against the GPU's memory: plans on {machine}")
    _legend_below(fig, [*labels, "GPU memory"], 120 + len(stacks) * ROW_PX + 60, plot_bottom_px=60)
    return fig


def _capacity(stack: MemoryStack) -> float:
    """The GPU memory a plan on the chart is drawn against."""
    assert stack.capacity is not None  # plan_memory keeps only the plans with a cluster
    return stack.capacity


def projection_figure(stacks: list[ProjectionStack]) -> go.Figure:
    """Horizontal bars of each projected step, split into its parts as shares of the step."""
    fig = go.Figure()
    rows = [f"{s.scenario} ({s.version})<br>{s.target}" for s in stacks]
    labels = list(dict.fromkeys(label for s in stacks for label, _ in s.segments))
    for i, label in enumerate(labels):
        seconds = [dict(s.segments).get(label, 0.0) for s in stacks]
        shares = [t / s.step_s * 100 if s.step_s else 0.0 for s, t in zip(stacks, seconds)]
        hover = [
            f"<b>{s.scenario}</b> on {s.target} (measured on {s.machine}, version {s.version})<br>{label}: "
            f"{format_value(t, 's')} per step, {share:.1f}% of {format_value(s.step_s, 's')}"
            for s, t, share in zip(stacks, seconds, shares)
        ]
        fig.add_trace(
            go.Bar(
                y=rows, x=shares, orientation="h", name=label, marker_color=_color(i), hovertext=hover, hoverinfo="text"
            )
        )
    for row, s in zip(rows, stacks):
        speed = (
            f", {format_value(s.tokens_per_s_per_gpu, 'tokens/s')} per GPU"
            if s.tokens_per_s_per_gpu is not None and math.isfinite(s.tokens_per_s_per_gpu)
            else ""
        )
        fig.add_annotation(
            y=row,
            x=100,
            xanchor="left",
            showarrow=False,
            font={"size": 11},
            text=f" step {format_value(s.step_s, 's')}{speed}",
        )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="share of the projected step (%)", range=[0, 100], ticksuffix="%")
    _layout(fig, "Projected step, part by part", height=max(HEIGHT, 160 + 70 * len(stacks)))
    fig.update_layout(margin={"r": 260})  # room for each bar's step time, written beside it
    return fig
