"""A/B gate: a baseline git ref against this checkout in one job, timed by resident workers.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.ab.deadline import SuiteDeadline
from bench.ab.plan import ABError, ABPlan
from bench.ab.resident import (
    ResidentComparison,
    WorkerDied,
    WorkerFailedToStart,
    compare_resident,
    fresh_pair,
)
from bench.ab.sides import START_MARGIN_S, SideRun, run_side, side_summary
from bench.gate import paired
from bench.gate.accept import Acceptance, acceptance_of, describe_acceptances
from bench.gate.compare import classify, is_work_metric, paired_ratio
from bench.gate.formatting import format_noise
from bench.gate.paired import PooledEstimate, fails, scenario_level, se_limit_false_alarms, warns
from bench.gate.work import work_verdicts
from bench.metrics import names, noise_floor
from bench.results import REPO_ROOT
from bench.scenario import Scenario
from bench.units import format_number, format_percent, format_ratio

logger = logging.getLogger(__name__)

SIDES = ("baseline", "candidate")


# --------------------------------------------------------------------------------------------
# The paired gate (pure arithmetic)
# --------------------------------------------------------------------------------------------


ACCEPTABLE_INCREASES = names(acceptable_increase=True)
"""Exact metrics whose regression ``--accept-increase`` may accept: memory a change costs on purpose.
Timings never (the resident blocks gate them); work counters have ``--accept-work``."""


@dataclass(frozen=True)
class PairedMetric:
    scenario: str
    metric: str
    unit: str
    better: str | None
    base: float
    """Median of the baseline runs' medians."""
    cand: float
    ratios: tuple[float, ...]
    """cand / base of each pair, in run order."""
    ratio: float
    """Median of ``ratios``."""
    noise: float
    """Interquartile range of ``ratios`` (0 when ``exact``), at least the metric's noise floor (``bench.metrics``)."""
    verdict: str
    """regressed, inconclusive, improved, unchanged or info (``bench.gate.compare.classify``), or accepted:
    a regression within an accepted change, or of an exact metric the job accepts (``--accept-increase``)."""
    exact: bool = False
    """No run has a spread for this metric (one sample each): compared as an exact value."""
    accepted: str | None = None
    """The accepted changes a regression is within (verdict accepted); None for ``--accept-increase``."""


