"""The release comparison of the report: two versions of a results folder through ``moe-bench gate``.
More: docs/report.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.gate.accept import Acceptance
from bench.gate.compare import DEFAULT_TOLERANCE, Comparison, MetricRow, ScenarioIssue, compare
from bench.gate.verdict import EXIT_NOT_COMPARED, GateResult, gate
from bench.metrics import HEADLINE_ORDER
from bench.report.collect import ResultSet, SameMachineSource, VersionPair, same_machine_sources


@dataclass(frozen=True)
class ScenarioTable:
    """The gated rows of one compared (scenario, machine)."""

    scenario: str
    machine: str
    rows: tuple[MetricRow, ...]
    info_metrics: int
    """Metrics of the scenario that are reported, never gated (not listed on the page)."""


@dataclass(frozen=True)
class ReleaseComparison:
    versions: VersionPair
    comparison: Comparison
    gate: GateResult
    tables: tuple[ScenarioTable, ...]
    one_version_machines: tuple[tuple[str, str], ...] = ()
    """(machine, the version it ran) for machines with results of only one of the two versions."""
    sources: tuple[str, ...] = ()
    """Where the compared results came from, one line each for the page: the same-machine folders used
    (which scenarios) and the stored results (how many scenarios)."""

    @property
    def issues(self) -> tuple[ScenarioIssue, ...]:
        return self.comparison.issues

    @property
    def header(self) -> str:
        """The gate's first report line: PASS or FAIL and the counts."""
        return self.gate.report.splitlines()[0]

    @property
    def outcome(self) -> str:
        """The banner's word, the first that holds of: ``regressed`` (a metric or the work regressed),
        ``missing`` (a scenario of the base is not in the new version), ``not-ok`` (not ok in the new
        version, or a changed scenario), ``not-compared`` (nothing else failed, but a run on either side
        was noisy or the two versions ran on different machines of one name: the gate cannot vouch either
        way and exits 3), ``inconclusive`` (a change within the noise), ``accepted`` (a
        change accepted), ``pass``."""
        counts = self.comparison.counts()
        if counts["regressed"]:
            return "regressed"
        if self.comparison.missing_in_candidate:
            return "missing"
        if self.gate.exit_code == EXIT_NOT_COMPARED:
            return "not-compared"
        if not self.gate.passed:
            return "not-ok"
        if counts["inconclusive"]:
            return "inconclusive"
        return "accepted" if counts["accepted"] else "pass"


def _row_order(row: MetricRow) -> tuple:
    """Headline rows first (``HEADLINE_ORDER``), the other gated metrics alphabetically, work counters last."""
    if row.metric in HEADLINE_ORDER:
        return (0, HEADLINE_ORDER.index(row.metric), "")
    return (2 if row.metric.startswith("work_") else 1, 0, row.metric)


def release_comparison(
    results: ResultSet,
    versions: VersionPair,
    tolerance: float = DEFAULT_TOLERANCE,
    acceptances: Sequence[Acceptance] = (),
) -> ReleaseComparison:
    """``moe-bench gate`` of the two versions' documents on the machines that ran both (docs/report.md);
    ``acceptances``: the releases' accepted changes."""
    pairs = same_machine_sources(results)
    in_pairs = {id(d) for source in pairs for d in source.docs}
    chosen: dict[str, SameMachineSource] = {}
    for source in pairs:
        both_sides = {d.name for d in source.docs_of(versions.base)} & {d.name for d in source.docs_of(versions.new)}
        for scenario in sorted(both_sides):
            chosen.setdefault(scenario, source)

    def stored(version: str) -> list:
        return [d for d in results.docs_of(version) if id(d) not in in_pairs and d.name not in chosen]

    def paired(version: str) -> list:
        return [d for s in pairs for d in s.docs_of(version) if chosen.get(d.name) is s]

    base_docs, new_docs = stored(versions.base), stored(versions.new)
    base_machines, new_machines = {d.machine for d in base_docs}, {d.machine for d in new_docs}
    both = base_machines & new_machines
    alone = tuple(
        sorted([(m, versions.base) for m in base_machines - both] + [(m, versions.new) for m in new_machines - both])
    )
    comparison = compare(
        paired(versions.base) + [d for d in base_docs if d.machine in both],
        paired(versions.new) + [d for d in new_docs if d.machine in both],
        tolerance,
    )
    sources = []
    for source in pairs:
        names = sorted(n for n, s in chosen.items() if s is source)
        if names:
            what = "A/B results" if source.kind == "ab" else "image results"
            sources.append(
                f"{what} ({source.command}) in {source.where}, both versions on one machine: {', '.join(names)}"
            )
    stored_names = sorted({scenario for scenario, _ in comparison.compared} - set(chosen))
    if sources and stored_names:
        sources.append(
            f"stored results of each version: {len(stored_names)} other scenario{'s' * (len(stored_names) != 1)}"
        )
    verdict = gate(comparison, tolerance, None, acceptances)
    tables = []
    for scenario, machine in comparison.compared:
        rows = [r for r in verdict.comparison.rows if (r.scenario, r.machine) == (scenario, machine)]
        shown = sorted((r for r in rows if r.better is not None), key=_row_order)
        tables.append(ScenarioTable(scenario, machine, tuple(shown), len(rows) - len(shown)))
    return ReleaseComparison(versions, verdict.comparison, verdict, tuple(tables), alone, tuple(sources))
