"""Compare two sets of result documents (baseline and candidate) and gate on regressions.

A *side* is a file or a folder of result documents (``bench.results.load_results``). Documents are
matched across the sides by ``(scenario name, machine name)``.

Several documents for one scenario on one side
-----------------------------------------------
A side may hold several runs of one scenario on one machine (``x.json``, ``x.2.json``, ...). They
are **pooled**: the newest document (by ``timestamp``, ties broken by the ``.N`` file-name suffix
that ``write_result`` gives later runs) decides the status, scenario hash and engine version of
the group; the samples of every ``ok`` document with that same scenario hash and engine version
are concatenated per metric and the median and spread are recomputed over the pooled samples.
Pooling gives the noise estimate more samples and includes run-to-run variation in it. A metric
with no spread in every pooled document (one sample per run: see *Exact values* below) stays
without one: its pooled value is the median of the runs' values. Documents
with another hash or version (an older, different run kept in the same folder) are left out of
the pool and listed in ``Group.ignored``. When the newest document is not ``ok`` the scenario is
``not ok`` on that side, even if an older run succeeded: a fresh failure is never hidden by an
older success.

Noise model
-----------
For every metric present on both sides: ``ratio = cand_median / base_median`` (for a negative
baseline, ``ratio = 1 + (cand - base) / |base|``, so that ``ratio > 1`` always means "went up";
a zero baseline gives ratio 1 when the candidate is also 0 and +/-inf otherwise). The noise is
the measured spread of the two runs::

    noise = rel_iqr(base) + rel_iqr(cand)          # each metric's spread.rel_iqr

and the threshold is ``max(tolerance, noise)``: a change counts only when ``|ratio - 1|`` exceeds
BOTH the tolerance AND the noise.

Exact values: a metric recorded with one sample (peak memory, optimizer state bytes, a plan's
estimate, a derived ratio) has ``"spread": null`` in its document: one value measures nothing
about its own noise. When neither side has a spread the row is ``exact``: ``noise = 0`` and the
threshold is the tolerance alone, so any change beyond the tolerance in the worse direction is a
regression and equal values are unchanged. Several runs of such a metric in one side are pooled to
the median of their values, still exact: the difference between the runs is not taken as noise.
(Were only one side without a spread, that side would add 0 to the noise.) For example, at
tolerance 5%, peak memory 96 and 104 bytes in two baseline runs against 100 and 112 in two
candidate runs gives ratio 106/100 = 1.06 and regresses; taken as timings, the same values would
have had noise 4/100 + 6/106 = 9.7% and been unchanged.

Direction comes from the metric's ``better`` field:

* ``better == "higher"`` (throughput, MFU): regressed when ``ratio < 1 - threshold``, improved
  when ``ratio > 1 + threshold``;
* ``better == "lower"`` (peak memory, step time): regressed when ``ratio > 1 + threshold``,
  improved when ``ratio < 1 - threshold``;
* ``better is None``: verdict ``info``, reported and never gated (``outside_noise`` is still
  computed);
* a metric on one side only: verdict ``missing`` (reported, not gated).

The direction (``better``) and unit are taken from the candidate when both sides have the metric.

Scenario-level outcomes are listed explicitly, never silently passed: ``missing_in_candidate``,
``missing_in_baseline`` (new scenario; not a failure), ``not_ok`` (status other than ``ok`` on
either side, with status and error) and ``mismatched`` (scenario hash differs between the sides: a
changed scenario is not a like-for-like comparison, so no metric rows are produced for it).

``gate`` fails (exit code 1) on any regressed metric, any scenario missing in the candidate, any
scenario not ``ok`` in the candidate and any mismatched scenario; otherwise it passes (0). The one
exception: a scenario ``skipped`` on both sides (e.g. a CUDA-only scenario in two CPU runs) is
listed in ``not_ok`` but does not fail. Scenarios only in the candidate, not ok only in the
baseline, metrics on one side only, improvements and ``info`` metrics are reported, not failed.

Everything here is a pure function over loaded documents; the ``moe-bench`` CLI does the I/O.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.results import ResultDocument, load_results, metric

DEFAULT_TOLERANCE = 0.05
"""Default relative tolerance (5%)."""

VERDICTS = ("regressed", "improved", "unchanged", "info", "missing")

_EPS = 1e-12  # |ratio - 1| must exceed the threshold by more than rounding error.

Key = tuple[str, str]  # (scenario name, machine name)


# --------------------------------------------------------------------------------------------
# Grouping and pooling one side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """All documents of one side for one (scenario, machine), pooled."""

    scenario: str
    machine: str
    newest: ResultDocument
    """The newest document: decides status, error, hash and version."""
    pooled: tuple[ResultDocument, ...]
    """The ``ok`` documents whose samples were pooled (same hash and version as ``newest``;
    empty when ``newest`` is not ok)."""
    ignored: tuple[ResultDocument, ...]
    """Documents of this scenario left out of the pool (other hash/version, or not ok)."""
    metrics: dict[str, dict[str, Any]]
    """Pooled metric entries (``bench.results.metric`` format)."""

    @property
    def key(self) -> Key:
        return (self.scenario, self.machine)

    @property
    def status(self) -> str:
        return self.newest.status

    @property
    def error(self) -> str | None:
        return self.newest.data.get("error")

    @property
    def hash(self) -> str:
        return self.newest.data["scenario"]["hash"]

    @property
    def version(self) -> str:
        return self.newest.version

    @property
    def paths(self) -> tuple[str, ...]:
        docs = self.pooled or (self.newest,)
        return tuple(str(d.path) for d in docs if d.path is not None)


def _run_index(doc: ResultDocument) -> int:
    """The ``.N`` suffix write_result gives the N-th run (``x.json`` is 1, ``x.2.json`` is 2)."""
    if doc.path is None:
        return 1
    file_name = Path(doc.path).name
    stem = file_name[: -len(".json")] if file_name.endswith(".json") else file_name
    match = re.fullmatch(re.escape(doc.name) + r"\.(\d+)", stem)
    return int(match.group(1)) if match else 1


def _timestamp(doc: ResultDocument) -> datetime | None:
    text = doc.data.get("timestamp", "")
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp


def _age_key(doc: ResultDocument) -> tuple:
    stamp = _timestamp(doc)
    # Unparseable timestamps sort as oldest.
    return (stamp is not None, stamp.timestamp() if stamp else 0.0, _run_index(doc), str(doc.path or ""))


def _pool_metrics(docs: Sequence[ResultDocument]) -> dict[str, dict[str, Any]]:
    """Concatenate samples per metric (newest document's unit and direction win); a metric without
    a spread in every document stays without one (exact: see the module doc)."""
    samples: dict[str, list[float]] = {}
    meta: dict[str, tuple[str, str | None]] = {}
    exact: dict[str, bool] = {}
    for doc in docs:  # oldest first, so the newest document's unit/better is kept last
        for name, entry in doc.metrics.items():
            samples.setdefault(name, []).extend(float(v) for v in entry["samples"])
            meta[name] = (entry["unit"], entry["better"])
            exact[name] = exact.get(name, True) and entry["spread"] is None
    if len(docs) == 1:
        return {name: dict(entry) for name, entry in docs[0].metrics.items()}
    pooled = {name: metric(values, *meta[name]) for name, values in samples.items()}
    for name, entry in pooled.items():
        if exact[name]:
            entry["spread"] = None
    return pooled


def group_documents(docs: Iterable[ResultDocument]) -> dict[Key, Group]:
    """Group a side's documents by (scenario, machine) and pool repeated runs (see module doc)."""
    by_key: dict[Key, list[ResultDocument]] = {}
    for doc in docs:
        by_key.setdefault((doc.name, doc.machine), []).append(doc)
    groups: dict[Key, Group] = {}
    for key in sorted(by_key):
        members = sorted(by_key[key], key=_age_key)
        newest = members[-1]
        if newest.status == "ok":
            same = lambda d: (  # noqa: E731
                d.status == "ok"
                and d.data["scenario"]["hash"] == newest.data["scenario"]["hash"]
                and d.version == newest.version
            )
            pooled = tuple(d for d in members if same(d))
        else:
            pooled = ()
        pooled_ids = {id(d) for d in pooled}
        ignored = tuple(d for d in members if id(d) not in pooled_ids and d is not newest)
        groups[key] = Group(
            scenario=key[0],
            machine=key[1],
            newest=newest,
            pooled=pooled,
            ignored=ignored,
            metrics=_pool_metrics(pooled) if pooled else {},
        )
    return groups


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


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
    """One of VERDICTS: regressed, improved, unchanged, info, missing."""
    exact: bool = False
    """No side has a spread (one sample per run): compared as an exact value, no noise allowance."""

    @property
    def change(self) -> float | None:
        """ratio - 1 (relative change), None when missing."""
        return None if self.ratio is None else self.ratio - 1.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: _json_number(v) for k, v in out.items()}


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

    @property
    def fails_gate(self) -> bool:
        if self.kind in ("missing_in_candidate", "mismatched"):
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
        if self.kind == "mismatched":
            return (
                f"MISMATCHED {where}: scenario hash differs (baseline {_short(self.base_hash)}, "
                f"candidate {_short(self.cand_hash)}); not a like-for-like comparison{machine}"
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
    base_groups: dict[Key, Group] = field(default_factory=dict, repr=False, compare=False)
    cand_groups: dict[Key, Group] = field(default_factory=dict, repr=False, compare=False)

    @property
    def issues(self) -> tuple[ScenarioIssue, ...]:
        return self.missing_in_candidate + self.not_ok + self.mismatched + self.missing_in_baseline

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

    def with_tolerance(self, tolerance: float) -> "Comparison":
        """The same comparison with verdicts recomputed for another tolerance."""
        if tolerance == self.tolerance:
            return self
        rows = tuple(_evaluate(r, tolerance) for r in self.rows)
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
        }