@dataclass
class ABReport:
    baseline: str
    candidate: str
    tolerance: float
    pairs: int
    """Full runs per side (one, plus the resident blocks)."""
    metrics: list[PairedMetric] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    resident: list[ResidentComparison] = field(default_factory=list)
    """The paired block timings, one per execute scenario compared."""
    work: list[str] = field(default_factory=list)
    """Work-counter findings; those starting with REGRESSION fail the gate."""
    acceptances: list[Acceptance] = field(default_factory=list)
    """The accepted changes that apply to the two sides (``bench.gate.accept``);
    the resident blocks' step time is accepted by those naming ``step_time_s``."""
    warn_above: float | None = None
    """A passing step-time estimate beyond this is a WARNING line (``bench.gate.paired.warns``)."""

    def warned(self, r: ResidentComparison) -> bool:
        """Whether the blocks passed with an estimate beyond the warning threshold."""
        return (
            r.estimate is not None and not self.resident_fails(r) and warns(r.estimate, self.warn_above, self.tolerance)
        )

    def noise_limit(self) -> float:
        """The standard error up to which the gate's false-alarm rate holds for this many scenarios
        (``bench.gate.paired.se_limit_false_alarms`` at the suite's level per scenario)."""
        scenarios = max(1, sum(r.estimate is not None for r in self.resident))
        return se_limit_false_alarms(self.tolerance, scenario_level(paired.SUITE_FALSE_ALARMS, scenarios))

    def resident_verdict(self, r: ResidentComparison) -> str:
        """The blocks' verdict, ``accepted`` for a failing slowdown within the accepted changes of its step time."""
        if r.estimate is not None and fails(r.estimate, self.tolerance):
            _, within = acceptance_of(self.acceptances, "step_time_s", r.scenario, 1 + r.estimate.slowdown, "lower")
            if within:
                return "accepted"
        return r.verdict

    def resident_fails(self, r: ResidentComparison) -> bool:
        """Whether the blocks fail the gate: an estimate beyond the tolerance not accepted, or no estimate
        where one was due."""
        if r.estimate is None:
            return r.verdict in ("regressed", "inconclusive")
        return fails(r.estimate, self.tolerance) and self.resident_verdict(r) != "accepted"

    def _named(self, scenario: str, name: str) -> tuple[Acceptance, ...]:
        return acceptance_of(self.acceptances, name, scenario, None, None)[0]

    @property
    def exit_code(self) -> int:
        return (
            1
            if (
                self.failures
                or any(m.verdict == "regressed" for m in self.metrics)
                or any(self.resident_fails(r) for r in self.resident)
                or any(w.startswith("REGRESSION") for w in self.work)
            )
            else 0
        )

    def render(self) -> str:
        verdicts = [m.verdict for m in self.metrics] + [self.resident_verdict(r) for r in self.resident]
        counts = {v: verdicts.count(v) for v in ("regressed", "improved", "unchanged", "inconclusive", "accepted")}
        scenarios = len({m.scenario for m in self.metrics} | {r.scenario for r in self.resident})
        accepted = f", {counts['accepted']} accepted" if counts["accepted"] else ""
        warned = [r for r in self.resident if self.warned(r)]
        warning = (
            f", {len(warned)} warned (warning above {format_percent(self.warn_above)})"
            if self.warn_above is not None
            else ""
        )
        header = (
            f"{'FAIL' if self.exit_code else 'PASS'}: A/B {self.baseline} -> {self.candidate}, "
            f"{scenarios} scenario(s) compared: {counts['regressed']} regressed, {counts['improved']} improved, "
            f"{counts['unchanged']} unchanged, {counts['inconclusive']} inconclusive{accepted}; "
            f"{len(self.failures)} not ok "
            f"(tolerance {format_percent(self.tolerance)}{warning})"
        )
        limit = self.noise_limit() if self.resident else 0.0
        cautions = [
            f"WARNING {r.scenario} step time: x{format_ratio(1 + r.estimate.slowdown)}, interval "
            f"[{format_ratio(1 + r.estimate.interval[0])}, {format_ratio(1 + r.estimate.interval[1])}] over "
            f"{len(r.pairs)} worker pairs: beyond the warning threshold {format_percent(self.warn_above)}, within "
            f"the tolerance {format_percent(self.tolerance)} (passed)"
            for r in warned
            if r.estimate is not None and self.warn_above is not None
        ] + [
            f"NOTE {r.scenario} step time: standard error {format_percent(r.estimate.se, 1)} over "
            f"{len(r.pairs)} worker pairs, beyond the {format_percent(limit, 1)} up to which the gate keeps its "
            "false-alarm rate (a noisy machine: docs/gates-and-releases.md#the-operating-point)"
            for r in self.resident
            if r.estimate is not None and r.estimate.se > limit
        ]
        columns = ("scenario", "metric", "unit", "base", "cand", "ratio", "interval / noise", "blocks", "verdict")
        rows = [
            (
                r.scenario,
                "step_time_s",
                "s",
                format_number(statistics.median(r.baseline_s) / r.steps_per_block),
                format_number(statistics.median(r.candidate_s) / r.steps_per_block),
                format_ratio(1 + r.estimate.slowdown),
                f"[{format_ratio(1 + r.estimate.interval[0])}, {format_ratio(1 + r.estimate.interval[1])}]",
                f"{len(r.pairs)} worker pairs, {r.block_pairs} x {r.steps_per_block} steps, "
                f"{r.seconds:.0f} s, {r.stopped_by}",
                self.resident_verdict(r),
            )
            for r in self.resident
            if r.estimate is not None
        ] + [
            (
                m.scenario,
                m.metric,
                m.unit,
                format_number(m.base),
                format_number(m.cand),
                format_ratio(m.ratio),
                "exact" if m.exact and not m.noise else format_percent(m.noise, 1),
                f"{len(m.ratios)} run(s)",
                m.verdict,
            )
            for m in self.metrics
        ]
        widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *rows]]
        findings = (
            [
                f"{'REGRESSION' if self.resident_verdict(r) == 'regressed' else 'ACCEPTED'} {r.scenario} step time: "
                f"x{format_ratio(1 + _estimate(r).slowdown)}, 95% interval "
                f"[{format_ratio(1 + _estimate(r).interval[0])}, {format_ratio(1 + _estimate(r).interval[1])}] over "
                f"{len(r.pairs)} worker pairs (tolerance {format_percent(self.tolerance)})"
                + _confirmation_text(r)
                + _acceptance_text(self._named(r.scenario, "step_time_s"), self.resident_verdict(r) == "accepted")
                for r in self.resident
                if r.verdict == "regressed"
            ]
            + [
                f"{'INCONCLUSIVE' if self.resident_fails(r) else 'NOTE'} {r.scenario} step time: "
                f"x{format_ratio(1 + r.estimate.slowdown)}, interval "
                f"[{format_ratio(1 + r.estimate.interval[0])}, {format_ratio(1 + r.estimate.interval[1])}] still admits "
                f"a slowdown of the tolerance after {len(r.pairs)} worker pairs ({r.seconds:.0f} s, "
                f"{STOPPED_BY_TEXT.get(r.stopped_by, r.stopped_by)}){_confirmation_text(r)}: "
                + (
                    "the estimate is beyond the tolerance and a regression cannot be ruled out; raise --budget"
                    if self.resident_fails(r)
                    else "inconclusive, passed: the estimate is within the tolerance (the gate's measured power: "
                    "docs/gates-and-releases.md)"
                )
                for r in self.resident
                if r.verdict == "inconclusive" and r.estimate is not None
            ]
            + [
                f"NOTE {r.scenario} step time: x{format_ratio(1 + r.unconfirmed.slowdown)} after "
                f"{r.unconfirmed.worker_pairs} worker pairs, not confirmed: x{format_ratio(1 + r.estimate.slowdown)} "
                f"over {len(r.pairs)} with the fresh ones ({r.verdict}, passed)"
                for r in self.resident
                if r.unconfirmed is not None and r.estimate is not None and not fails(r.estimate, self.tolerance)
            ]
            + [
                f"REGRESSION {m.scenario} {m.metric}: x{format_ratio(m.ratio)} "
                f"(tolerance {format_percent(self.tolerance)}, {format_noise(m.noise, m.exact)})"
                + _acceptance_text(self._named(m.scenario, m.metric), False)
                for m in self.metrics
                if m.verdict == "regressed"
            ]
            + [
                f"ACCEPTED {m.scenario} {m.metric}: x{format_ratio(m.ratio)} "
                f"(tolerance {format_percent(self.tolerance)}, {format_noise(m.noise, m.exact)}); accepted: {m.accepted}"
                if m.accepted
                else f"NOTE {m.scenario} {m.metric}: x{format_ratio(m.ratio)}, beyond the tolerance (accepted)"
                for m in self.metrics
                if m.verdict == "accepted"
            ]
        )
        table = lines if rows else ["(no metrics compared)"]
        return "\n".join([header, *table, *findings, *cautions, *self.work, *self.failures, *self.notes]) + "\n"


