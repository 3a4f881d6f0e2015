"""Plot result documents: trends across engine versions, a summary, an expert-count sweep, an index page.
More: docs/report.md.
"""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, NullLocator

from bench.metrics import HEADLINE_METRICS
from bench.report.ordering import sort_versions, version_sort_key
from bench.report.plot_index import comparison_rows, write_index
from bench.results import ResultDocument, ResultFileError, age_key, load_results

__all__ = [
    "HEADLINE_METRICS",
    "THROUGHPUT_METRIC",
    "headline_metric",
    "plot_results",
    "sweep_groups",
]

THROUGHPUT_METRIC = "tokens_per_s_per_gpu"
ACTIVE_PARAMS_METRIC = "active_params"

SUMMARY_NAME = "summary.png"
SWEEP_NAME = "expert_sweep.png"

_DPI = 100


# --------------------------------------------------------------------------------------------
# Selection helpers
# --------------------------------------------------------------------------------------------


def _latest_ok(docs: list[ResultDocument]) -> dict[tuple[str, str, str], ResultDocument]:
    """(version, machine, scenario) -> latest ok document."""
    chosen: dict[tuple[str, str, str], ResultDocument] = {}
    for doc in sorted((d for d in docs if d.status == "ok"), key=age_key):
        chosen[(doc.version, doc.machine, doc.name)] = doc
    return chosen


def headline_metric(metric_sets: Iterable[dict[str, dict[str, Any]]]) -> str | None:
    """The headline metric among the given metrics dicts (one scenario across versions)."""
    metric_sets = list(metric_sets)
    present = set().union(*(m.keys() for m in metric_sets)) if metric_sets else set()
    for name in HEADLINE_METRICS:
        if name in present:
            return name
    for metrics in metric_sets:
        for name, entry in metrics.items():
            if entry.get("better") is not None:
                return name
    return None


