"""bench.commands.compare: ``moe-bench compare`` and ``moe-bench gate`` over result files in tmp_path."""

from __future__ import annotations

import pytest
from result_docs import make_doc

from bench.cli import main
from bench.release import record
from bench.results import metric, write_result

M = "[1xnvidia-h200]"


@pytest.fixture(autouse=True)
def no_recorded_releases(tmp_path, monkeypatch):
    """The repository's own releases (and their accepted changes) stay out of these comparisons."""
    monkeypatch.setattr(record, "RELEASES_PATH", tmp_path / "no-releases.json")


def side(folder, *docs):
    for doc in docs:
        write_result(doc, folder)
    return str(folder)


def doc(name="s", step=1.0, ops=10, **fields):
    metrics = {"step_time_s": metric([step], "s", "lower"), "work_aten_ops": metric([ops], "ops", "lower")}
    return make_doc(name, metrics, **fields)


@pytest.fixture
def slower(tmp_path):
    """A candidate 20% slower with 2 more ops per step, and a baseline scenario the candidate lacks."""
    return side(tmp_path / "base", doc(), doc("gone")), side(tmp_path / "cand", doc(step=1.2, ops=12))


def gate(base, cand, *extra):
    return main(["gate", "--baseline", base, "--candidate", cand, *extra])


def test_gate_prints_the_report_on_stdout_and_fails_on_a_regression(slower, capsys):
    base, cand = slower
    assert gate(base, cand) == 1
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith("FAIL: 1 scenario(s) compared, 2 metric(s): 2 regressed")
    assert lines[1:] == [
        f"REGRESSION s step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}",
        f"REGRESSION s work_aten_ops: work increased: +2 ops per step (+20.0%, 10 -> 12) {M}",
        f"MISSING gone: in the baseline (ok) but not in the candidate {M}",
    ]


def test_gate_passes_on_the_same_results_and_tolerance_and_acceptances_reach_the_gate(tmp_path, capsys):
    base = side(tmp_path / "base", doc())
    cand = side(tmp_path / "cand", doc(step=1.2, ops=12))
    assert gate(base, base) == 0
    assert capsys.readouterr().out.startswith("PASS: 1 scenario(s) compared")
    assert gate(base, cand, "--tolerance", "25%") == 1  # the work counters still count exactly
    assert gate(base, cand, "--tolerance", "25%", "--accept-work") == 0
    assert gate(base, cand, "--accept-work", "work_aten_ops", "--accept", "step_time_s@s<=20%: bigger") == 0
    out = capsys.readouterr().out
    assert f"ACCEPTED s step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}; accepted: bigger" in out
    assert gate(base, cand, "--accept-work", "work_aten_ops", "--accept", "step_time_s@s<=19%: bigger") == 1


def test_gate_exits_3_when_the_only_finding_is_a_noisy_run(tmp_path, capsys):
    base = side(tmp_path / "base", doc())
    calibration = {"kernel": "matmul", "gflops": 50.0, "samples": [50.0]}
    conditions = {
        "noisy": True,
        "reasons": ["load 3.0"],
        "calibration_start": calibration,
        "calibration_end": calibration,
    }
    cand = side(tmp_path / "cand", {**doc(step=2.0), "conditions": conditions})
    assert gate(base, cand) == 3
    assert capsys.readouterr().out.startswith("NOT COMPARED: 0 scenario(s) compared")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tolerance", "5"], "invalid tolerance '5': a bare number is a fraction and must be below 1; write '5%'"),
        (["--tolerance", "100%"], "invalid tolerance '100%': a percentage must be below 100%"),
        (["--accept-work", "work_bogus"], "--accept-work: unknown work metric work_bogus"),
        (["--accept", "step_time_s@s: no size"], "--accept 'step_time_s@s: no size': no accepted size"),
        (["--accept", "step_tme_s@s<=5%: typo"], "unknown metric step_tme_s (did you mean step_time_s?)"),
    ],
)
def test_gate_refuses_bad_options_naming_them(slower, capsys, extra, message):
    assert gate(*slower, *extra) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("moe-bench: error: ") and message in err
    assert len(err.splitlines()) == 1


def test_gate_refuses_a_missing_side(slower, tmp_path, capsys):
    assert gate(slower[0], str(tmp_path / "nowhere")) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err


def test_compare_prints_the_table_issues_and_work_and_never_fails(slower, capsys):
    base, cand = slower
    assert main(["compare", base, cand]) == 0
    out = capsys.readouterr().out
    table_rows = [line for line in out.splitlines() if "step_time_s" in line or "work_aten_ops" in line]
    assert any("1.200" in line and "regressed" in line for line in table_rows)
    assert f"MISSING gone: in the baseline (ok) but not in the candidate {M}" in out.splitlines()
    assert f"REGRESSION s work_aten_ops: work increased: +2 ops per step (+20.0%, 10 -> 12) {M}" in out.splitlines()


def test_compare_shows_accepted_changes(slower, capsys):
    base, cand = slower
    assert main(["compare", base, cand, "--accept-work", "--accept", "step_time_s@s<=20%: bigger"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        f"ACCEPTED s step_time_s: 1 -> 1.2 (x1.200, tolerance 5%, exact value) s {M}; accepted: bigger (--accept, up to 20%)"
        in lines
    )
    assert f"NOTE s work_aten_ops: work increased (accepted): +2 ops per step (+20.0%, 10 -> 12) {M}" in lines
    assert not any("regressed" in line for line in lines)


def test_compare_refuses_bad_input(slower, tmp_path, capsys):
    assert main(["compare", slower[0], slower[1], "--accept-work", "step_time_s"]) == 2
    assert "--accept-work: unknown work metric step_time_s" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", slower[0], str(empty)]) == 2
    assert f"{empty}: no result documents" in capsys.readouterr().err