def _estimate(r: ResidentComparison) -> PooledEstimate:
    """The estimate behind a resident verdict (``compare_resident`` sets both from the second worker pair on)."""
    if r.estimate is None:
        raise ValueError(f"resident comparison of {r.scenario}: verdict {r.verdict!r} without an estimate")
    return r.estimate


STOPPED_BY_TEXT = {
    "budget": "its budget",
    "extension": "budget and its extension",
    "confirmation": "and the confirmation",
    "deadline": "its budget; the gate's time limit left no room to extend it",
}
"""How a resident comparison ended, as the inconclusive line says it (``ResidentComparison.stopped_by``)."""


def _confirmation_text(r: ResidentComparison) -> str:
    """``; confirmed: x<first> on the first <n> worker pairs`` for a failing estimate its confirmation kept,
    and what the gate's time limit cut of it (the extension before it, its fresh pairs)."""
    if r.unconfirmed is None or r.estimate is None:
        return ""
    refused = "; not extended: the gate's time limit had no room" if r.extension_refused else ""
    if r.confirmation_pairs == 0:
        return f"{refused}; not confirmed: the gate's time limit left no room for fresh pairs"
    cut = (
        f" ({r.confirmation_pairs} of {r.unconfirmed.worker_pairs} fresh pairs: the gate's time limit)"
        if r.confirmation_pairs < r.unconfirmed.worker_pairs
        else ""
    )
    return refused + (
        f"; confirmed: x{format_ratio(1 + r.unconfirmed.slowdown)} on the first {r.unconfirmed.worker_pairs} "
        f"worker pairs{cut}"
    )


def _acceptance_text(named: tuple[Acceptance, ...], within: bool) -> str:
    """``; accepted: <reasons>`` for a change within them, ``; beyond the accepted change: ...`` otherwise."""
    if not named:
        return ""
    return f"; {'accepted' if within else 'beyond the accepted change'}: {describe_acceptances(named)}"