def paired_ratio(base: float, cand: float) -> float:
    """cand / base, defined for a zero or negative base (a loss can be negative)."""
    if base == 0:
        return 1.0 if cand == 0 else math.copysign(math.inf, cand)
    if base > 0:
        return cand / base
    return 1.0 + (cand - base) / abs(base)


def classify(ratio: float, noise: float, better: str | None, tolerance: float) -> tuple[bool, str]:
    """(outside_noise, verdict) for one metric; see the module docstring for the rule."""
    threshold = max(tolerance, noise)
    outside = abs(ratio - 1.0) > threshold + _EPS
    if better is None:
        return outside, "info"
    if not outside:
        return outside, "unchanged"
    went_up = ratio > 1.0
    if better == "higher":
        return outside, "improved" if went_up else "regressed"
    if better == "lower":
        return outside, "regressed" if went_up else "improved"
    raise ValueError(f"metric direction must be 'higher', 'lower' or null, got {better!r}")


def _evaluate(row: MetricRow, tolerance: float) -> MetricRow:
    """Fill in ratio, noise, threshold and verdict from the row's medians and spreads."""
    if row.base is None or row.cand is None:
        return replace(row, ratio=None, noise=None, threshold=None, outside_noise=False, verdict="missing")
    ratio = paired_ratio(row.base, row.cand)
    noise = 0.0 if row.exact else (row.base_rel_iqr or 0.0) + (row.cand_rel_iqr or 0.0)
    outside, verdict = classify(ratio, noise, row.better, tolerance)
    return replace(
        row, ratio=ratio, noise=noise, threshold=max(tolerance, noise), outside_noise=outside, verdict=verdict
    )