def _quartiles(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return samples[0], samples[0]
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q3


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "x"


def _fmt_count(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Per-(machine, scenario) trend figures
# --------------------------------------------------------------------------------------------


def _plot_scenario(
    machine: str, scenario: str, versions: list[str], by_version: dict[str, ResultDocument], path: Path
) -> Path | None:
    """One subplot per metric with samples; None (nothing written) when no ok doc has metrics."""
    metric_names: list[str] = []
    for v in versions:
        doc = by_version.get(v)
        if doc is None:
            continue
        for name, metric in doc.metrics.items():
            if metric.get("samples") and name not in metric_names:
                metric_names.append(name)
    if not metric_names:
        return None

    ncols = min(3, len(metric_names))
    nrows = math.ceil(len(metric_names) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False)
    positions = {v: i for i, v in enumerate(versions)}
    for idx, name in enumerate(metric_names):
        ax = axes[idx // ncols][idx % ncols]
        xs, medians, q1s, q3s = [], [], [], []
        bar_xs, bar_medians, lows, highs = [], [], [], []
        unit, better = "", None
        for v in versions:
            doc = by_version.get(v)
            entry = doc.metrics.get(name) if doc is not None else None
            if not entry or not entry.get("samples"):
                continue
            samples = [float(s) for s in entry["samples"]]
            x = positions[v]
            unit, better = entry.get("unit", unit), entry.get("better", better)
            xs.append(x)
            medians.append(float(entry["median"]))
            if entry.get("spread") is not None:
                bar_xs.append(x)
                bar_medians.append(medians[-1])
                lows.append(float(entry["spread"]["min"]))
                highs.append(float(entry["spread"]["max"]))
                q1, q3 = _quartiles(samples)
            else:  # one sample: a value without a spread, nothing to draw around it
                q1 = q3 = math.nan
            q1s.append(q1)
            q3s.append(q3)
            # Samples as faint dots just right of the bar, so the error bar does not hide them.
            ax.scatter([x + 0.07] * len(samples), samples, s=12, alpha=0.45, color="tab:gray", linewidths=0, zorder=4)
        if len(bar_xs) >= 2:  # NaN quartiles (points without a spread) leave gaps in the band
            ax.fill_between(xs, q1s, q3s, color="tab:blue", alpha=0.15, linewidth=0, label="IQR")
        ax.plot(xs, medians, "o-", color="tab:blue", markersize=4, zorder=3, label="median")
        if bar_xs:
            yerr = [
                [max(0.0, m - lo) for m, lo in zip(bar_medians, lows)],
                [max(0.0, hi - m) for m, hi in zip(bar_medians, highs)],
            ]
            ax.errorbar(
                bar_xs, bar_medians, yerr=yerr, fmt="none", ecolor="tab:blue", capsize=3, zorder=3, label="min..max"
            )
        arrow = {"higher": " ↑ better", "lower": " ↓ better"}.get(better or "", "")
        ax.set_title(f"{name}{arrow}", fontsize=10)
        ax.set_ylabel(unit or name, fontsize=9)
        ax.set_xticks(range(len(versions)))
        ax.set_xticklabels(versions, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.5, len(versions) - 0.5)
        ax.grid(True, alpha=0.3)
        ax.tick_params(axis="y", labelsize=8)
    for idx in range(len(metric_names), nrows * ncols):
        axes[idx // ncols][idx % ncols].set_visible(False)
    fig.suptitle(f"{scenario} — {machine}", fontsize=12)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# Summary figure
# --------------------------------------------------------------------------------------------


def _plot_summary(versions: list[str], groups: dict[tuple[str, str], dict[str, ResultDocument]], path: Path) -> Path:
    machines = {m for m, _ in groups}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(versions) + 4), 4.5))
    positions = {v: i for i, v in enumerate(versions)}
    lines = 0
    for (machine, scenario), by_version in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        name = headline_metric(by_version[v].metrics for v in versions if v in by_version)
        if name is None:
            continue
        xs, ys = [], []
        base = None
        for v in versions:
            entry = by_version[v].metrics.get(name) if v in by_version else None
            if not entry:
                continue
            value = float(entry["median"])
            if base is None:
                if value == 0:
                    continue
                base = value
            xs.append(positions[v])
            ys.append(value / base)
        if not xs:
            continue
        better = next(
            (
                by_version[v].metrics[name].get("better")
                for v in versions
                if v in by_version and name in by_version[v].metrics
            ),
            None,
        )
        arrow = {"higher": ", ↑ better", "lower": ", ↓ better"}.get(better or "", "")
        where = scenario if len(machines) == 1 else f"{scenario} @ {machine}"
        label = f"{where} ({name}{arrow})"
        ax.plot(xs, ys, "o-", markersize=4, label=label)
        lines += 1
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(versions)))
    ax.set_xticklabels(versions, rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.5, max(len(versions) - 0.5, 0.5))
    ax.set_ylabel("headline metric / first version")
    ax.set_xlabel("engine version")
    ax.set_title("Headline metric across versions (ratio to each scenario's first version)")
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if lines <= 20 else 2)
    else:
        ax.text(0.5, 0.5, "no ok results with a headline metric", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# Expert-count sweep
# --------------------------------------------------------------------------------------------


def _num_experts(spec: dict[str, Any]) -> int | None:
    try:
        n = spec["model"]["moe"]["num_experts"]
    except (KeyError, TypeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _sweep_key(spec: dict[str, Any]) -> str:
    """The spec with the expert count and the labels (name, description) removed, as canonical JSON."""
    rest = copy.deepcopy(spec)
    rest.pop("name", None)
    rest.pop("description", None)
    rest["model"]["moe"].pop("num_experts", None)
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), default=str)


def sweep_groups(docs: Iterable[ResultDocument]) -> list[dict[str, Any]]:
    """Expert-count sweeps among ok documents of each machine's newest version.

    Documents are grouped by machine and by their scenario spec without ``model.moe.num_experts``
    (and without the ``name``/``description`` labels); only documents carrying the throughput
    metric count. A group is returned only with >= 2 distinct expert counts, as a dict with
    ``machine``, ``version``, ``spec`` (a member's spec), ``top_k`` and ``points``: a list sorted by
    expert count of ``{"num_experts", "throughput", "active_params" (or None), "scenario"}``.
    """
    latest = _latest_ok(list(docs))
    newest: dict[str, str] = {}
    for version, machine, _ in latest:
        if machine not in newest or version_sort_key(version) > version_sort_key(newest[machine]):
            newest[machine] = version
    grouped: dict[tuple[str, str], dict[int, ResultDocument]] = defaultdict(dict)
    for (version, machine, _), doc in sorted(latest.items(), key=lambda kv: age_key(kv[1])):
        if version != newest[machine] or THROUGHPUT_METRIC not in doc.metrics:
            continue
        spec = doc.data.get("scenario", {}).get("spec")
        if not isinstance(spec, dict):
            continue
        n = _num_experts(spec)
        if n is None or n < 1:
            continue
        grouped[(machine, _sweep_key(spec))][n] = doc
    result = []
    for (machine, _), members in sorted(grouped.items()):
        if len(members) < 2:
            continue
        points = []
        for n in sorted(members):
            doc = members[n]
            active = doc.metrics.get(ACTIVE_PARAMS_METRIC)
            points.append(
                {
                    "num_experts": n,
                    "throughput": float(doc.metrics[THROUGHPUT_METRIC]["median"]),
                    "unit": doc.metrics[THROUGHPUT_METRIC].get("unit", ""),
                    "active_params": float(active["median"]) if active else None,
                    "scenario": doc.name,
                }
            )
        spec = members[min(members)].data["scenario"]["spec"]
        result.append(
            {
                "machine": machine,
                "version": newest[machine],
                "spec": spec,
                "top_k": spec["model"]["moe"].get("top_k"),
                "points": points,
            }
        )
    return result