def paired_metric(scenario: str, name: str, pairs: list[tuple[dict, dict]], tolerance: float) -> PairedMetric:
    """Gate one metric over its (baseline entry, candidate entry) pairs (``bench.results.metric`` entries)."""
    ratios = tuple(paired_ratio(b["median"], c["median"]) for b, c in pairs)
    ratio = statistics.median(ratios)
    exact = all(b["spread"] is None and c["spread"] is None for b, c in pairs)
    noise = 0.0
    if not exact and len(set(ratios)) > 1:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        noise = q3 - q1
        if math.isnan(noise):  # inf - inf: unbounded
            noise = math.inf
    noise = max(noise, noise_floor(name))
    better = pairs[-1][1]["better"]
    _, verdict = classify(ratio, noise, better, tolerance)
    return PairedMetric(
        scenario=scenario,
        metric=name,
        unit=pairs[-1][1]["unit"],
        better=better,
        base=statistics.median(b["median"] for b, _ in pairs),
        cand=statistics.median(c["median"] for _, c in pairs),
        ratios=ratios,
        ratio=ratio,
        noise=noise,
        verdict=verdict,
        exact=exact,
    )


def paired_gate(
    runs: dict[str, list[tuple[SideRun, SideRun]]],
    tolerance: float,
    baseline: str = "baseline",
    candidate: str = "candidate",
    exact_only: bool = False,
    accept_increase: frozenset[str] = frozenset(),
    acceptances: list[Acceptance] | None = None,
) -> ABReport:
    """The report over every scenario's (baseline, candidate) runs, pair by pair.

    ``exact_only``: gate only the metrics without a spread; the timed ones are left to the resident
    blocks (one full run per side says nothing about their noise). ``accept_increase``: exact metrics
    whose regression is reported as accepted instead of failing (a change that costs them on purpose).
    ``acceptances``: accepted changes that apply to the two sides (a regression within them passes).
    """
    pairs_count = max((len(p) for p in runs.values()), default=0)
    report = ABReport(baseline, candidate, tolerance, pairs_count, acceptances=list(acceptances or ()))
    for scenario, pairs in runs.items():
        if all(b.status == c.status == "skipped" for b, c in pairs):
            report.notes.append(f"NOTE {scenario}: skipped on both sides ({pairs[-1][1].error})")
            continue
        bad_cand = next((c for _, c in pairs if c.status != "ok"), None)
        if bad_cand is not None:
            report.failures.append(f"NOT-OK {scenario}: candidate {bad_cand.status} ({bad_cand.error})")
            continue
        bad_base = next((b for b, _ in pairs if b.status != "ok"), None)
        if bad_base is not None:
            report.notes.append(f"NOTE {scenario}: baseline {bad_base.status} ({bad_base.error}); not compared")
            continue
        shared = set.intersection(*(set(b.metrics) & set(c.metrics) for b, c in pairs))
        estimate = pairs[-1][1].mode == "plan"
        for name in sorted(shared):
            entries = [(b.metrics[name], c.metrics[name]) for b, c in pairs]
            if entries[-1][1]["better"] is None or is_work_metric(name):
                continue  # reported by moe-bench run, never gated; work counters: see _work_findings
            paired = paired_metric(scenario, name, entries, tolerance)
            if exact_only and not paired.exact and not estimate:
                continue
            if estimate:
                # A plan measures nothing: a changed figure is a changed estimate (see the plan's
                # docstring), reported for review, not a regression of the engine.
                if paired.ratio != 1:
                    report.notes.append(
                        f"NOTE {scenario} {name}: plan estimate changed x{format_ratio(paired.ratio)} (not gated)"
                    )
                paired = dataclasses.replace(paired, verdict="info")
            elif paired.verdict == "regressed":
                named, within = acceptance_of(report.acceptances, name, scenario, paired.ratio, paired.better)
                if within:
                    paired = dataclasses.replace(paired, verdict="accepted", accepted=describe_acceptances(named))
                elif paired.exact and name in accept_increase:
                    paired = dataclasses.replace(paired, verdict="accepted")
            report.metrics.append(paired)
        only = set().union(*(set(b.metrics) ^ set(c.metrics) for b, c in pairs))
        for name in sorted(only):
            report.notes.append(f"NOTE {scenario} {name}: metric on one side only")
    return report


# --------------------------------------------------------------------------------------------
# Running the two sides
# --------------------------------------------------------------------------------------------


