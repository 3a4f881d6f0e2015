"""Compare two sets of result documents (baseline and candidate) and gate on regressions.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.gate.formatting import check_tolerance, json_number, short
from bench.gate.groups import Group, Key, group_documents, same_scenario
from bench.metrics import noise_floor
from bench.results import IDENTITY_TOLERANCE, ResultDocument, identity_difference, load_results, noisy_reason

DEFAULT_TOLERANCE = 0.05
"""Default relative tolerance (5%)."""


VERDICTS = ("regressed", "accepted", "inconclusive", "improved", "unchanged", "info", "missing")


EPS = 1e-12  # |ratio - 1| must exceed the threshold by more than rounding error.


@dataclass(frozen=True)
class MetricRow:
    """One metric of one matched scenario."""

    scenario: str
    machine: str
    metric: str
    unit: str
    better: str | None
    """"higher", "lower", or None (reported, not gated)."""
    base: float | None
    """Baseline median (None when the metric is only in the candidate)."""
    cand: float | None
    """Candidate median (None when the metric is only in the baseline)."""
    base_rel_iqr: float | None
    """Baseline spread.rel_iqr; None when the metric is missing or has no spread (one sample)."""
    cand_rel_iqr: float | None
    base_n: int
    """Number of (pooled) baseline samples; 0 when missing."""
    cand_n: int
    ratio: float | None
    """cand / base (see module doc for zero/negative baselines); None when missing."""
    noise: float | None
    """rel_iqr(base) + rel_iqr(cand) (a side without a spread adds 0; 0 when exact); None when missing."""
    threshold: float | None
    """max(tolerance, noise); None when missing."""
    outside_noise: bool
    """|ratio - 1| exceeds the threshold (tolerance and noise)."""
    verdict: str
    """One of VERDICTS: regressed, accepted, inconclusive, improved, unchanged, info, missing."""
    exact: bool = False
    """No side has a spread (one sample per run): compared as an exact value, no noise allowance."""
    accepted: str | None = None
    """Why a regression is accepted (verdict ``accepted``): the reasons and where they were given."""

    @property
    def change(self) -> float | None:
        """ratio - 1 (relative change), None when missing."""
        return None if self.ratio is None else self.ratio - 1.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: json_number(v) for k, v in out.items()}


@dataclass(frozen=True)
class ScenarioIssue:
    """A scenario that could not be compared metric by metric."""

    kind: str
    """missing_in_candidate, missing_in_baseline, not_ok or mismatched."""
    scenario: str
    machine: str
    side: str | None = None
    """For not_ok: "baseline", "candidate" or "both"; None otherwise."""
    base_status: str | None = None
    cand_status: str | None = None
    base_error: str | None = None
    cand_error: str | None = None
    base_hash: str | None = None
    cand_hash: str | None = None
    base_paths: tuple[str, ...] = ()
    cand_paths: tuple[str, ...] = ()
    reason: str | None = None
    """For noisy and different_machines: why the sides were not compared."""
    command: str | None = None
    """For different_machines: the command that compares the two versions on one machine."""

    @property
    def fails_gate(self) -> bool:
        if self.kind in ("missing_in_candidate", "mismatched", "noisy", "different_machines"):
            return True
        if self.kind != "not_ok" or self.side not in ("candidate", "both"):
            return False
        # Skipped on both sides (e.g. a CUDA scenario on two CPU runs): consistently not measured.
        return not (self.cand_status == "skipped" and self.base_status == "skipped")

    def describe(self) -> str:
        where, machine = self.scenario, f" [{self.machine}]"
        if self.kind == "missing_in_candidate":
            return f"MISSING {where}: in the baseline ({self.base_status}) but not in the candidate{machine}"
        if self.kind == "missing_in_baseline":
            return f"NEW {where}: only in the candidate ({self.cand_status}); nothing to compare against{machine}"
        if self.kind == "noisy":
            return f"NOISY {where}: the {self.side} run shared its machine ({self.reason}); not compared{machine}"
        if self.kind == "different_machines":
            return (
                f"DIFFERENT MACHINES {where}: different machines: not compared ({self.reason}){machine}; "
                f"on one machine: {self.command}"
            )
        if self.kind == "mismatched":
            return (
                f"MISMATCHED {where}: scenario hash differs (baseline {short(self.base_hash)}, "
                f"candidate {short(self.cand_hash)}); not a like-for-like comparison{machine}"
            )
        parts = []
        if self.side in ("baseline", "both"):
            parts.append(f"baseline {self.base_status}" + (f" ({self.base_error})" if self.base_error else ""))
        if self.side in ("candidate", "both"):
            parts.append(f"candidate {self.cand_status}" + (f" ({self.cand_error})" if self.cand_error else ""))
        label = "NOT-OK" if self.fails_gate else "NOTE NOT-OK"
        return f"{label} {where}: " + "; ".join(parts) + machine

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["base_paths"], out["cand_paths"] = list(self.base_paths), list(self.cand_paths)
        out["fails_gate"] = self.fails_gate
        return out


@dataclass(frozen=True)
class Comparison:
    """Result of ``compare``: metric rows of the matched scenarios, plus scenario-level issues."""

    rows: tuple[MetricRow, ...]
    """Every metric row of every matched, ok-on-both-sides, same-hash scenario (sorted)."""
    compared: tuple[Key, ...]
    """(scenario, machine) pairs that produced metric rows."""
    missing_in_candidate: tuple[ScenarioIssue, ...]
    missing_in_baseline: tuple[ScenarioIssue, ...]
    not_ok: tuple[ScenarioIssue, ...]
    mismatched: tuple[ScenarioIssue, ...]
    tolerance: float
    """The tolerance the verdicts were computed with."""
    not_compared: tuple[ScenarioIssue, ...] = ()
    """Scenarios a side of which was noisy, or whose sides ran on different machines (module doc)."""
    base_groups: dict[Key, Group] = field(default_factory=dict, repr=False, compare=False)
    cand_groups: dict[Key, Group] = field(default_factory=dict, repr=False, compare=False)

    @property
    def issues(self) -> tuple[ScenarioIssue, ...]:
        return self.missing_in_candidate + self.not_ok + self.mismatched + self.not_compared + self.missing_in_baseline

    def rows_with(self, verdict: str) -> tuple[MetricRow, ...]:
        return tuple(r for r in self.rows if r.verdict == verdict)

    @property
    def regressions(self) -> tuple[MetricRow, ...]:
        return self.rows_with("regressed")

    @property
    def improvements(self) -> tuple[MetricRow, ...]:
        return self.rows_with("improved")

    def counts(self) -> dict[str, int]:
        out = {v: 0 for v in VERDICTS}
        for row in self.rows:
            out[row.verdict] += 1
        return out

    def with_tolerance(self, tolerance: float) -> Comparison:
        """The same comparison with verdicts recomputed for another tolerance."""
        if tolerance == self.tolerance:
            return self
        rows = _one_verdict_per_run(tuple(_evaluate(r, tolerance) for r in self.rows))
        return replace(self, rows=rows, tolerance=tolerance)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (non-finite ratios become the strings "inf"/"-inf")."""
        return {
            "tolerance": self.tolerance,
            "counts": self.counts(),
            "compared": [list(k) for k in self.compared],
            "rows": [r.to_dict() for r in self.rows],
            "missing_in_candidate": [i.to_dict() for i in self.missing_in_candidate],
            "missing_in_baseline": [i.to_dict() for i in self.missing_in_baseline],
            "not_ok": [i.to_dict() for i in self.not_ok],
            "mismatched": [i.to_dict() for i in self.mismatched],
            "not_compared": [i.to_dict() for i in self.not_compared],
        }


