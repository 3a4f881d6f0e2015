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
* a change beyond the tolerance but within the noise: verdict ``inconclusive`` (the two runs are too
  noisy to tell; reported, not gated); a change within the tolerance is ``unchanged``;
* ``better is None``: verdict ``info``, reported and never gated (``outside_noise`` is still
  computed);
* a metric on one side only: verdict ``missing`` (reported, not gated).

The direction (``better``) and unit are taken from the candidate when both sides have the metric.

Scenario-level outcomes are listed explicitly, never silently passed: ``missing_in_candidate``,
``missing_in_baseline`` (new scenario; not a failure), ``not_ok`` (status other than ``ok`` on
either side, with status and error) and ``mismatched`` (the scenario differs between the sides: a
changed scenario is not a like-for-like comparison, so no metric rows are produced for it). Two
sides run the same scenario when their hashes agree, or when one side's spec, loaded by today's
``bench.scenario`` (which fills the fields added since that version at their defaults), equals the
other's: a release that adds a config field with a default leaves the scenario files it did not
touch comparable with the releases before it, and a changed default is an engine change the
comparison measures.

Work counters
-------------
The ``work_*`` metrics of an execute run (``bench.run.work``: matmul FLOPs, allocated bytes, ops,
host syncs, collective calls and bytes of one step) are exact counts, the same on every run of the
same code. They are gated exactly, whatever the tolerance and the noise: any increase is a
regression, any decrease an improvement. Each increase is reported with its own verdict, drawn
from the two sides' censuses (``details.work``): ``work increased: +1 all_reduce of 4 MiB per step
(dp)``, ``work increased: +3.1% matmul FLOPs per step (...): aten.mm +1.6e+06``; a decrease is
``work decreased: ...`` and does not fail. A change meant to do more work passes when its metrics
are accepted (``accept_work``: the CLI's ``--accept-work``), and the report says so: ``work
increased (accepted): ...``. ``work_verdicts`` gives these lines for any two documents (the A/B
gate calls it for its two sides). Where one side has no work counters (a document from before
them) there is no work verdict, only the note ``no work counters on one side``.

Accepted changes
----------------
A change made on purpose is accepted by name: ``METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%:
REASON`` (``parse_acceptance``), e.g. ``peak_tensor_bytes@e8-random-bf16<=6%: fp32 gradient
buffers``. A regression of a named metric on a named scenario that is at most N% worse passes with
the verdict ``accepted`` and the report says why (``accepted: fp32 gradient buffers (release 0.2.0,
up to 6%)``); a larger change, another metric or another scenario regresses as before, and the
failure names the acceptance it went beyond. A release records its acceptances in
``releases.json`` (``bench.release.record``); they apply to a comparison whose baseline is older
than that release and whose candidate is that release or newer (``Acceptance.applies``), so they
stop applying once the baseline has the change. An acceptance given on the command line applies to
every comparison. Several acceptances of one metric on one scenario compound (5% twice accepts
10.25%).

``gate`` fails (exit code 1) on any regressed metric, any work increase not accepted, any scenario
missing in the candidate, any scenario not ``ok`` in the candidate and any mismatched scenario;
otherwise it passes (0). The one exception: a scenario ``skipped`` on both sides (e.g. a CUDA-only
scenario in two CPU runs) is listed in ``not_ok`` but does not fail. Scenarios only in the
candidate, not ok only in the baseline, metrics on one side only, improvements, accepted changes,
inconclusive and ``info`` metrics are reported, not failed.

Everything here is a pure function over loaded documents; the ``moe-bench`` CLI does the I/O.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from packaging.version import InvalidVersion, Version

from bench.results import ResultDocument, load_results, metric

DEFAULT_TOLERANCE = 0.05
"""Default relative tolerance (5%)."""

VERDICTS = ("regressed", "accepted", "inconclusive", "improved", "unchanged", "info", "missing")

_EPS = 1e-12  # |ratio - 1| must exceed the threshold by more than rounding error.

NOISE_FLOORS = {"rss_peak_bytes": 0.10}
"""Run-to-run noise of metrics recorded with one sample that are not exact all the same.

A process's RSS high-water mark includes the interpreter, the libraries and the allocator's caches:
six runs of identical code of each ci-suite scenario on a 2-core CPU machine spanned 1.9-5.4% (the
tracked ``peak_tensor_bytes`` of the same runs was identical), and A/B runs against a release have
moved it by -4.6% to +3.1% with no change of the tensors. Their noise is at least this floor, so a
large leak fails the gate and the allocator's mood does not."""

WORK_PREFIX = "work_"
WORK_METRICS = (
    "work_matmul_flops",
    "work_allocated_bytes",
    "work_aten_ops",
    "work_host_syncs",
    "work_collective_calls",
    "work_collective_bytes",
)
"""The gated work counters (``bench.run.work``), in report order; ``work_flops_ratio`` is reported,
never gated (the FLOPs are)."""

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


def _with_todays_defaults(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    from bench.scenario import ScenarioError, scenario_from_dict

    try:
        return scenario_from_dict(json.loads(json.dumps(spec))).spec
    except (ScenarioError, ValueError, KeyError, TypeError):
        return None


def same_scenario(base: "Group", cand: "Group") -> bool:
    """Whether two sides ran the same scenario (module docstring, scenario-level outcomes)."""
    if base.hash == cand.hash:
        return True
    base_spec = base.newest.data["scenario"].get("spec")
    cand_spec = cand.newest.data["scenario"].get("spec")
    if base_spec is None or cand_spec is None:
        return False
    return _with_todays_defaults(base_spec) == cand_spec or _with_todays_defaults(cand_spec) == base_spec


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
            "work": work_findings(self),
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
        beyond_tolerance = abs(ratio - 1.0) > tolerance + _EPS
        return outside, "inconclusive" if beyond_tolerance else "unchanged"
    went_up = ratio > 1.0
    if better == "higher":
        return outside, "improved" if went_up else "regressed"
    if better == "lower":
        return outside, "regressed" if went_up else "improved"
    raise ValueError(f"metric direction must be 'higher', 'lower' or null, got {better!r}")


def is_work_metric(name: str) -> bool:
    """A work counter (``work_*``): compared exactly, see the module doc."""
    return name.startswith(WORK_PREFIX)


def _evaluate(row: MetricRow, tolerance: float) -> MetricRow:
    """Fill in ratio, noise, threshold and verdict from the row's medians and spreads."""
    if row.base is None or row.cand is None:
        return replace(row, ratio=None, noise=None, threshold=None, outside_noise=False, verdict="missing",
                       accepted=None)
    ratio = paired_ratio(row.base, row.cand)
    if is_work_metric(row.metric) and row.better is not None:
        # Exact counts: any change counts, whatever the tolerance.
        changed = row.cand != row.base
        worse = row.cand > row.base if row.better == "lower" else row.cand < row.base
        verdict = "unchanged" if not changed else ("regressed" if worse else "improved")
        return replace(row, ratio=ratio, noise=0.0, threshold=0.0, outside_noise=changed, verdict=verdict, exact=True,
                       accepted=None)
    noise = 0.0 if row.exact else (row.base_rel_iqr or 0.0) + (row.cand_rel_iqr or 0.0)
    noise = max(noise, NOISE_FLOORS.get(row.metric, 0.0))
    outside, verdict = classify(ratio, noise, row.better, tolerance)
    return replace(
        row, ratio=ratio, noise=noise, threshold=max(tolerance, noise), outside_noise=outside, verdict=verdict,
        accepted=None,
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
        if not same_scenario(b, c):
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
# Work counters
# --------------------------------------------------------------------------------------------

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


def _accepted(accept: Collection[str] | bool | None) -> frozenset[str]:
    if accept is True:
        return frozenset(WORK_METRICS)
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
    has = [_has_work_counters(base_metrics), _has_work_counters(cand_metrics)]
    if not any(has):
        return []
    if not all(has):
        side = "baseline" if not has[0] else "candidate"
        return [f"NOTE {scenario}: no work counters on one side (the {side}); work not compared{where}"]
    accepted = _accepted(accept)
    base_ranks, cand_ranks = _work_ranks(base_details), _work_ranks(cand_details)
    lines = []
    for name in WORK_METRICS:
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
            lines.append(f"NOTE {scenario} {name}: work increased (accepted: {describe_acceptances(named)}): "
                         f"{text}{where}")
        else:
            lines.append(f"REGRESSION {scenario} {name}: work increased: {text}{where}{_beyond(named)}")
    return lines


def _has_work_counters(metrics: Mapping[str, Any]) -> bool:
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
        lines += work_verdicts(key[0], _group_side(base), _group_side(cand), accept, machine=key[1],
                               acceptances=_applicable(comparison, key, acceptances))
    return lines


def _group_side(group: Group) -> tuple[dict[str, Any], dict[str, Any]]:
    newest = group.pooled[-1] if group.pooled else group.newest
    return group.metrics, newest.data.get("details") or {}


def _work_ranks(details: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """rank -> that rank's work census (``details.work.ranks``); {} when the document has none."""
    work = details.get("work") or {}
    return {int(r.get("rank", i)): r for i, r in enumerate(work.get("ranks") or [])}


def describe_work_change(
    name: str, base: float, cand: float,
    base_ranks: Mapping[int, Mapping[str, Any]], cand_ranks: Mapping[int, Mapping[str, Any]],
) -> str:
    """What changed in one work metric, per step: the total, then the census entries that moved
    (``base_ranks``, ``cand_ranks``: rank -> census, as in ``details.work.ranks``; may be empty)."""
    delta = cand - base
    ranks = sorted(set(base_ranks) | set(cand_ranks))
    if name in ("work_collective_calls", "work_collective_bytes"):
        changes = _collective_changes(base_ranks, cand_ranks, ranks)
        if name == "work_collective_calls":
            # The census says it all: "+1 all_reduce of 4 MiB per step (dp)".
            head = f"{_signed_count(delta)} collective calls per step ({format_number(base)} -> {format_number(cand)})"
            return "; ".join(changes) if changes else head
        head = f"{_signed_bytes(delta)} of collectives per step ({format_bytes(base)} -> {format_bytes(cand)})"
        return head + (": " + "; ".join(changes) if changes else "")
    relative = format_signed_percent(delta / base) if base else None
    totals = f"{format_number(base)} -> {format_number(cand)}"
    if name == "work_matmul_flops":
        head = f"{relative or _signed_number(delta)} matmul FLOPs per step ({totals})"
    elif name == "work_allocated_bytes":
        head = (f"{_signed_bytes(delta)} allocated per step "
                f"({relative + ', ' if relative else ''}{format_bytes(base)} -> {format_bytes(cand)})")
    elif name == "work_host_syncs":
        head = f"{_signed_count(delta)} host sync{'s' * (abs(delta) != 1)} per step ({totals})"
    else:
        plural = "s" * (abs(delta) != 1)
        head = f"{_signed_count(delta)} op{plural} per step ({relative + ', ' if relative else ''}{totals})"
    census_field, kind = _WORK_CENSUS.get(name, (None, "count"))
    changes = _census_changes(census_field, kind, base_ranks, cand_ranks, ranks) if census_field else []
    return head + (": " + ", ".join(changes) if changes else "")


def _census_changes(census_field: str, kind: str, base_ranks, cand_ranks, ranks: list[int]) -> list[str]:
    """``aten.clone.default +2`` per changed census entry, the largest changes first."""
    fmt = {"bytes": _signed_bytes, "flops": _signed_number, "count": _signed_count}[kind]
    keys = set()
    for side in (base_ranks, cand_ranks):
        for census in side.values():
            keys |= set(census.get(census_field) or {})
    moved = []
    for key in keys:
        per_rank = {r: float((cand_ranks.get(r, {}).get(census_field) or {}).get(key, 0))
                    - float((base_ranks.get(r, {}).get(census_field) or {}).get(key, 0)) for r in ranks}
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
        return f"{op} ({group}) {_signed_bytes(nbytes)} per step over the same {cand_calls} call{plural}"
    return f"{calls:+d} {op} per step ({group}), {_signed_bytes(nbytes)} in all"


def _per_rank_text(per_rank: dict[int, float], fmt) -> str:
    """``+2``, ``+2 on each of 2 ranks``, or ``+2 on rank 0, +1 on rank 1``."""
    if len(per_rank) == 1:
        return fmt(next(iter(per_rank.values())))
    values = set(per_rank.values())
    if len(values) == 1:
        return f"{fmt(values.pop())} on each of {len(per_rank)} ranks"
    return ", ".join(f"{fmt(d)} on rank {r}" for r, d in per_rank.items() if d)


# --------------------------------------------------------------------------------------------
# Accepted changes
# --------------------------------------------------------------------------------------------

GATED_METRICS = (
    "step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "rank_tokens_per_s", "dropped_tokens",
    "peak_tensor_bytes", "rss_peak_bytes", "cuda_peak_active_bytes", "cuda_peak_reserved_bytes",
    "optimizer_state_bytes", "checkpoint_save_s", "checkpoint_stall_s", "checkpoint_load_s",
    "checkpoint_bytes_per_rank", "checkpoint_bytes_total",
    *(f"memory_{part}_bytes" for part in ("params", "grads", "optimizer", "activations", "comm_buffers",
                                          "backward_workspace", "optimizer_step", "total")),
    "memory_fraction_of_gpu",
    *(f"comm_{part}_bytes" for part in ("all_to_all", "grad_reduce", "pipeline", "total")),
    *WORK_METRICS,
)
"""The metrics with a direction that execute, proxy and plan runs write (``bench.run.execute``,
``bench.run.proxy``, ``bench.predict.plan``), and the work counters: an acceptance names one of them,
or a metric of the documents it is checked against (``check_metric_names``)."""

ACCEPT_FORMAT = "METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%: REASON"
_METRIC_NAME = re.compile(r"[A-Za-z0-9_]+")
_SCENARIO_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


@dataclass(frozen=True)
class Acceptance:
    """A change of named metrics on named scenarios made on purpose (module doc, Accepted changes)."""

    metrics: tuple[str, ...]
    """The metrics whose regression is accepted."""
    scenarios: tuple[str, ...]
    """The scenarios on which it is accepted."""
    max_change: float
    """The largest change accepted, as a fraction in the worse direction (0.06: 6% worse)."""
    reason: str
    """Why the change is made; the report shows it in place of "regressed"."""
    release: str | None = None
    """The release that made the change (``releases.json``); None for one given on the command line."""

    @property
    def spec(self) -> str:
        """The text ``parse_acceptance`` reads back (what ``releases.json`` stores)."""
        return f"{','.join(self.metrics)}@{','.join(self.scenarios)}<={format_percent(self.max_change)}: {self.reason}"

    def applies(self, base_version: str | None, cand_version: str | None) -> bool:
        """Whether it applies to a baseline and a candidate of these engine versions: a release's when the
        baseline is older than the release and the candidate is that release or newer; one given on
        the command line always."""
        if self.release is None:
            return True
        try:
            return Version(base_version) < Version(self.release) <= Version(cand_version)
        except (InvalidVersion, TypeError):
            return False

    def describe(self) -> str:
        """``fp32 gradient buffers (release 0.2.0, up to 6%)``."""
        source = f"release {self.release}" if self.release else "--accept"
        return f"{self.reason} ({source}, up to {format_percent(self.max_change)})"


def parse_acceptance(text: str, release: str | None = None) -> Acceptance:
    """``METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%: REASON``; raises ValueError (one line) otherwise.

    The size is required: an acceptance never covers a change larger than the one it was given for.
    """
    expected = f"expected {ACCEPT_FORMAT}"
    if not isinstance(text, str) or "\n" in text:
        raise ValueError(f"{text!r}: not one line of text; {expected}")
    head, colon, reason = text.partition(":")
    names, at, rest = head.partition("@")
    scenarios, le, size = rest.partition("<=")
    if not at:
        raise ValueError(f"{text!r}: no '@' between the metric and the scenarios; {expected}")
    if not le:
        raise ValueError(f"{text!r}: no accepted size (such as <=6%) after the scenarios; {expected}")
    if not colon or not reason.strip():
        raise ValueError(f"{text!r}: no reason after ':'; {expected}")
    metric_names = tuple(n.strip() for n in names.split(","))
    scenario_names = tuple(n.strip() for n in scenarios.split(","))
    bad = next((n for n in metric_names if not _METRIC_NAME.fullmatch(n)), None)
    if bad is not None:
        raise ValueError(f"{text!r}: {bad!r} is not a metric name; {expected}")
    bad = next((n for n in scenario_names if not _SCENARIO_NAME.fullmatch(n)), None)
    if bad is not None:
        raise ValueError(f"{text!r}: {bad!r} is not a scenario name; {expected}")
    size = size.strip()
    try:
        fraction = float(size[:-1]) / 100 if size.endswith("%") else math.nan
    except ValueError:
        fraction = math.nan
    if not math.isfinite(fraction) or fraction <= 0:
        raise ValueError(f"{text!r}: the accepted size {size!r} is not a percentage above 0, such as 6%")
    return Acceptance(metric_names, scenario_names, fraction, reason.strip(), release)


def check_metric_names(acceptances: Iterable[Acceptance], docs: Iterable[ResultDocument] = ()) -> None:
    """Raise ValueError (one line) for a metric that is neither gated (``GATED_METRICS``) nor in ``docs``:
    an acceptance of a misspelt metric would accept nothing, silently."""
    known = set(GATED_METRICS)
    for doc in docs:
        known |= {name for name, entry in doc.metrics.items() if entry.get("better") is not None}
    for acceptance in acceptances:
        unknown = [name for name in acceptance.metrics if name not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"gated metrics: {', '.join(GATED_METRICS)}"
            raise ValueError(f"{acceptance.spec!r}: unknown metric {unknown[0]} ({hint})")


def acceptance_of(
    acceptances: Iterable[Acceptance], name: str, scenario: str, ratio: float | None, better: str | None
) -> tuple[tuple[Acceptance, ...], bool]:
    """The acceptances naming metric ``name`` on ``scenario``, and whether a change of ``ratio`` (cand /
    base) in the direction ``better`` is within them (their sizes compound)."""
    named = tuple(a for a in acceptances if name in a.metrics and scenario in a.scenarios)
    if not named or ratio is None or better not in ("higher", "lower"):
        return named, False
    if better == "lower":
        return named, ratio <= math.prod(1 + a.max_change for a in named) + _EPS
    return named, ratio >= math.prod(1 - a.max_change for a in named) - _EPS


def describe_acceptances(named: Iterable[Acceptance]) -> str:
    return "; ".join(a.describe() for a in named)


def _beyond(named: Sequence[Acceptance]) -> str:
    """What a regression that acceptances name went beyond (empty when none names it)."""
    return f"; beyond the accepted change: {describe_acceptances(named)}" if named else ""


def _applicable(comparison: Comparison, key: Key, acceptances: Iterable[Acceptance]) -> tuple[Acceptance, ...]:
    """The acceptances that apply to the two versions compared for ``key``."""
    base, cand = comparison.base_groups.get(key), comparison.cand_groups.get(key)
    base_version = base.version if base is not None else None
    cand_version = cand.version if cand is not None else None
    return tuple(a for a in acceptances if a.applies(base_version, cand_version))


def accept_changes(
    comparison: Comparison,
    accept_work: Collection[str] | bool | None = None,
    acceptances: Sequence[Acceptance] = (),
) -> Comparison:
    """The comparison with each accepted regression's verdict ``accepted`` (and its ``accepted``
    reason): a work increase accepted by ``accept_work``, or a change within ``acceptances``."""
    work_names = _accepted(accept_work)
    rows = []
    for row in comparison.rows:
        if row.verdict == "regressed":
            applicable = _applicable(comparison, (row.scenario, row.machine), acceptances)
            named, within = acceptance_of(applicable, row.metric, row.scenario, row.ratio, row.better)
            if is_work_metric(row.metric) and row.metric in work_names:
                row = replace(row, verdict="accepted", accepted="--accept-work")
            elif within:
                row = replace(row, verdict="accepted", accepted=describe_acceptances(named))
        rows.append(row)
    return replace(comparison, rows=tuple(rows))


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
    work: tuple[str, ...] = ()
    """The work verdicts (``work_verdicts`` of every compared scenario), failing or not."""

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


def gate(
    comparison: Comparison,
    tolerance: float | None = None,
    accept_work: Collection[str] | bool | None = None,
    acceptances: Sequence[Acceptance] = (),
) -> GateResult:
    """Decide pass/fail. ``tolerance`` (a fraction) recomputes the verdicts; None keeps the
    comparison's own. ``accept_work``: the work metrics whose increase passes (True: every one).
    ``acceptances``: changes made on purpose, each applied where its versions say (module doc)."""
    if tolerance is not None:
        _check_tolerance(tolerance)
        comparison = comparison.with_tolerance(tolerance)
    comparison = accept_changes(comparison, accept_work, acceptances)
    tol = comparison.tolerance
    work = work_findings(comparison, accept_work, acceptances)
    # Where one side has no work counters that is said once ("no work counters on one side"), not
    # once per work metric missing.
    uncounted = {
        key for key in comparison.compared if key in comparison.base_groups and key in comparison.cand_groups
        and _has_work_counters(comparison.base_groups[key].metrics)
        != _has_work_counters(comparison.cand_groups[key].metrics)
    }

    failures: list[str] = []
    for row in comparison.regressions:
        if not is_work_metric(row.metric):
            applicable = _applicable(comparison, (row.scenario, row.machine), acceptances)
            named, _ = acceptance_of(applicable, row.metric, row.scenario, row.ratio, row.better)
            failures.append(_finding("REGRESSION", row, tol) + _beyond(named))
    failures += [line for line in work if line.startswith("REGRESSION")]
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
        if is_work_metric(row.metric) and (row.scenario, row.machine) in uncounted:
            continue
        side = "candidate" if row.cand is None else "baseline"
        notes.append(f"NOTE {row.scenario} {row.metric}: metric missing in the {side} [{row.machine}]")
    notes += accepted_lines(comparison)
    for row in comparison.improvements:
        if not is_work_metric(row.metric):
            notes.append(_finding("IMPROVED", row, tol))
    notes += [line for line in work if not line.startswith("REGRESSION")]

    counts = comparison.counts()
    accepted_work = sum("work increased (accepted" in line for line in work)
    exit_code = 1 if failures else 0
    header = (
        f"{'FAIL' if exit_code else 'PASS'}: {len(comparison.compared)} scenario(s) compared, "
        f"{len(comparison.rows)} metric(s): {counts['regressed']} regressed, {counts['accepted']} accepted"
        f"{f' ({accepted_work} accepted work increase' + 's' * (accepted_work != 1) + ')' if accepted_work else ''}, "
        f"{counts['inconclusive']} inconclusive, {counts['improved']} improved, "
        f"{counts['unchanged']} unchanged, {counts['info']} info, {counts['missing']} missing; "
        f"scenarios: {len(comparison.missing_in_candidate)} missing in candidate, "
        f"{len(comparison.missing_in_baseline)} only in candidate, {len(comparison.not_ok)} not ok, "
        f"{len(comparison.mismatched)} mismatched (tolerance {format_percent(tol)})"
    )
    report = "\n".join([header, *failures, *notes]) + "\n"
    return GateResult(exit_code=exit_code, report=report, comparison=comparison, failures=tuple(failures),
                      work=tuple(work))


def accepted_lines(comparison: Comparison) -> list[str]:
    """``ACCEPTED ...: accepted: <reason>`` for each accepted row (work counters have their work lines)."""
    return [f"{_finding('ACCEPTED', row, comparison.tolerance)}; accepted: {row.accepted}"
            for row in comparison.rows_with("accepted") if not is_work_metric(row.metric)]


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


def format_signed_percent(fraction: float) -> str:
    """0.0312 -> "+3.1%", -0.5 -> "-50.0%"; changes below 0.05% keep two significant digits (+0.0012%)."""
    percent = fraction * 100
    return f"{percent:+.1f}%" if abs(percent) >= 0.05 or percent == 0 else f"{percent:+.2g}%"


def format_bytes(value: float) -> str:
    """Binary units: 512 -> "512 B", 4194304 -> "4 MiB", 1536 -> "1.5 KiB"."""
    magnitude, unit = abs(value), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if magnitude < 1024 or unit == "TiB":
            break
        magnitude /= 1024
    sign = "-" if value < 0 else ""
    return f"{sign}{magnitude:.4g} {unit}"


def _signed_bytes(value: float) -> str:
    return ("+" if value >= 0 else "") + format_bytes(value)


def _signed_count(value: float) -> str:
    return f"{int(value):+d}" if value == int(value) else f"{value:+g}"


def _signed_number(value: float) -> str:
    return ("+" if value >= 0 else "") + format_number(value)


def format_noise(noise: float | None, exact: bool) -> str:
    """``noise 3.1%``, or ``exact value`` for a metric without a spread (no noise allowance)."""
    return "exact value" if exact and not noise else f"noise {format_percent(noise, 1)}"


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
            format_ratio(r.ratio), "exact" if r.exact and r.noise == 0 else format_percent(r.noise, 1),
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


_VERDICT_STYLE = {"regressed": "bold red", "accepted": "cyan", "inconclusive": "magenta", "improved": "green",
                  "unchanged": "", "info": "dim", "missing": "yellow"}


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
