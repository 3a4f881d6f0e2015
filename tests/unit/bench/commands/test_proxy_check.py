"""bench.commands.proxy_check: ``moe-bench proxy-check`` refuses what it cannot check before starting any
worker, and prints the check's report; the runner and the check are stood in for."""

from __future__ import annotations

import json
from typing import Any

import pytest

import bench.commands.proxy_check as proxy_command
import bench.run.runner
import bench.validate.proxy_check
from bench.cli import main
from bench.results import REPO_ROOT

DP2 = str(REPO_ROOT / "scenarios/smoke/e8-dp2-bf16.yaml")
ONE_RANK = str(REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml")
PLAN = str(REPO_ROOT / "scenarios/models/mixtral-8x7b.yaml")


def ok_row(run=0, **extra):
    return {
        "scenario": "e8-dp2-bf16",
        "run": run,
        "status": "ok",
        "measured_step_s": 0.1234,
        "projected_step_s": 0.1111,
        "step_time_cv": 0.0123,
        "error": -0.0997,
        "error_without_skew": -0.05,
        "plan_memory_gap": [0.012, -0.2],
        **extra,
    }


SUMMARY = {"runs": 2, "median_error": -0.0997, "median_error_without_skew": -0.05, "median_op_level_error": 0.031}
REPORT: dict[str, Any] = {
    "networks": {2: {"latency_us": 45.67, "gbps": 1.234}},
    "rows": [ok_row(), ok_row(1, op_level_error=0.031)],
    "summary": {"e8-dp2-bf16": SUMMARY},
}


class FakeRunner:
    def __init__(self, device, out_root):
        self.device, self.out_root = device, out_root


@pytest.fixture
def checked(monkeypatch):
    """The checks asked for, as (scenario names, runs, profile name, warmup steps); REPORT comes back."""
    calls = []

    def fake_check(runner, scenarios, runs=1, profile=None, warmup_steps=None):
        calls.append(([s.name for s in scenarios], runs, profile and profile.name, warmup_steps, runner.out_root))
        return REPORT

    monkeypatch.setattr(bench.run.runner, "Runner", FakeRunner)
    monkeypatch.setattr(bench.validate.proxy_check, "check", fake_check)
    return calls


def test_the_report_a_user_reads(tmp_path, checked, capsys):
    argv = [
        "proxy-check",
        DP2,
        "--out",
        str(tmp_path),
        "--runs",
        "2",
        "--warmup-steps",
        "0",
        "--device-profile",
        "cpu-2core",
    ]
    assert main([*argv, "--json", str(tmp_path / "report.json")]) == 0
    assert checked == [(["e8-dp2-bf16"], 2, "cpu-2core", 0, tmp_path)]
    measured = (
        "e8-dp2-bf16 run {n}: measured 123.4 ms/step, projected 111.1 ms/step (skew cv 0.012), error -10.0% "
        "(-5.0% without skew){op}; plan vs proxy memory +1.2%, -20.0%"
    )
    assert capsys.readouterr().out.splitlines() == [
        "gloo links, 2 ranks: latency 45.7 us, 1.23 GB/s",
        measured.format(n=1, op=""),
        measured.format(n=2, op=", op-level +3.1%"),
        "e8-dp2-bf16: median error over 2 runs -10.0% (-5.0% without skew), op-level +3.1%",
        f"report: {tmp_path / 'report.json'}",
    ]
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["e8-dp2-bf16"]["runs"] == 2


def test_a_real_run_that_failed_is_named_and_fails_the_check(tmp_path, checked, monkeypatch, capsys):
    failed = {**ok_row(), "status": "failed", "error": "worker 1 exited 9"}
    summary = {"e8-dp2-bf16": {**SUMMARY, "median_op_level_error": None}}
    monkeypatch.setitem(REPORT, "rows", [failed])
    monkeypatch.setitem(REPORT, "summary", summary)
    assert main(["proxy-check", DP2, "--out", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "e8-dp2-bf16 run 1: real run failed: worker 1 exited 9",
        "e8-dp2-bf16: median error over 2 runs -10.0% (-5.0% without skew)",
    ]


def test_the_default_scenarios_are_the_two_rank_smoke_layouts(tmp_path, checked, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the defaults are paths in the repository
    assert main(["proxy-check", "--out", str(tmp_path)]) == 0
    ((names, runs, profile, warmup, _),) = checked
    assert [f"scenarios/smoke/{n}.yaml" for n in names] == list(bench.validate.proxy_check.DEFAULT_SCENARIOS)
    assert (runs, profile, warmup) == (1, None, None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([ONE_RANK], "e8-random-bf16.yaml: proxy-check needs execute scenarios of 2 ranks or more"),
        ([DP2, PLAN], "mixtral-8x7b.yaml: proxy-check needs execute scenarios of 2 ranks or more"),
        ([DP2, "--runs", "0"], "--runs: must be at least 1, got 0"),
        ([DP2, "--warmup-steps", "-1"], "--warmup-steps: must be at least 0, got -1"),
        ([DP2, "--device-profile", "h999"], "h999"),
        ([str(REPO_ROOT / "scenarios/smoke/nope.yaml")], "nope.yaml"),
    ],
)
def test_refusals_name_the_bad_input_and_start_nothing(tmp_path, checked, capsys, argv, message):
    assert main(["proxy-check", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error: ") and message in err and len(err.splitlines()) == 1
    assert checked == []


def test_a_layout_no_proxy_can_stand_for_is_refused_naming_the_file(tmp_path, checked, monkeypatch, capsys):
    def refuse(parallel):
        raise ValueError("parallel.pp: a proxy runs one stage")

    monkeypatch.setattr(proxy_command, "check_proxy_layout", refuse)
    assert main(["proxy-check", DP2, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {DP2}: parallel.pp: a proxy runs one stage\n"
    assert checked == []


def test_an_unwritable_results_folder_is_refused(tmp_path, checked, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["proxy-check", DP2, "--out", str(blocker / "r")]) == 2
    assert "results folder not writable" in capsys.readouterr().err
    assert checked == []


def test_a_check_that_could_not_run_fails_with_its_reason(tmp_path, monkeypatch, capsys):
    def broken(runner, scenarios, runs=1, profile=None, warmup_steps=None):
        raise RuntimeError("the gloo calibration timed out")

    monkeypatch.setattr(bench.run.runner, "Runner", FakeRunner)
    monkeypatch.setattr(bench.validate.proxy_check, "check", broken)
    assert main(["proxy-check", DP2, "--out", str(tmp_path)]) == 1
    assert capsys.readouterr() == ("", "moe-bench: error: the gloo calibration timed out\n")