def run_ab(
    plan: ABPlan,
    device: str = "auto",
    keep: Path | None = None,
    root: Path = REPO_ROOT,
    deadline: SuiteDeadline | None = None,
) -> ABReport:
    """Run the plan: per scenario one full run per side, then the resident blocks; the gate's report.
    Scenarios that time no blocks (plan mode) run first, so that the time limit (``plan.deadline_s``,
    or ``deadline``: one shared with other calls) is shared out between the ones that do."""
    if deadline is None and plan.deadline_s is not None:
        deadline = SuiteDeadline(plan.deadline_s, [s.name for s in plan.scenarios if s.mode == "execute"])
    scenarios = sorted(plan.scenarios, key=lambda s: s.mode == "execute")
    runs: dict[str, list[tuple[SideRun, SideRun]]] = {}
    versions: dict[str, str] = {}
    comparisons: list[ResidentComparison] = []
    resident_failures: list[str] = []
    report_notes: list[str] = []
    with contextlib.ExitStack() as stack:
        work = keep if keep is not None else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-ab-")))
        base_root = stack.enter_context(worktree(root, plan.commit))
        sides = {"baseline": base_root, "candidate": Path(root)}
        for index, scenario in enumerate(scenarios, 1):
            if deadline is not None:
                deadline.scenario_starts(scenario.name)
            results = {}
            for side in SIDES:
                started = time.perf_counter()
                results[side] = run_side(sides[side], scenario, Path(work) / side / scenario.name, device)
                version = results[side].version
                if version:
                    versions[side] = version
                logger.info(
                    f"ab [{index}/{len(plan.scenarios)}] {scenario.name} {side}: {side_summary(results[side])} "
                    f"({time.perf_counter() - started:.1f} s)"
                )
            runs[scenario.name] = [(results["baseline"], results["candidate"])]
            if scenario.mode != "execute" or any(results[s].status != "ok" for s in SIDES):
                continue
            try:
                comparison = _resident(sides, scenario, plan, device, deadline)
            except WorkerFailedToStart as err:  # e.g. a baseline too old to build this scenario
                raise ABError(str(err)) from None
            except WorkerDied as err:
                resident_failures.append(f"NOT-OK {scenario.name}: {err}")
                continue
            comparisons.append(comparison)
            estimate = _estimate(comparison)
            lo, hi = estimate.interval
            logger.info(
                f"ab [{index}/{len(plan.scenarios)}] {scenario.name} blocks: step time "
                f"x{1 + estimate.slowdown:.3f} [{1 + lo:.3f}, {1 + hi:.3f}], "
                f"{len(comparison.pairs)} worker pairs, {comparison.block_pairs} block pairs of "
                f"{comparison.steps_per_block} steps in {comparison.seconds:.0f} s: {comparison.verdict}"
            )
    if plan.label.startswith("release "):
        # One label a side: the release's own version, not what the baseline's checkout (a commit from
        # before its release record and tag) computes for itself.
        versions["baseline"] = plan.label.removeprefix("release ")
        baseline = f"{plan.label} ({plan.commit[:12]})"
    else:
        baseline = f"{plan.label} ({plan.commit[:12]}{', ' + versions['baseline'] if 'baseline' in versions else ''})"
    applicable = [a for a in plan.acceptances if a.applies(versions.get("baseline"), versions.get("candidate"))]
    report = paired_gate(
        runs,
        plan.tolerance,
        baseline,
        versions.get("candidate", "this checkout"),
        exact_only=True,
        accept_increase=plan.accept_increase,
        acceptances=applicable,
    )
    report.resident = comparisons
    report.warn_above = plan.warn_above
    report.failures += resident_failures
    report.notes += report_notes
    report.work = _work_findings(runs, plan.accept_work, applicable)
    return report


def _resident(
    sides: dict[str, Path], scenario: Scenario, plan: ABPlan, device: str, deadline: SuiteDeadline | None
) -> ResidentComparison:
    timeout = scenario.run.timeout_s + START_MARGIN_S
    return compare_resident(
        functools.partial(fresh_pair, sides["baseline"], sides["candidate"], scenario, device, timeout),
        plan.tolerance,
        plan.budget_s,
        extension_s=plan.budget_s,
        confirm=True,
        deadline=deadline,
    )


def _work_findings(
    runs: dict[str, list[tuple[SideRun, SideRun]]],
    accept: frozenset[str] | None,
    acceptances: list[Acceptance] | None = None,
) -> list[str]:
    """Work-counter verdicts of each scenario's two full runs (``bench.gate.work.work_verdicts``)."""
    findings = []
    for scenario, pairs in runs.items():
        base, cand = pairs[-1]
        if base.status == cand.status == "ok":
            findings += work_verdicts(
                scenario,
                (base.metrics, base.details),
                (cand.metrics, cand.details),
                accept,
                acceptances=acceptances or (),
            )
    return findings


@contextlib.contextmanager
def worktree(root: Path, commit: str) -> Iterator[Path]:
    """A detached temporary worktree of ``commit``, removed afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="moe-ab-baseline-"))
    path = parent / "baseline"
    try:
        made = subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(path), commit],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if made.returncode != 0:
            raise ABError(f"git worktree add failed: {made.stderr.strip().splitlines()[-1:]}")
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=root, capture_output=True, timeout=120)
        shutil.rmtree(parent, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True, timeout=120)