def paired_ratio(base: float, cand: float) -> float:
    """cand / base, defined for a zero or negative base (a loss can be negative)."""
    if base == 0:
        return 1.0 if cand == 0 else math.copysign(math.inf, cand)
    if base > 0:
        return cand / base
    return 1.0 + (cand - base) / abs(base)


def classify(ratio: float, noise: float, better: str | None, tolerance: float) -> tuple[bool, str]:
    """(outside_noise, verdict) for one metric; see docs/gate-statistics.md for the rule."""
    threshold = max(tolerance, noise)
    outside = abs(ratio - 1.0) > threshold + EPS
    if better is None:
        return outside, "info"
    if not outside:
        beyond_tolerance = abs(ratio - 1.0) > tolerance + EPS
        return outside, "inconclusive" if beyond_tolerance else "unchanged"
    went_up = ratio > 1.0
    if better == "higher":
        return outside, "improved" if went_up else "regressed"
    if better == "lower":
        return outside, "regressed" if went_up else "improved"
    raise ValueError(f"metric direction must be 'higher', 'lower' or null, got {better!r}")


def _evaluate(row: MetricRow, tolerance: float) -> MetricRow:
    """Fill in ratio, noise, threshold and verdict from the row's medians and spreads."""
    if row.base is None or row.cand is None:
        return replace(
            row, ratio=None, noise=None, threshold=None, outside_noise=False, verdict="missing", accepted=None
        )
    ratio = paired_ratio(row.base, row.cand)
    if is_work_metric(row.metric) and row.better is not None:
        # Exact counts: any change counts, whatever the tolerance.
        changed = row.cand != row.base
        worse = row.cand > row.base if row.better == "lower" else row.cand < row.base
        verdict = "unchanged" if not changed else ("regressed" if worse else "improved")
        return replace(
            row,
            ratio=ratio,
            noise=0.0,
            threshold=0.0,
            outside_noise=changed,
            verdict=verdict,
            exact=True,
            accepted=None,
        )
    noise = 0.0 if row.exact else (row.base_rel_iqr or 0.0) + (row.cand_rel_iqr or 0.0)
    noise = max(noise, noise_floor(row.metric))
    outside, verdict = classify(ratio, noise, row.better, tolerance)
    return replace(
        row,
        ratio=ratio,
        noise=noise,
        threshold=max(tolerance, noise),
        outside_noise=outside,
        verdict=verdict,
        accepted=None,
    )


