"""The work counters' verdicts.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from bench.gate.accept import Acceptance, acceptance_of, applicable, beyond, describe_acceptances
from bench.gate.compare import Comparison, is_work_metric, paired_ratio
from bench.gate.groups import Group
from bench.metrics import WORK_METRIC_NAMES
from bench.results import ResultDocument
from bench.units import (
    format_bytes,
    format_number,
    format_signed_bytes,
    format_signed_count,
    format_signed_number,
    format_signed_percent,
)

WorkSide = ResultDocument | Mapping[str, Any] | tuple[Mapping[str, Any], Mapping[str, Any] | None]
"""One side of a work comparison: a result document, its JSON dict, or its (metrics, details)."""


_WORK_CENSUS = {
    # metric -> (the per-rank census field that explains it, how its values read)
    "work_matmul_flops": ("flops_by_op", "flops"),
    "work_allocated_bytes": ("allocated_by_op", "bytes"),
    "work_aten_ops": ("ops_by_name", "count"),
    "work_host_syncs": ("syncs_by_site", "count"),
}


_MAX_CHANGES = 4  # census entries named per verdict; the rest are counted


def _metrics_and_details(side) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(metrics, details) of a result document, its JSON dict, or a (metrics, details) pair."""
    if isinstance(side, ResultDocument):
        return side.metrics, side.data.get("details") or {}
    if isinstance(side, Mapping):
        return side.get("metrics") or {}, side.get("details") or {}
    metrics, details = side
    return metrics or {}, details or {}


def accepted_work_names(accept: Collection[str] | bool | None) -> frozenset[str]:
    if accept is True:
        return frozenset(WORK_METRIC_NAMES)
    return frozenset(accept or ())


def work_verdicts(
    scenario: str,
    base: WorkSide,
    cand: WorkSide,
    accept: Collection[str] | bool | None = None,
    machine: str | None = None,
    acceptances: Sequence[Acceptance] = (),
) -> list[str]:
    """The work verdict lines of one scenario's two sides (see the module doc), in metric order.

    ``base`` and ``cand``: each a result document (``ResultDocument`` or its JSON dict) or a
    ``(metrics, details)`` pair. ``accept``: the work metrics whose increase is accepted (True: all;
    None: none). ``acceptances``: accepted changes that apply to these two sides (module doc). A
    line starts with ``REGRESSION`` (an increase not accepted: fails a gate) or ``NOTE`` (an
    accepted increase, a decrease, or no work counters on one side). No line when nothing changed,
    or when neither side has work counters (a plan, a proxy, a micro run).
    """
    base_metrics, base_details = _metrics_and_details(base)
    cand_metrics, cand_details = _metrics_and_details(cand)
    where = f" [{machine}]" if machine else ""
    has = [has_work_counters(base_metrics), has_work_counters(cand_metrics)]
    if not any(has):
        return []
    if not all(has):
        side = "baseline" if not has[0] else "candidate"
        return [f"NOTE {scenario}: no work counters on one side (the {side}); work not compared{where}"]
    accepted = accepted_work_names(accept)
    base_ranks, cand_ranks = _work_ranks(base_details), _work_ranks(cand_details)
    lines = []
    for name in WORK_METRIC_NAMES:
        if name not in base_metrics or name not in cand_metrics:
            continue
        b, c = float(base_metrics[name]["median"]), float(cand_metrics[name]["median"])
        if b == c or cand_metrics[name]["better"] is None:
            continue
        text = describe_work_change(name, b, c, base_ranks, cand_ranks)
        named, within = acceptance_of(acceptances, name, scenario, paired_ratio(b, c), "lower")
        if c < b:
            lines.append(f"NOTE {scenario} {name}: work decreased: {text}{where}")
        elif name in accepted:
            lines.append(f"NOTE {scenario} {name}: work increased (accepted): {text}{where}")
        elif within:
            lines.append(
                f"NOTE {scenario} {name}: work increased (accepted: {describe_acceptances(named)}): {text}{where}"
            )
        else:
            lines.append(f"REGRESSION {scenario} {name}: work increased: {text}{where}{beyond(named)}")
    return lines


def has_work_counters(metrics: Mapping[str, Any]) -> bool:
    return any(is_work_metric(name) for name in metrics)


def work_findings(
    comparison: Comparison, accept: Collection[str] | bool | None = None, acceptances: Sequence[Acceptance] = ()
) -> list[str]:
    """``work_verdicts`` of every compared scenario (pooled metrics, the newest pooled run's census);
    of ``acceptances``, those that apply to each scenario's two versions."""
    lines = []
    for key in comparison.compared:
        base, cand = comparison.base_groups.get(key), comparison.cand_groups.get(key)
        if base is None or cand is None:
            continue
        lines += work_verdicts(
            key[0],
            _group_side(base),
            _group_side(cand),
            accept,
            machine=key[1],
            acceptances=applicable(comparison, key, acceptances),
        )
    return lines


def _group_side(group: Group) -> tuple[dict[str, Any], dict[str, Any]]:
    newest = group.pooled[-1] if group.pooled else group.newest
    return group.metrics, newest.data.get("details") or {}


