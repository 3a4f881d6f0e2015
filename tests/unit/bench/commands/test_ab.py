"""bench.commands.ab: ``moe-bench ab`` checks its options and files before any worker starts, hands them to
the plan, and prints the report; the plan, the A/B run and the calibration are stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import bench.commands.ab as ab_command
from bench.ab.plan import ABError
from bench.ab.resident import WorkerDied
from bench.cli import main
from bench.results import REPO_ROOT

SMOKE = str(REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml")


@pytest.fixture
def planned(monkeypatch):
    """Plans asked for (their keyword arguments) and A/B runs started (device, keep); the report exits 1."""
    state = SimpleNamespace(plans=[], runs=[])

    def fake_plan_ab(ref, scenarios, tolerance, budget, **kwargs):
        state.plans.append(
            {"ref": ref, "scenarios": [s.name for s in scenarios], "tolerance": tolerance, "budget": budget, **kwargs}
        )
        return SimpleNamespace(
            label="release 0.3.0",
            commit="0123456789abcdef",
            scenarios=scenarios,
            budget_s=budget,
            deadline_s=kwargs.get("deadline_s"),
        )

    def fake_run_ab(plan, device, keep):
        state.runs.append((device, keep))
        return SimpleNamespace(render=lambda: "REPORT\n", exit_code=1)

    monkeypatch.setattr(ab_command, "plan_ab", fake_plan_ab)
    monkeypatch.setattr(ab_command, "run_ab", fake_run_ab)
    return state


def test_options_reach_the_plan_and_the_report_decides_the_exit_code(tmp_path, planned, capsys):
    argv = ["ab", SMOKE, "--baseline-ref", "v0.3.0", "--budget", "30", "--tolerance", "3%", "--warn-above", "1.5%"]
    argv += ["--accept-work", "work_aten_ops", "--accept-increase", "peak_tensor_bytes", "--device", "cpu"]
    argv += ["--accept", "step_time_s@e8-random-bf16<=4%: slower on purpose", "--out", str(tmp_path / "keep")]
    argv += ["--deadline", "300"]
    assert main(argv) == 1
    (plan,) = planned.plans
    assert plan["ref"] == "v0.3.0"
    assert plan["scenarios"] == ["e8-random-bf16"]
    assert (plan["tolerance"], plan["budget"], plan["warn_above"], plan["deadline_s"]) == (0.03, 30.0, 0.015, 300.0)
    assert plan["accept_work"] == {"work_aten_ops"}
    assert plan["accept_increase"] == {"peak_tensor_bytes"}
    (acceptance,) = plan["acceptances"]
    assert (acceptance.metrics, acceptance.max_change, acceptance.release) == (("step_time_s",), 0.04, None)
    assert planned.runs == [("cpu", tmp_path / "keep")]
    assert capsys.readouterr().out == (
        "ab: baseline release 0.3.0 (0123456789ab) vs this checkout: 1 scenario(s), resident blocks for up to 30 s "
        "each, the whole gate within 300 s\nREPORT\n"
    )


def test_defaults_the_ci_suite_and_no_kept_results(planned, monkeypatch):
    suites = []

    def fake_suite_files(suite, device):
        suites.append(suite)
        return [SMOKE]

    monkeypatch.setattr(ab_command, "suite_files", fake_suite_files)
    assert main(["ab", "--device", "cpu"]) == 1
    assert suites == ["ci"]
    (plan,) = planned.plans
    assert (plan["ref"], plan["tolerance"], plan["budget"], plan["warn_above"]) == (None, 0.05, 60.0, None)
    assert plan["deadline_s"] is None
    assert (plan["accept_work"], plan["accept_increase"], plan["acceptances"]) == (None, frozenset(), ())
    assert planned.runs == [("cpu", None)]
    assert main(["ab", "--suite", "gpu", "--device", "cpu"]) == 1
    assert suites == ["ci", "gpu"]


def test_an_empty_out_folder_is_fine_and_a_used_one_refused(tmp_path, planned, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["ab", SMOKE, "--device", "cpu", "--out", str(empty)]) == 1
    (empty / "old.json").write_text("{}")
    assert main(["ab", SMOKE, "--device", "cpu", "--out", str(empty)]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {empty}: --out must be a new or empty folder\n"
    assert len(planned.runs) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tolerance", "5"], "invalid tolerance '5'"),
        (["--warn-above", "lots"], "invalid tolerance 'lots'"),
        (["--accept-work", "step_time_s"], "--accept-work: unknown work metric step_time_s"),
        (["--accept-increase", "step_time_s"], "--accept-increase: step_time_s is not an exact metric"),
        (["--accept", "step_time_s@x<=5%"], "--accept 'step_time_s@x<=5%': no reason after ':'"),
    ],
)
def test_bad_options_are_refused_naming_them(planned, capsys, argv, message):
    assert main(["ab", SMOKE, "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error: ") and message in err
    assert planned.runs == []


def test_a_missing_scenario_file_is_named(tmp_path, planned, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["ab", SMOKE, str(missing), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {missing}: no such scenario file\n"
    assert planned.plans == []


@pytest.mark.parametrize("error", [ABError("v9.9.9: no such git ref"), WorkerDied("the baseline worker exited 1")])
def test_a_plan_that_cannot_be_made_is_bad_input(monkeypatch, capsys, error):
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(ab_command, "plan_ab", refuse)
    assert main(["ab", SMOKE, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {error}\n"


def test_a_baseline_worktree_that_cannot_be_made_is_bad_input(planned, monkeypatch, capsys):
    def refuse(plan, device, keep):
        raise ABError("git worktree add failed: disk full")

    monkeypatch.setattr(ab_command, "run_ab", refuse)
    assert main(["ab", SMOKE, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "moe-bench: error: git worktree add failed: disk full\n"


def test_calibrate_measures_the_noise_and_plans_nothing(planned, monkeypatch, capsys):
    calls = []

    def fake_run_calibration(scenarios, budget, device):
        calls.append(([s.name for s in scenarios], budget, device))
        return ["found"]

    monkeypatch.setattr(ab_command, "run_calibration", fake_run_calibration)
    monkeypatch.setattr(ab_command, "render_calibration", lambda found, budget: f"{found} at {budget:g} s\n")
    assert main(["ab", SMOKE, "--calibrate", "--budget", "20", "--device", "cpu"]) == 0
    assert calls == [(["e8-random-bf16"], 20.0, "cpu")]
    assert capsys.readouterr().out == "['found'] at 20 s\n"
    assert planned.plans == [] and planned.runs == []
