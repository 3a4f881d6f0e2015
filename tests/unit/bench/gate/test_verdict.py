"""bench.gate.verdict: the gate's exit status, report lines and accepted changes, on hand-made documents."""

from __future__ import annotations

import pytest
from result_docs import make_doc

from bench.gate.accept import Acceptance
from bench.gate.compare import compare
from bench.gate.verdict import EXIT_NOT_COMPARED, accept_changes, accepted_lines, gate
from bench.results import ResultDocument, metric

M = "[1xnvidia-h200]"


def one(value: float, unit: str = "s") -> dict:
    return metric([value], unit, "lower")


def docs(*datas: dict) -> list[ResultDocument]:
    return [ResultDocument(d) for d in datas]


def run(base: list[dict], cand: list[dict], **kwargs):
    return gate(compare(docs(*base), docs(*cand)), **kwargs)


def step(value: float, name: str = "smoke-e8", **fields) -> dict:
    return make_doc(name, {"step_time_s": one(value)}, **fields)


def header_counts(result) -> str:
    return result.report.splitlines()[0]


@pytest.mark.parametrize(
    ("cand", "tolerance", "verdict", "code"),
    [
        (1.05, None, "unchanged", 0),  # exactly the tolerance: not beyond it
        (1.0501, None, "regressed", 1),
        (0.95, None, "unchanged", 0),
        (0.9499, None, "improved", 0),
        (1.0501, 0.10, "unchanged", 0),  # the gate's own tolerance recomputes the verdicts
        (1.1001, 0.10, "regressed", 1),
        (1.0001, 0.0, "regressed", 1),
    ],
)
def test_an_exact_step_time_at_the_edges_of_the_tolerance(cand, tolerance, verdict, code):
    result = run([step(1.0)], [step(cand)], tolerance=tolerance)
    (row,) = result.comparison.rows
    assert row.verdict == verdict
    assert result.exit_code == code
    assert result.passed == (code == 0)
    assert result.comparison.tolerance == (0.05 if tolerance is None else tolerance)


def test_the_gate_refuses_a_tolerance_outside_zero_to_one():
    comparison = compare(docs(step(1.0)), docs(step(1.0)))
    with pytest.raises(ValueError, match="tolerance must be a fraction"):
        gate(comparison, 1.0)


def test_report_of_one_regression_and_one_improvement():
    base = make_doc(metrics={"step_time_s": one(1.0), "peak_tensor_bytes": one(100, "bytes")})
    cand = make_doc(metrics={"step_time_s": one(1.2), "peak_tensor_bytes": one(90, "bytes")})
    result = run([base], [cand])
    assert result.exit_code == 1
    assert result.report == (
        "FAIL: 1 scenario(s) compared, 2 metric(s): 1 regressed, 0 accepted, 0 inconclusive, 1 improved, "
        "0 unchanged, 0 info, 0 missing; scenarios: 0 missing in candidate, 0 only in candidate, 0 not ok, "
        "0 mismatched, 0 not compared (noisy or on different machines) (tolerance 5%)\n"
        f"REGRESSION smoke-e8 step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}\n"
        f"IMPROVED smoke-e8 peak_tensor_bytes: 100 -> 90 (x0.900, tolerance 5%, exact value) bytes {M}\n"
    )
    assert result.failures == (f"REGRESSION smoke-e8 step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}",)


def test_a_noise_allowance_is_named_in_the_finding():
    base = make_doc(metrics={"step_time_s": metric([0.9, 1.0, 1.0, 1.0, 1.1], "s", "lower")})
    cand = make_doc(metrics={"step_time_s": metric([1.8, 2.0, 2.0, 2.0, 2.2], "s", "lower")})
    result = run([base], [cand])
    # Quartiles 1.0 and 1.0 (base) and 2.0 and 2.0 (cand): no spread between them, so noise 0.0%.
    assert f"REGRESSION smoke-e8 step_time_s: 1 -> 2 (x2.000, tolerance 5%, noise 0.0%) s {M}" in result.report


