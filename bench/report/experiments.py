"""The reference release's experiments, from whatever results a folder holds.
More: docs/report.md.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.gate.groups import Group
from bench.metrics import MEMORY_PREFERENCE, THROUGHPUT_PREFERENCE
from bench.predict.projection import STEP_KEYS
from bench.report.collect import ResultSet, first_metric, median, spec_of
from bench.report.comparisons import PairComparison, load_comparisons, pair_ratios
from bench.units import GIB

# --------------------------------------------------------------------------------------------
# Pairs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairBar:
    """One pair of one comparison in one version on one machine."""

    version: str
    machine: str
    numerator: str
    denominator: str
    metric: str | None
    unit: str | None
    numerator_value: float | None
    denominator_value: float | None
    ratio: float | None
    note: str | None
    """Why there is no ratio (a side not ok, the metric missing)."""
    interval: tuple[float, float] | None = None
    """95% interval of the ratio from both runs' samples (``bench.report.comparisons.ratio_interval``)."""
    described: str = ""
    """The ratio with its interval as the console prints it (``PairRatio.describe``)."""


@dataclass(frozen=True)
class PairChart:
    comparison: PairComparison
    bars: tuple[PairBar, ...]
    """Pairs with a ratio."""
    unmeasured: tuple[PairBar, ...]
    """Pairs with results but no ratio, with the reason."""


def pair_charts(results: ResultSet, comparisons: list[PairComparison] | None = None) -> list[PairChart]:
    """A chart per comparison that has a pair with results, in the section's order."""
    comparisons = load_comparisons() if comparisons is None else comparisons
    seen: set[tuple[str, str, str, str]] = set()
    found: dict[str, list[PairBar]] = {c.name: [] for c in comparisons}
    for machine in results.machines:
        for version in results.newest_first():
            groups = {s: g for (s, m), g in results.groups(version).items() if m == machine}
            if not groups:
                continue
            by_name = {s: (g.status, g.metrics) for s, g in groups.items()}
            for row in pair_ratios(comparisons, by_name):
                key = (row.comparison.name, row.numerator, row.denominator, machine)
                if key in seen:
                    continue  # a newer version already has this pair
                seen.add(key)
                num, den = groups[row.numerator], groups[row.denominator]
                unit = num.metrics[row.metric]["unit"] if row.metric in num.metrics else None
                found[row.comparison.name].append(
                    PairBar(
                        version,
                        machine,
                        row.numerator,
                        row.denominator,
                        row.metric,
                        unit,
                        median(num, row.metric) if row.metric else None,
                        median(den, row.metric) if row.metric else None,
                        row.ratio,
                        row.note,
                        row.interval,
                        row.describe(),
                    )
                )
    charts = []
    for comparison in comparisons:
        bars = found[comparison.name]
        if bars:
            charts.append(
                PairChart(
                    comparison, tuple(b for b in bars if b.ratio is not None), tuple(b for b in bars if b.ratio is None)
                )
            )
    return charts


# --------------------------------------------------------------------------------------------
# Scenarios that differ in one field
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variation:
    """One field that tells the members of a group of scenarios apart."""

    section: tuple[str, ...]
    """The spec's part that differs (left out when the members' specs are matched)."""
    value: Callable[[dict[str, Any]], Any]
    """The member's value of the field (None: the scenario is no member)."""


def _field(spec: dict[str, Any], path: tuple[str, ...], default: Any = None) -> Any:
    node: Any = spec
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def recompute_mode(spec: dict[str, Any]) -> str:
    """``none``, ``full`` or ``selective (attention, norms)``: the mode, and what a selective one recomputes."""
    recompute = spec.get("recompute") or {}
    mode = str(recompute.get("mode", "none"))
    parts = recompute.get("parts") or []
    return f"{mode} ({', '.join(map(str, parts))})" if mode == "selective" and parts else mode


EXPERTS = Variation(("model", "moe", "num_experts"), lambda spec: _field(spec, ("model", "moe", "num_experts")))
RECOMPUTE = Variation(("recompute",), recompute_mode)


