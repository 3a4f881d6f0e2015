"""Export result documents to the formats of continuous-benchmarking services.
More: docs/report.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from bench.gate.groups import Group, group_documents
from bench.results import ResultDocument
from bench.units import format_number

GITHUB_ACTION_BENCHMARK = "github-action-benchmark"
BENCHER = "bencher"
FORMATS = (GITHUB_ACTION_BENCHMARK, BENCHER)

BIGGER_TOOL = "customBiggerIsBetter"
SMALLER_TOOL = "customSmallerIsBetter"
GAB_FILE_SUFFIXES = {BIGGER_TOOL: "-bigger.json", SMALLER_TOOL: "-smaller.json"}
"""Tool name -> suffix of the file the CLI writes (``<out>-bigger.json``, ``<out>-smaller.json``)."""

BENCHER_SLUG_MAX = 64


def _ok_groups(docs: Iterable[ResultDocument]) -> list[Group]:
    return [g for _, g in sorted(group_documents(docs).items()) if g.status == "ok" and g.pooled]


def _benchmark_name(group: Group, include_machine: bool) -> str:
    return f"{group.machine}/{group.scenario}" if include_machine else group.scenario


def _extra(group: Group, samples: int) -> str:
    engine = group.version
    commit = group.newest.data["engine"].get("git_commit")
    if commit:
        engine += f" ({commit[:12]}{'-dirty' if group.newest.data['engine'].get('git_dirty') else ''})"
    runs = len(group.pooled)
    return f"machine: {group.machine}\nengine: {engine}\nsamples: {samples}" + (f" ({runs} runs)" if runs > 1 else "")


def export_github_action_benchmark(
    docs: Iterable[ResultDocument], include_machine: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """``{"customBiggerIsBetter": [...], "customSmallerIsBetter": [...]}``, entries sorted by name."""
    out: dict[str, list[dict[str, Any]]] = {BIGGER_TOOL: [], SMALLER_TOOL: []}
    seen: set[str] = set()
    for group in _ok_groups(docs):
        prefix = _benchmark_name(group, include_machine)
        for name, entry in sorted(group.metrics.items()):
            tool = {"higher": BIGGER_TOOL, "lower": SMALLER_TOOL}.get(entry["better"])
            if tool is None:
                continue
            full = f"{prefix}/{name}"
            if full in seen:
                raise ValueError(
                    f"duplicate benchmark name {full!r}: the documents span several machines; "
                    "use include_machine=True or export one machine at a time"
                )
            seen.add(full)
            item = {"name": full, "unit": entry["unit"], "value": entry["median"]}
            if entry["spread"] is not None:
                item["range"] = f"± {format_number(entry['spread']['iqr'] / 2)}"
            item["extra"] = _extra(group, len(entry["samples"]))
            out[tool].append(item)
    return out


def measure_slug(metric_name: str) -> str:
    """Bencher measure slug: lower-case kebab case, at most 64 characters."""
    slug = re.sub(r"[^a-z0-9]+", "-", metric_name.lower()).strip("-")
    if not slug:
        raise ValueError(f"metric name {metric_name!r} gives an empty Bencher measure slug")
    if len(slug) > BENCHER_SLUG_MAX:
        raise ValueError(f"Bencher measure slug {slug!r} is longer than {BENCHER_SLUG_MAX} characters")
    return slug


def export_bencher(
    docs: Iterable[ResultDocument], include_machine: bool = False
) -> dict[str, dict[str, dict[str, float]]]:
    """Bencher Metric Format: ``{scenario: {measure_slug: {value, lower_value, upper_value}}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for group in _ok_groups(docs):
        bench_name = _benchmark_name(group, include_machine)
        if bench_name in out:
            raise ValueError(
                f"duplicate benchmark name {bench_name!r}: the documents span several machines; "
                "use include_machine=True or export one machine at a time"
            )
        measures: dict[str, dict[str, float]] = {}
        for name, entry in sorted(group.metrics.items()):
            slug = measure_slug(name)
            if slug in measures:
                raise ValueError(f"{bench_name}: metrics collide on Bencher measure slug {slug!r}")
            measures[slug] = {"value": entry["median"]}
            if entry["spread"] is not None:
                measures[slug].update(lower_value=entry["spread"]["min"], upper_value=entry["spread"]["max"])
        if measures:
            out[bench_name] = measures
    return out


def export_data(docs: Iterable[ResultDocument], fmt: str, include_machine: bool = False) -> Any:
    """The export as Python data (for GAB the tool -> list dict)."""
    if fmt == GITHUB_ACTION_BENCHMARK:
        return export_github_action_benchmark(docs, include_machine)
    if fmt == BENCHER:
        return export_bencher(docs, include_machine)
    raise ValueError(f"unknown export format {fmt!r}; expected one of: {', '.join(FORMATS)}")


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def export(docs: Iterable[ResultDocument], fmt: str, include_machine: bool = False) -> str:
    """The export as JSON text. For ``github-action-benchmark`` this is the tool -> list object;
    use ``export_files`` for the two files the action reads."""
    return _dumps(export_data(docs, fmt, include_machine))


def export_files(docs: Iterable[ResultDocument], fmt: str, include_machine: bool = False) -> dict[str, str]:
    """``{file name suffix: JSON text}`` to write as ``<out><suffix>``.

    github-action-benchmark: ``{"-bigger.json": [...customBiggerIsBetter...], "-smaller.json": [...]}``
    (both always present, possibly ``[]``); bencher: ``{".json": BMF}``.
    """
    data = export_data(docs, fmt, include_machine)
    if fmt == GITHUB_ACTION_BENCHMARK:
        return {GAB_FILE_SUFFIXES[tool]: _dumps(entries) for tool, entries in data.items()}
    return {".json": _dumps(data)}