def _row(
    scenario: str, machine: str, name: str, base: dict[str, Any] | None, cand: dict[str, Any] | None, tolerance: float
) -> MetricRow:
    ref = cand if cand is not None else base
    assert ref is not None  # the metric is on one side at least
    present = [entry for entry in (base, cand) if entry is not None]
    row = MetricRow(
        scenario,
        machine,
        name,
        unit=ref["unit"],
        better=ref["better"],
        base=None if base is None else float(base["median"]),
        cand=None if cand is None else float(cand["median"]),
        base_rel_iqr=_rel_iqr(base),
        cand_rel_iqr=_rel_iqr(cand),
        base_n=0 if base is None else len(base["samples"]),
        cand_n=0 if cand is None else len(cand["samples"]),
        ratio=None,
        noise=None,
        threshold=None,
        outside_noise=False,
        verdict="missing",
        exact=all(entry["spread"] is None for entry in present),
    )
    return _evaluate(row, tolerance)


def _rel_iqr(entry: dict[str, Any] | None) -> float | None:
    if entry is None or entry["spread"] is None:
        return None
    return float(entry["spread"]["rel_iqr"])


def compare(
    base_docs: Iterable[ResultDocument],
    cand_docs: Iterable[ResultDocument],
    tolerance: float = DEFAULT_TOLERANCE,
) -> Comparison:
    """Match baseline and candidate documents by (scenario, machine) and compare every metric.

    ``tolerance`` is a fraction (0.05 = 5%); ``gate`` can recompute the verdicts for another one.
    """
    check_tolerance(tolerance)
    base = group_documents(base_docs)
    cand = group_documents(cand_docs)
    rows: list[MetricRow] = []
    compared: list[Key] = []
    missing_c: list[ScenarioIssue] = []
    missing_b: list[ScenarioIssue] = []
    not_ok: list[ScenarioIssue] = []
    mismatched: list[ScenarioIssue] = []
    not_compared: list[ScenarioIssue] = []
    for key in sorted(set(base) | set(cand)):
        b, c = base.get(key), cand.get(key)
        common: dict[str, Any] = dict(
            scenario=key[0],
            machine=key[1],
            base_status=b.status if b else None,
            cand_status=c.status if c else None,
            base_error=b.error if b else None,
            cand_error=c.error if c else None,
            base_hash=b.hash if b else None,
            cand_hash=c.hash if c else None,
            base_paths=b.paths if b else (),
            cand_paths=c.paths if c else (),
        )
        if c is None:
            missing_c.append(ScenarioIssue("missing_in_candidate", **common))
            continue
        if b is None:
            missing_b.append(ScenarioIssue("missing_in_baseline", **common))
            continue
        if b.status != "ok" or c.status != "ok":
            side = (
                "both" if b.status != "ok" and c.status != "ok" else ("baseline" if b.status != "ok" else "candidate")
            )
            not_ok.append(ScenarioIssue("not_ok", side=side, **common))
            continue
        if not same_scenario(b, c):
            mismatched.append(ScenarioIssue("mismatched", **common))
            continue
        skip = _not_comparable(b, c, common)
        if skip is not None:
            not_compared.append(skip)
            continue
        compared.append(key)
        for name in sorted(set(b.metrics) | set(c.metrics)):
            rows.append(_row(key[0], key[1], name, b.metrics.get(name), c.metrics.get(name), tolerance))
    return Comparison(
        rows=_one_verdict_per_run(tuple(rows)),
        compared=tuple(compared),
        missing_in_candidate=tuple(missing_c),
        missing_in_baseline=tuple(missing_b),
        not_ok=tuple(not_ok),
        mismatched=tuple(mismatched),
        tolerance=tolerance,
        not_compared=tuple(not_compared),
        base_groups=base,
        cand_groups=cand,
    )