@dataclass(frozen=True)
class VariationMember:
    """One scenario of a ``VariationGroup``: its value of the variation's field, and its metrics."""

    value: Any
    """The field's value in this scenario (8, 64, 128; none, selective, full)."""
    scenario: str
    metrics: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class VariationGroup:
    """Scenarios of one version, machine and mode whose specs differ only in one ``Variation``."""

    version: str
    machine: str
    mode: str
    """execute, plan or proxy: the members' mode."""
    members: tuple[VariationMember, ...]
    """Sorted by value."""
    throughput_metric: str | None
    """The throughput metric every member has (None: a plan, or none in common)."""
    memory_metric: str | None

    @property
    def label(self) -> str:
        return " / ".join(v.scenario for v in self.members)


def _without(spec: dict[str, Any], path: tuple[str, ...]) -> str:
    """The spec without its labels and without the field at ``path`` (a section left empty goes too),
    as canonical JSON."""
    rest = copy.deepcopy(spec)
    for label in ("name", "description"):
        rest.pop(label, None)
    node, parents = rest, []
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            break
        parents.append((node, part))
        node = node[part]
    else:
        node.pop(path[-1], None)
        for parent, part in reversed(parents):
            if parent[part] == {}:
                parent.pop(part)
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), default=str)


def variation_order(value: Any) -> tuple:
    """Numbers in order, then the recompute modes none, selective, full, then other text."""
    order = {"none": 0, "selective": 1, "full": 2}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, order.get(str(value).split(" ")[0], 9), str(value))


def variation_groups(results: ResultSet, variation: Variation) -> list[VariationGroup]:
    """Groups of ok scenarios of one version, machine and mode whose specs differ only in the
    variation's section, with two values or more; a group already found in a newer version is not
    repeated."""
    seen: set[tuple[str, str, str]] = set()
    found = []
    for machine in results.machines:
        for version in results.newest_first():
            by_rest: dict[tuple[str, str], dict[Any, Group]] = {}
            for (_scenario, m), group in sorted(results.ok_groups(version).items()):
                if m != machine:
                    continue
                spec = spec_of(group)
                value = variation.value(spec)
                if value is None or isinstance(value, (dict, list)):
                    continue
                mode = group.newest.data["mode"]
                by_rest.setdefault((mode, _without(spec, variation.section)), {}).setdefault(value, group)
            for (mode, rest), members in by_rest.items():
                if len(members) < 2 or (machine, mode, rest) in seen:
                    continue
                seen.add((machine, mode, rest))
                ordered = sorted(members.items(), key=lambda kv: variation_order(kv[0]))
                groups = [g for _, g in ordered]
                found.append(
                    VariationGroup(
                        version,
                        machine,
                        mode,
                        tuple(VariationMember(value, g.scenario, g.metrics) for value, g in ordered),
                        first_metric(groups, THROUGHPUT_PREFERENCE),
                        first_metric(groups, MEMORY_PREFERENCE),
                    )
                )
    return found


# --------------------------------------------------------------------------------------------
# Plan memory per rank
# --------------------------------------------------------------------------------------------

STATE_PARTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"))
TRANSIENT_PARTS = (
    ("activations", "activations"),
    ("comm_buffers", "communication buffers"),
    ("backward_workspace", "backward workspace"),
)
OPTIMIZER_STEP = ("optimizer_step", "optimizer step temporaries")


@dataclass(frozen=True)
class MemoryStack:
    version: str
    machine: str
    scenario: str
    segments: tuple[tuple[str, float], ...]
    """(part, bytes), adding up to ``total``."""
    total: float
    """The plan's memory_total_bytes of its most loaded rank."""
    capacity: float | None
    """The GPU's memory in bytes (the scenario's cluster), None without a cluster."""
    cluster: str | None


def _bytes(metrics: dict[str, dict], part: str) -> float:
    entry = metrics.get(f"memory_{part}_bytes")
    return float(entry["median"]) if entry else 0.0