def _work_ranks(details: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """rank -> that rank's work census (``details.work.ranks``); {} when the document has none."""
    work = details.get("work") or {}
    return {int(r.get("rank", i)): r for i, r in enumerate(work.get("ranks") or [])}


def describe_work_change(
    name: str,
    base: float,
    cand: float,
    base_ranks: Mapping[int, Mapping[str, Any]],
    cand_ranks: Mapping[int, Mapping[str, Any]],
) -> str:
    """What changed in one work metric, per step: the total, then the census entries that moved
    (``base_ranks``, ``cand_ranks``: rank -> census, as in ``details.work.ranks``; may be empty)."""
    delta = cand - base
    ranks = sorted(set(base_ranks) | set(cand_ranks))
    if name in ("work_collective_calls", "work_collective_bytes"):
        changes = _collective_changes(base_ranks, cand_ranks, ranks)
        if name == "work_collective_calls":
            # The census says it all: "+1 all_reduce of 4 MiB per step (dp)".
            head = f"{format_signed_count(delta)} collective calls per step ({format_number(base)} -> {format_number(cand)})"
            return "; ".join(changes) if changes else head
        head = f"{format_signed_bytes(delta)} of collectives per step ({format_bytes(base)} -> {format_bytes(cand)})"
        return head + (": " + "; ".join(changes) if changes else "")
    relative = format_signed_percent(delta / base) if base else None
    totals = f"{format_number(base)} -> {format_number(cand)}"
    if name == "work_matmul_flops":
        head = f"{relative or format_signed_number(delta)} matmul FLOPs per step ({totals})"
    elif name == "work_allocated_bytes":
        head = (
            f"{format_signed_bytes(delta)} allocated per step "
            f"({relative + ', ' if relative else ''}{format_bytes(base)} -> {format_bytes(cand)})"
        )
    elif name == "work_host_syncs":
        head = f"{format_signed_count(delta)} host sync{'s' * (abs(delta) != 1)} per step ({totals})"
    else:
        plural = "s" * (abs(delta) != 1)
        head = f"{format_signed_count(delta)} op{plural} per step ({relative + ', ' if relative else ''}{totals})"
    census_field, kind = _WORK_CENSUS.get(name, (None, "count"))
    changes = _census_changes(census_field, kind, base_ranks, cand_ranks, ranks) if census_field else []
    return head + (": " + ", ".join(changes) if changes else "")


def _census_changes(census_field: str, kind: str, base_ranks, cand_ranks, ranks: list[int]) -> list[str]:
    """``aten.clone.default +2`` per changed census entry, the largest changes first."""
    fmt = {"bytes": format_signed_bytes, "flops": format_signed_number, "count": format_signed_count}[kind]
    keys = set()
    for side in (base_ranks, cand_ranks):
        for census in side.values():
            keys |= set(census.get(census_field) or {})
    moved = []
    for key in keys:
        per_rank = {
            r: float((cand_ranks.get(r, {}).get(census_field) or {}).get(key, 0))
            - float((base_ranks.get(r, {}).get(census_field) or {}).get(key, 0))
            for r in ranks
        }
        total = sum(per_rank.values())
        if any(per_rank.values()):
            moved.append((-abs(total), key, per_rank))
    moved.sort(key=lambda item: (item[0], item[1]))
    texts = [f"{key} {_per_rank_text(per_rank, fmt)}" for _, key, per_rank in moved[:_MAX_CHANGES]]
    if len(moved) > _MAX_CHANGES:
        texts.append(f"{len(moved) - _MAX_CHANGES} more")
    return texts


def _collective_changes(base_ranks, cand_ranks, ranks: list[int]) -> list[str]:
    """``+1 all_reduce of 4 MiB per step (dp)`` per changed (op, group), every rank's alike or each named."""

    def census(side, rank) -> dict[tuple[str, str], tuple[int, int]]:
        entries = (side.get(rank) or {}).get("collectives") or []
        return {(e["op"], e["group"]): (int(e["calls"]), int(e["bytes"])) for e in entries}

    base = {r: census(base_ranks, r) for r in ranks}
    cand = {r: census(cand_ranks, r) for r in ranks}
    keys = sorted(set().union(*(set(c) for c in [*base.values(), *cand.values()])))
    texts = []
    for op, group in keys:
        per_rank = {}
        for r in ranks:
            (bc, bb), (cc, cb) = base[r].get((op, group), (0, 0)), cand[r].get((op, group), (0, 0))
            if (cc - bc, cb - bb) != (0, 0):
                per_rank[r] = _collective_text(op, group, cc - bc, cb - bb, cc)
        if not per_rank:
            continue
        if len(ranks) > 1 and len(per_rank) == len(ranks) and len(set(per_rank.values())) == 1:
            texts.append(f"{next(iter(per_rank.values()))} on each of {len(ranks)} ranks")
        elif len(ranks) > 1:
            texts += [f"{text} on rank {r}" for r, text in per_rank.items()]
        else:
            texts += list(per_rank.values())
    return texts


def _collective_text(op: str, group: str, calls: int, nbytes: int, cand_calls: int) -> str:
    if calls and nbytes and (calls > 0) == (nbytes > 0):
        return f"{calls:+d} {op} of {format_bytes(abs(nbytes) / abs(calls))} per step ({group})"
    if calls and not nbytes:
        return f"{calls:+d} {op} per step ({group})"
    if not calls:
        plural = "s" * (cand_calls != 1)
        return f"{op} ({group}) {format_signed_bytes(nbytes)} per step over the same {cand_calls} call{plural}"
    return f"{calls:+d} {op} per step ({group}), {format_signed_bytes(nbytes)} in all"


def _per_rank_text(per_rank: dict[int, float], fmt) -> str:
    """``+2``, ``+2 on each of 2 ranks``, or ``+2 on rank 0, +1 on rank 1``."""
    if len(per_rank) == 1:
        return fmt(next(iter(per_rank.values())))
    values = set(per_rank.values())
    if len(values) == 1:
        return f"{fmt(values.pop())} on each of {len(per_rank)} ranks"
    return ", ".join(f"{fmt(d)} on rank {r}" for r, d in per_rank.items() if d)
