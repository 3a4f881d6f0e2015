"""The gate's verdict on a comparison.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from bench.gate.accept import Acceptance, acceptance_of, applicable, beyond, describe_acceptances
from bench.gate.compare import Comparison, MetricRow, is_work_metric
from bench.gate.formatting import check_tolerance, format_noise
from bench.gate.work import accepted_work_names, has_work_counters, work_findings
from bench.units import format_number, format_percent, format_ratio

EXIT_NOT_COMPARED = 3
"""The gate's exit status when nothing regressed or failed but a scenario could not be compared (noisy, or
two machines): not a pass, never a regression."""
HEADER_WORDS = {0: "PASS", 1: "FAIL", EXIT_NOT_COMPARED: "NOT COMPARED"}


@dataclass(frozen=True)
class GateResult:
    exit_code: int
    """1 on any regression, scenario missing in the candidate, not ok in the candidate or
    mismatched; else 3 (``EXIT_NOT_COMPARED``) when a scenario was not compared (a noisy run, or two
    machines) or none was: a busy or different machine is never read as a regression; 0 otherwise."""
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
        check_tolerance(tolerance)
        comparison = comparison.with_tolerance(tolerance)
    comparison = accept_changes(comparison, accept_work, acceptances)
    tol = comparison.tolerance
    work = work_findings(comparison, accept_work, acceptances)
    # Where one side has no work counters that is said once ("no work counters on one side"), not
    # once per work metric missing.
    uncounted = {
        key
        for key in comparison.compared
        if key in comparison.base_groups
        and key in comparison.cand_groups
        and has_work_counters(comparison.base_groups[key].metrics)
        != has_work_counters(comparison.cand_groups[key].metrics)
    }

    failures: list[str] = []
    not_compared: list[str] = []
    for row in comparison.regressions:
        if not is_work_metric(row.metric):
            applying = applicable(comparison, (row.scenario, row.machine), acceptances)
            named, _ = acceptance_of(applying, row.metric, row.scenario, row.ratio, row.better)
            failures.append(_finding("REGRESSION", row, tol) + beyond(named))
    failures += [line for line in work if line.startswith("REGRESSION")]
    for issue in comparison.missing_in_candidate + comparison.not_ok + comparison.mismatched + comparison.not_compared:
        if issue.fails_gate:
            failures.append(issue.describe())
            if issue.kind in ("noisy", "different_machines"):
                not_compared.append(failures[-1])

    if not comparison.compared and not failures:
        # Every baseline failed, or every scenario was skipped: a gate that checked nothing is no pass.
        failures.append("NOTHING COMPARED: no scenario ran on both sides")
        not_compared.append(failures[-1])

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
    exit_code = (1 if len(failures) > len(not_compared) else EXIT_NOT_COMPARED) if failures else 0
    header = (
        f"{HEADER_WORDS[exit_code]}: {len(comparison.compared)} scenario(s) compared, "
        f"{len(comparison.rows)} metric(s): {counts['regressed']} regressed, {counts['accepted']} accepted"
        f"{f' ({accepted_work} accepted work increase' + 's' * (accepted_work != 1) + ')' if accepted_work else ''}, "
        f"{counts['inconclusive']} inconclusive, {counts['improved']} improved, "
        f"{counts['unchanged']} unchanged, {counts['info']} info, {counts['missing']} missing; "
        f"scenarios: {len(comparison.missing_in_candidate)} missing in candidate, "
        f"{len(comparison.missing_in_baseline)} only in candidate, {len(comparison.not_ok)} not ok, "
        f"{len(comparison.mismatched)} mismatched, {len(comparison.not_compared)} not compared (noisy or on "
        f"different machines) (tolerance {format_percent(tol)})"
    )
    report = "\n".join([header, *failures, *notes]) + "\n"
    return GateResult(
        exit_code=exit_code, report=report, comparison=comparison, failures=tuple(failures), work=tuple(work)
    )


def accepted_lines(comparison: Comparison) -> list[str]:
    """``ACCEPTED ...: accepted: <reason>`` for each accepted row (work counters have their work lines)."""
    return [
        f"{_finding('ACCEPTED', row, comparison.tolerance)}; accepted: {row.accepted}"
        for row in comparison.rows_with("accepted")
        if not is_work_metric(row.metric)
    ]


def _finding(label: str, row: MetricRow, tolerance: float) -> str:
    return (
        f"{label} {row.scenario} {row.metric}: {format_number(row.base)} -> {format_number(row.cand)} "
        f"(x{format_ratio(row.ratio)}, tolerance {format_percent(tolerance)}, {format_noise(row.noise, row.exact)}) "
        f"{row.unit} [{row.machine}]"
    )


def accept_changes(
    comparison: Comparison,
    accept_work: Collection[str] | bool | None = None,
    acceptances: Sequence[Acceptance] = (),
) -> Comparison:
    """The comparison with each accepted regression's verdict ``accepted`` (and its ``accepted``
    reason): a work increase accepted by ``accept_work``, or a change within ``acceptances``."""
    work_names = accepted_work_names(accept_work)
    rows = []
    for row in comparison.rows:
        if row.verdict == "regressed":
            applying = applicable(comparison, (row.scenario, row.machine), acceptances)
            named, within = acceptance_of(applying, row.metric, row.scenario, row.ratio, row.better)
            if is_work_metric(row.metric) and row.metric in work_names:
                row = replace(row, verdict="accepted", accepted="--accept-work")
            elif within:
                row = replace(row, verdict="accepted", accepted=describe_acceptances(named))
        rows.append(row)
    return replace(comparison, rows=tuple(rows))