def memory_stack(group: Group, version: str) -> MemoryStack | None:
    """The plan's per-rank memory as stacked parts; None for a document without the plan's total."""
    metrics = group.metrics
    if "memory_total_bytes" not in metrics:
        return None
    total = float(metrics["memory_total_bytes"]["median"])
    segments = [(label, _bytes(metrics, part)) for part, label in STATE_PARTS]
    during_backward = [(label, _bytes(metrics, part)) for part, label in TRANSIENT_PARTS]
    step = _bytes(metrics, OPTIMIZER_STEP[0])
    # The plan counts the larger of the two transient peaks: activations are freed before the step.
    if step > sum(b for _, b in during_backward):
        segments.append((OPTIMIZER_STEP[1], step))
    else:
        segments += during_backward
    rest = total - sum(b for _, b in segments)
    if rest > 1e-9 * max(total, 1.0):
        segments.append(("not broken down", rest))
    details = group.newest.data.get("details") or {}
    cluster = details.get("cluster") or spec_of(group).get("cluster") or {}
    capacity = cluster.get("gpu_memory_gib")
    return MemoryStack(
        version,
        group.machine,
        group.scenario,
        tuple((k, b) for k, b in segments if b > 0),
        total,
        float(capacity) * GIB if capacity else None,
        cluster.get("name"),
    )


def plan_memory(results: ResultSet) -> dict[str, list[MemoryStack]]:
    """machine -> the plans with a cluster (a GPU to fit), newest version of each, by scenario name."""
    charts: dict[str, dict[str, MemoryStack]] = {}
    for version in results.newest_first():
        for (scenario, machine), group in results.ok_groups(version).items():
            if group.newest.data["mode"] != "plan" or scenario in charts.get(machine, {}):
                continue
            stack = memory_stack(group, version)
            if stack is not None and stack.capacity is not None:
                charts.setdefault(machine, {})[scenario] = stack
    return {m: [stacks[s] for s in sorted(stacks)] for m, stacks in sorted(charts.items())}


# --------------------------------------------------------------------------------------------
# Projection breakdowns
# --------------------------------------------------------------------------------------------

STEP_LABELS = {
    "compute": "compute",
    "expert_comm": "expert communication",
    "pipeline_comm": "pipeline communication",
    "fsdp_gather_exposed": "FSDP gathers (exposed)",
    "bubble": "pipeline bubble",
    "grad_sync_exposed": "gradient sync (exposed)",
    "optimizer": "optimizer",
    "param_gather_exposed": "parameter gathers (exposed)",
    "other_comm": "other communication",
    "skew": "rank skew",
}
"""A label for each of STEP_KEYS."""


@dataclass(frozen=True)
class ProjectionStack:
    version: str
    machine: str
    scenario: str
    target: str
    """What the step is projected on: the scenario's cluster with this machine's compute, or a device."""
    segments: tuple[tuple[str, float], ...]
    """(part, seconds per step), adding up to ``step_s``."""
    step_s: float
    tokens_per_s_per_gpu: float | None


def _stack(version, group: Group, target: str, projection: dict[str, Any]) -> ProjectionStack | None:
    breakdown = projection.get("breakdown_s")
    if not isinstance(breakdown, dict) or "step_s" not in projection:
        return None
    segments = tuple((STEP_LABELS.get(k, k), float(breakdown[k])) for k in STEP_KEYS if breakdown.get(k))
    return ProjectionStack(
        version,
        group.machine,
        group.scenario,
        target,
        segments,
        float(projection["step_s"]),
        projection.get("tokens_per_s_per_gpu"),
    )


def projection_stacks(results: ResultSet) -> list[ProjectionStack]:
    """Every proxy's projections (newest version of each scenario), by scenario and target."""
    seen: set[tuple[str, str]] = set()
    found = []
    for version in results.newest_first():
        for (scenario, machine), group in sorted(results.ok_groups(version).items()):
            if group.newest.data["mode"] != "proxy" or (scenario, machine) in seen:
                continue
            seen.add((scenario, machine))
            details = group.newest.data.get("details") or {}
            cluster = (spec_of(group).get("cluster") or {}).get("name") or "the scenario's cluster"
            stacks = [_stack(version, group, f"{cluster}, {machine}'s compute", details.get("projection") or {})]
            for device, projection in sorted((details.get("device_projections") or {}).items()):
                if isinstance(projection, dict) and not projection.get("error"):
                    stacks.append(_stack(version, group, f"{device} (op-level)", projection))
            found += [s for s in stacks if s is not None]
    return found