def _plot_sweep(groups: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8.0, 5.0))
    all_n: set[int] = set()
    units = {p["unit"] for g in groups for p in g["points"] if p["unit"]}
    for group in groups:
        xs = [p["num_experts"] for p in group["points"]]
        ys = [p["throughput"] for p in group["points"]]
        all_n.update(xs)
        names = ", ".join(p["scenario"] for p in group["points"])
        if len(names) > 60:
            names = names[:57] + "..."
        label = f"{group['machine']} v{group['version']}: top_k={group['top_k']} [{names}]"
        (line,) = ax.plot(xs, ys, "o-", label=label)
        for p in group["points"]:
            if p["active_params"] is not None:
                ax.annotate(
                    f"{_fmt_count(p['active_params'])} active",
                    (p["num_experts"], p["throughput"]),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=7,
                    color=line.get_color(),
                )
    ax.set_xscale("log", base=2)
    ticks = sorted(all_n)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in ticks])
    ax.set_xlabel("number of experts (log2)")
    ax.set_ylabel(f"{THROUGHPUT_METRIC} median" + (f" [{', '.join(sorted(units))}]" if units else ""))
    ax.set_title("Throughput vs number of experts (newest version)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def plot_results(
    results_dir: Path, out_dir: Path, on_bad_file: Callable[[ResultFileError], None] | None = None
) -> list[Path]:
    """Write the figures and ``index.html`` for every result under ``results_dir`` into ``out_dir``.

    Returns the files written: per-(machine, scenario) PNGs, ``summary.png``, ``expert_sweep.png``
    (only when an expert-count sweep exists) and ``index.html`` (last). A file that cannot be read
    as a result document is skipped, passed to ``on_bad_file`` (to warn) and listed in the index.
    """
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    skipped: list[ResultFileError] = []

    def skip(err: ResultFileError) -> None:
        skipped.append(err)
        if on_bad_file is not None:
            on_bad_file(err)

    docs = load_results(results_dir, on_bad_file=skip)
    out_dir.mkdir(parents=True, exist_ok=True)

    latest = _latest_ok(docs)
    all_versions = sort_versions(d.version for d in docs)
    # Every (machine, scenario) that has documents, and the versions it was run with (ok or not).
    group_versions: dict[tuple[str, str], set[str]] = defaultdict(set)
    for d in docs:
        group_versions[(d.machine, d.name)].add(d.version)
    groups: dict[tuple[str, str], dict[str, ResultDocument]] = defaultdict(dict)
    for (version, machine, scenario), doc in latest.items():
        groups[(machine, scenario)][version] = doc

    written: list[Path] = []
    figures: list[tuple[Path, str]] = []
    used_names = {SUMMARY_NAME, SWEEP_NAME}
    with plt.rc_context({"figure.max_open_warning": 0}):
        for machine, scenario in sorted(groups):
            base = f"{_safe_name(machine)}--{_safe_name(scenario)}"
            name, i = f"{base}.png", 2
            while name in used_names:
                name, i = f"{base}-{i}.png", i + 1
            versions = sort_versions(group_versions[(machine, scenario)])
            path = _plot_scenario(machine, scenario, versions, groups[(machine, scenario)], out_dir / name)
            if path is not None:
                used_names.add(name)
                written.append(path)
                figures.append(
                    (
                        path,
                        f"{scenario} on {machine}: metrics across engine versions "
                        "(median, min..max bars, IQR band, samples as dots; "
                        "single-sample metrics as plain points)",
                    )
                )

        ok_versions = sort_versions(v for v, _, _ in latest)
        summary = _plot_summary(ok_versions or all_versions, groups, out_dir / SUMMARY_NAME)
        written.append(summary)
        figures.insert(0, (summary, "Summary: each scenario's headline metric relative to its first version"))

        sweeps = sweep_groups(docs)
        if sweeps:
            sweep = _plot_sweep(sweeps, out_dir / SWEEP_NAME)
            written.append(sweep)
            figures.insert(
                1,
                (
                    sweep,
                    "Throughput (tokens/s per GPU, median) vs number of experts, newest version "
                    "per machine; scenarios identical except model.moe.num_experts",
                ),
            )

    written.append(write_index(out_dir, figures, docs, results_dir, skipped, comparison_rows(latest)))
    return written