SAME_RUNS_AS_STEP_TIME = ("tokens_per_s_per_gpu", "tflops_per_gpu")
"""Metrics that are a scenario's step times divided into a constant: they take ``step_time_s``'s verdict."""


def _one_verdict_per_run(rows: tuple[MetricRow, ...]) -> tuple[MetricRow, ...]:
    """Rows with the step time's verdict on the metrics derived from the same step times (module doc)."""
    step = {
        (r.scenario, r.machine): r
        for r in rows
        if r.metric == "step_time_s" and r.verdict in ("regressed", "improved", "inconclusive", "unchanged")
    }
    out = []
    for row in rows:
        ref = step.get((row.scenario, row.machine))
        if (
            ref is not None
            and row.metric in SAME_RUNS_AS_STEP_TIME
            and row.better is not None
            and row.ratio is not None
        ):
            row = replace(row, verdict=ref.verdict, outside_noise=ref.outside_noise)
        out.append(row)
    return tuple(out)


def _not_comparable(b: Group, c: Group, common: dict[str, Any]) -> ScenarioIssue | None:
    """The ``noisy`` or ``different_machines`` issue of two ok groups of one scenario; None when they compare."""
    noisy = {
        side: [r for d in g.pooled if (r := noisy_reason(d.data))] for side, g in (("baseline", b), ("candidate", c))
    }
    if noisy["baseline"] or noisy["candidate"]:
        side = (
            "both" if noisy["baseline"] and noisy["candidate"] else ("baseline" if noisy["baseline"] else "candidate")
        )
        reason = (noisy["candidate"] or noisy["baseline"])[0]
        return ScenarioIssue("noisy", side=side, reason=reason, **common)
    if b.newest.data.get("mode") == "plan":
        return None  # a plan measures nothing: any machine computes the same one
    difference = identity_difference(group_identity(b), group_identity(c), IDENTITY_TOLERANCE)
    if difference is None:
        return None
    scenario_file = c.newest.data["scenario"].get("file") or f"<{c.scenario}'s scenario file>"
    commit = b.newest.data["engine"].get("git_commit") or b.version
    command = f"moe-bench ab {scenario_file} --baseline-ref {commit[:12]}"
    return ScenarioIssue("different_machines", reason=difference, command=command, **common)


def group_identity(group: Group) -> dict[str, Any] | None:
    """The machine identity of a side's pooled runs: the newest run's, with the median calibration of
    the runs that record one (None when the newest records no identity)."""
    identity = group.newest.data["machine"].get("identity")
    if identity is None:
        return None
    figures = sorted(
        d.data["machine"]["identity"]["calibration"]["gflops"]
        for d in group.pooled
        if (d.data["machine"].get("identity") or {}).get("calibration")
    )
    if figures and identity.get("calibration"):
        identity = {**identity, "calibration": {**identity["calibration"], "gflops": figures[len(figures) // 2]}}
    return identity


def compare_paths(base: str | Path, cand: str | Path, tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """``compare`` over two sides given as files or folders (``load_results`` on each)."""
    return compare(load_results(Path(base)), load_results(Path(cand)), tolerance)


WORK_PREFIX = "work_"


def is_work_metric(name: str) -> bool:
    """A work counter (``work_*``): compared exactly, see the module doc."""
    return name.startswith(WORK_PREFIX)