def _row(
    scenario: str, machine: str, name: str, base: dict[str, Any] | None, cand: dict[str, Any] | None, tolerance: float
) -> MetricRow:
    ref = cand if cand is not None else base
    present = [entry for entry in (base, cand) if entry is not None]
    row = MetricRow(
        scenario, machine, name, unit=ref["unit"], better=ref["better"],
        base=None if base is None else float(base["median"]),
        cand=None if cand is None else float(cand["median"]),
        base_rel_iqr=_rel_iqr(base),
        cand_rel_iqr=_rel_iqr(cand),
        base_n=0 if base is None else len(base["samples"]),
        cand_n=0 if cand is None else len(cand["samples"]),
        ratio=None, noise=None, threshold=None, outside_noise=False, verdict="missing",
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
    _check_tolerance(tolerance)
    base = group_documents(base_docs)
    cand = group_documents(cand_docs)
    rows: list[MetricRow] = []
    compared: list[Key] = []
    missing_c: list[ScenarioIssue] = []
    missing_b: list[ScenarioIssue] = []
    not_ok: list[ScenarioIssue] = []
    mismatched: list[ScenarioIssue] = []
    for key in sorted(set(base) | set(cand)):
        b, c = base.get(key), cand.get(key)
        common = dict(
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
            side = "both" if b.status != "ok" and c.status != "ok" else ("baseline" if b.status != "ok" else "candidate")
            not_ok.append(ScenarioIssue("not_ok", side=side, **common))
            continue
        if b.hash != c.hash:
            mismatched.append(ScenarioIssue("mismatched", **common))
            continue
        compared.append(key)
        for name in sorted(set(b.metrics) | set(c.metrics)):
            rows.append(_row(key[0], key[1], name, b.metrics.get(name), c.metrics.get(name), tolerance))
    return Comparison(
        rows=tuple(rows),
        compared=tuple(compared),
        missing_in_candidate=tuple(missing_c),
        missing_in_baseline=tuple(missing_b),
        not_ok=tuple(not_ok),
        mismatched=tuple(mismatched),
        tolerance=tolerance,
        base_groups=base,
        cand_groups=cand,
    )


def compare_paths(base: str | Path, cand: str | Path, tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """``compare`` over two sides given as files or folders (``load_results`` on each)."""
    return compare(load_results(Path(base)), load_results(Path(cand)), tolerance)


# --------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateResult:
    exit_code: int
    """1 on any regression, scenario missing in the candidate, not ok in the candidate or
    mismatched; 0 otherwise."""
    report: str
    """Readable text: a header line with the counts, then one line per finding."""
    comparison: Comparison
    """The comparison with verdicts at the gate's tolerance."""
    failures: tuple[str, ...]
    """The report lines that made the gate fail."""

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


def gate(comparison: Comparison, tolerance: float | None = None) -> GateResult:
    """Decide pass/fail. ``tolerance`` (a fraction) recomputes the verdicts; None keeps the
    comparison's own."""
    if tolerance is not None:
        _check_tolerance(tolerance)
        comparison = comparison.with_tolerance(tolerance)
    tol = comparison.tolerance

    failures: list[str] = []
    for row in comparison.regressions:
        failures.append(_finding("REGRESSION", row, tol))
    for issue in comparison.missing_in_candidate + comparison.not_ok + comparison.mismatched:
        if issue.fails_gate:
            failures.append(issue.describe())

    notes: list[str] = []
    for issue in comparison.not_ok:
        if not issue.fails_gate:
            notes.append(issue.describe())
    for issue in comparison.missing_in_baseline:
        notes.append(issue.describe())
    for row in comparison.rows_with("missing"):
        side = "candidate" if row.cand is None else "baseline"
        notes.append(f"NOTE {row.scenario} {row.metric}: metric missing in the {side} [{row.machine}]")
    for row in comparison.improvements:
        notes.append(_finding("IMPROVED", row, tol))

    counts = comparison.counts()
    exit_code = 1 if failures else 0
    header = (
        f"{'FAIL' if exit_code else 'PASS'}: {len(comparison.compared)} scenario(s) compared, "
        f"{len(comparison.rows)} metric(s): {counts['regressed']} regressed, {counts['improved']} improved, "
        f"{counts['unchanged']} unchanged, {counts['info']} info, {counts['missing']} missing; "
        f"scenarios: {len(comparison.missing_in_candidate)} missing in candidate, "
        f"{len(comparison.missing_in_baseline)} only in candidate, {len(comparison.not_ok)} not ok, "
        f"{len(comparison.mismatched)} mismatched (tolerance {format_percent(tol)})"
    )
    report = "\n".join([header, *failures, *notes]) + "\n"
    return GateResult(exit_code=exit_code, report=report, comparison=comparison, failures=tuple(failures))


def _finding(label: str, row: MetricRow, tolerance: float) -> str:
    return (
        f"{label} {row.scenario} {row.metric}: {format_number(row.base)} -> {format_number(row.cand)} "
        f"(x{format_ratio(row.ratio)}, tolerance {format_percent(tolerance)}, {format_noise(row.noise, row.exact)}) "
        f"{row.unit} [{row.machine}]"
    )


# --------------------------------------------------------------------------------------------
# Tolerance and formatting
# --------------------------------------------------------------------------------------------


def _check_tolerance(tolerance: float) -> None:
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")


def parse_tolerance(text: str | float) -> float:
    """``"5%"`` -> 0.05, ``"0.05"`` -> 0.05, ``"2.5 %"`` -> 0.025. Raises ValueError otherwise.

    A bare number must be a fraction in [0, 1) (``"5"`` is rejected as ambiguous); a percentage
    must be in [0, 100).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        _check_tolerance(float(text))
        return float(text)
    if not isinstance(text, str):
        raise ValueError(f"tolerance must be a string such as '5%' or '0.05', got {text!r}")
    raw = text.strip()
    percent = raw.endswith("%")
    number = raw[:-1].strip() if percent else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"invalid tolerance {text!r}: expected a percentage such as '5%' or a fraction such as '0.05'") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"invalid tolerance {text!r}: must be a finite, non-negative number")
    if percent:
        if value >= 100:
            raise ValueError(f"invalid tolerance {text!r}: a percentage must be below 100%")
        return value / 100.0
    if value >= 1:
        raise ValueError(
            f"invalid tolerance {text!r}: a bare number is a fraction and must be below 1; "
            f"write '{raw}%' for a percentage"
        )
    return value


def format_number(value: float | None) -> str:
    """Compact: integers below a million exactly (1000), else 4 significant digits (812.5, 0.4321,
    1.288e+10, 1.2e-07)."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1e6 or (0 < magnitude < 1e-4):
        return f"{value:.4g}"
    if value == int(value):
        return str(int(value))
    decimals = max(0, 3 - math.floor(math.log10(magnitude)))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.3f}" if math.isfinite(ratio) else str(ratio)


def format_percent(fraction: float | None, decimals: int | None = None) -> str:
    """0.05 -> "5%", 0.025 -> "2.5%"; with ``decimals``: 0.0312 -> "3.1%"."""
    if fraction is None:
        return "-"
    if decimals is None:
        return f"{fraction * 100:.4g}%"
    return f"{fraction * 100:.{decimals}f}%"


def format_noise(noise: float | None, exact: bool) -> str:
    """``noise 3.1%``, or ``exact value`` for a metric without a spread (no noise allowance)."""
    return "exact value" if exact else f"noise {format_percent(noise, 1)}"


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

_COLUMNS = ("scenario", "metric", "unit", "base", "cand", "ratio", "noise", "verdict")


def _table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    multi_machine = len({r.machine for r in comparison.rows}) > 1
    header = list(_COLUMNS)
    if multi_machine:
        header.insert(1, "machine")
    body = []
    for r in comparison.rows:
        cells = [
            r.scenario, r.metric, r.unit, format_number(r.base), format_number(r.cand),
            format_ratio(r.ratio), "exact" if r.exact and r.noise is not None else format_percent(r.noise, 1),
            r.verdict,
        ]
        if multi_machine:
            cells.insert(1, r.machine)
        body.append(cells)
    return header, body


def render_table(comparison: Comparison) -> str:
    """Plain-text table of every metric row (a machine column appears when rows span machines)."""
    header, body = _table_rows(comparison)
    if not body:
        return "(no metrics compared)\n"
    numeric = {"base", "cand", "ratio", "noise"}
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if header[i] in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in body)]) + "\n"


_VERDICT_STYLE = {"regressed": "bold red", "improved": "green", "unchanged": "", "info": "dim", "missing": "yellow"}


def render_rich_table(comparison: Comparison, title: str | None = None):
    """The same table as a ``rich.table.Table`` (verdicts coloured)."""
    from rich.table import Table
    from rich.text import Text

    header, body = _table_rows(comparison)
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="right" if name in {"base", "cand", "ratio", "noise"} else "left")
    for cells in body:
        verdict = cells[-1]
        style = _VERDICT_STYLE.get(verdict, "")
        table.add_row(*(Text(c) for c in cells[:-1]), Text(verdict, style=style))
    return table


def to_json(comparison: Comparison) -> str:
    """The comparison as indented JSON text."""
    return json.dumps(comparison.to_dict(), indent=2) + "\n"