def noisy(data: dict) -> dict:
    return {**data, "conditions": {"noisy": True, "reasons": ["load average 3.5 on 2 cores"]}}


def test_a_noisy_candidate_alone_is_not_compared_never_a_regression():
    result = run([step(1.0)], [noisy(step(2.0))])
    assert result.exit_code == EXIT_NOT_COMPARED == 3
    assert header_counts(result).startswith("NOT COMPARED: 0 scenario(s) compared")
    assert "1 not compared (noisy or on different machines)" in header_counts(result)
    assert result.failures == (
        f"NOISY smoke-e8: the candidate run shared its machine (load average 3.5 on 2 cores); not compared {M}",
    )


def test_a_regression_beside_a_noisy_scenario_fails():
    result = run([step(1.0), step(1.0, "other")], [noisy(step(1.0)), step(2.0, "other")])
    assert result.exit_code == 1
    assert header_counts(result).startswith("FAIL")
    assert len(result.failures) == 2


def test_a_scenario_missing_in_the_candidate_fails_and_one_only_in_the_candidate_is_a_note():
    missing = run([step(1.0), step(1.0, "gone")], [step(1.0)])
    assert missing.exit_code == 1
    assert missing.failures == (f"MISSING gone: in the baseline (ok) but not in the candidate {M}",)
    new = run([step(1.0)], [step(1.0), step(1.0, "fresh")])
    assert new.exit_code == 0
    assert f"NEW fresh: only in the candidate (ok); nothing to compare against {M}" in new.report.splitlines()
    assert "1 only in candidate" in header_counts(new)


def test_which_side_is_not_ok_decides_between_a_failure_and_a_note():
    cand_failed = run([step(1.0)], [make_doc(status="failed", error="OOM")])
    assert cand_failed.exit_code == 1
    assert cand_failed.failures == (f"NOT-OK smoke-e8: candidate failed (OOM) {M}",)
    base_failed = run([make_doc(status="failed", error="OOM"), step(1.0, "other")], [step(1.0), step(1.0, "other")])
    assert base_failed.exit_code == 0
    assert f"NOTE NOT-OK smoke-e8: baseline failed (OOM) {M}" in base_failed.report.splitlines()
    both_skipped = run(
        [make_doc(status="skipped", error="no GPU"), step(1.0, "other")],
        [make_doc(status="skipped", error="no GPU"), step(1.0, "other")],
    )
    assert both_skipped.exit_code == 0
    assert f"NOTE NOT-OK smoke-e8: baseline skipped (no GPU); candidate skipped (no GPU) {M}" in both_skipped.report


@pytest.mark.parametrize("base_status", ["failed", "skipped"])
def test_a_gate_that_compared_nothing_is_not_a_pass(base_status):
    """Every baseline run failed (or every scenario was skipped on both sides): nothing was checked."""

    def cand(name):
        return step(1.0, name) if base_status == "failed" else make_doc(name, status="skipped", error="no GPU")

    base = [make_doc(name, status=base_status, error="no GPU") for name in ("a", "b")]
    result = run(base, [cand("a"), cand("b")])
    assert result.exit_code == EXIT_NOT_COMPARED
    assert header_counts(result).startswith("NOT COMPARED: 0 scenario(s) compared")
    assert result.failures == ("NOTHING COMPARED: no scenario ran on both sides",)


def work(ops: float, **metrics) -> dict:
    return make_doc(metrics={"work_aten_ops": metric([ops], "ops", "lower"), **metrics})


WORK_LINE = "smoke-e8 work_aten_ops: work increased{}: +2 ops per step (+20.0%, 10 -> 12) " + M


def test_a_work_increase_fails_unless_accepted_by_name_or_all():
    refused = run([work(10)], [work(12)])
    assert refused.exit_code == 1
    assert refused.failures == ("REGRESSION " + WORK_LINE.format(""),)
    assert refused.work == refused.failures
    assert run([work(10)], [work(12)], accept_work={"work_host_syncs"}).exit_code == 1
    for accept in ({"work_aten_ops"}, True):
        result = run([work(10)], [work(12)], accept_work=accept)
        assert result.exit_code == 0
        (row,) = result.comparison.rows
        assert (row.verdict, row.accepted) == ("accepted", "--accept-work")
        assert "1 accepted (1 accepted work increase), 0 inconclusive" in header_counts(result)
        assert result.report.splitlines()[1:] == ["NOTE " + WORK_LINE.format(" (accepted)")]


def test_one_side_without_work_counters_is_said_once_not_per_missing_metric():
    base = work(10, rss_peak_bytes=one(100, "bytes"))
    cand = make_doc(metrics={})
    lines = run([base], [cand]).report.splitlines()[1:]
    assert lines == [
        f"NOTE smoke-e8 rss_peak_bytes: metric missing in the candidate {M}",
        f"NOTE smoke-e8: no work counters on one side (the candidate); work not compared {M}",
    ]


def test_an_acceptance_covers_a_regression_up_to_its_size_and_no_further():
    base, cand = [step(1.0)], [step(1.2)]
    within = Acceptance(("step_time_s",), ("smoke-e8",), 0.2, "bigger experts")
    result = run(base, cand, acceptances=[within])
    assert result.exit_code == 0
    assert result.report.splitlines()[1:] == [
        f"ACCEPTED smoke-e8 step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}; "
        "accepted: bigger experts (--accept, up to 20%)"
    ]
    short = Acceptance(("step_time_s",), ("smoke-e8",), 0.19, "bigger experts")
    result = run(base, cand, acceptances=[short])
    assert result.exit_code == 1
    assert result.failures == (
        f"REGRESSION smoke-e8 step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}; "
        "beyond the accepted change: bigger experts (--accept, up to 19%)",
    )
    elsewhere = Acceptance(("step_time_s",), ("other",), 0.5, "elsewhere")
    assert run(base, cand, acceptances=[elsewhere]).failures[0].endswith(f"s {M}")


def test_a_releases_acceptance_applies_only_across_its_release():
    base, cand = [step(1.0, version="0.1.0")], [step(1.2, version="0.2.0")]
    made_in = Acceptance(("step_time_s",), ("smoke-e8",), 0.25, "fp32 grads", release="0.2.0")
    assert run(base, cand, acceptances=[made_in]).exit_code == 0
    later = Acceptance(("step_time_s",), ("smoke-e8",), 0.25, "fp32 grads", release="0.3.0")
    assert run(base, cand, acceptances=[later]).exit_code == 1


def test_accept_changes_and_accepted_lines_directly():
    comparison = compare(docs(work(10, step_time_s=one(1.0))), docs(work(12, step_time_s=one(1.1))))
    assert [r.verdict for r in comparison.rows] == ["regressed", "regressed"]
    untouched = accept_changes(comparison)
    assert [r.verdict for r in untouched.rows] == ["regressed", "regressed"]
    accepted = accept_changes(comparison, True, [Acceptance(("step_time_s",), ("smoke-e8",), 0.1, "slower on purpose")])
    assert [(r.metric, r.verdict, r.accepted) for r in accepted.rows] == [
        ("step_time_s", "accepted", "slower on purpose (--accept, up to 10%)"),
        ("work_aten_ops", "accepted", "--accept-work"),
    ]
    # Work counters have their own lines: only the step time is listed.
    assert accepted_lines(accepted) == [
        f"ACCEPTED smoke-e8 step_time_s: 1 -> 1.1 (x1.100, tolerance 5%, exact value) s {M}; "
        "accepted: slower on purpose (--accept, up to 10%)"
    ]
    assert accepted_lines(comparison) == []


def test_accept_work_accepts_work_counters_only():
    """``--accept-work step_time_s`` names no work counter: the slower step still fails."""
    result = run([step(1.0)], [step(1.2)], accept_work={"step_time_s"})
    assert result.exit_code == 1
    assert [r.verdict for r in result.comparison.rows] == ["regressed"]
