"""bench.commands.run: ``moe-bench run`` and ``moe-bench plan`` check their files and options before any
worker starts, hand them to the runner, and print the summary; the runner and a launch are stood in for."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import yaml

import bench.commands.run as run_command
import bench.run.launch
import bench.run.runner
from bench.cli import main
from bench.results import REPO_ROOT, metric
from bench.run.console import SilentReporter

SMOKE = str(REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml")
DP2 = str(REPO_ROOT / "scenarios/smoke/e8-dp2-bf16.yaml")


def outcome(name, status="ok", mode="execute", metrics=None, details=None):
    return SimpleNamespace(
        name=name,
        status=status,
        noisy=False,
        metrics=metrics or {},
        details=details or {},
        scenario=SimpleNamespace(name=name, mode=mode),
    )


class FakeRunner:
    """Records how it was made and what it ran; returns ``outcomes``."""

    made: ClassVar[list[dict[str, Any]]] = []
    outcomes: ClassVar[list] = []

    def __init__(self, device, out_root, **kwargs):
        self.made.append({"device": device, "out_root": out_root, **kwargs})
        self.out_dir = Path(out_root) / "0.3.0" / "m"

    def run(self, scenarios):
        self.made[-1]["ran"] = [s.name for s in scenarios]
        return self.outcomes


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(FakeRunner, "made", [])
    monkeypatch.setattr(FakeRunner, "outcomes", [outcome("e8-random-bf16")])
    monkeypatch.setattr(bench.run.runner, "Runner", FakeRunner)
    monkeypatch.setattr(bench.run.launch, "detect_launch", lambda: None)
    return FakeRunner


def test_a_run_hands_its_options_to_the_runner_and_counts_what_was_not_ok(tmp_path, runner, monkeypatch, capsys):
    resumed = {"e8-random-bf16": tmp_path / "ckpt"}
    asked = []

    def fake_checkpoints(scenarios, resume, out_root):
        asked.append(([s.name for s in scenarios], resume, out_root))
        return resumed

    monkeypatch.setattr(run_command, "checkpoints_before_run", fake_checkpoints)
    monkeypatch.setattr(
        FakeRunner, "outcomes", [outcome("a"), outcome("b", "failed"), outcome("c", "skipped"), outcome("d", "oom")]
    )
    out = tmp_path / "results"
    argv = ["run", SMOKE, DP2, "--device", "cpu", "--out", str(out), "--force", "--project-on", "h100-sxm"]
    assert main([*argv, "--resume", "--no-report"]) == 1
    (made,) = runner.made
    assert str(made["device"]) == "cpu"
    assert made["out_root"] == out
    assert (made["plan_only"], made["force"], made["resume"], made["project_devices"]) == (
        False,
        True,
        resumed,
        ["h100-sxm"],
    )
    assert made["ran"] == ["e8-random-bf16", "e8-dp2-bf16"]
    assert asked == [(["e8-random-bf16", "e8-dp2-bf16"], True, out)]
    assert capsys.readouterr().out.splitlines()[-1] == f"4 scenarios, 2 not ok; results in {out / '0.3.0' / 'm'}"


def test_skipped_scenarios_are_not_failures(tmp_path, runner, monkeypatch):
    monkeypatch.setattr(FakeRunner, "outcomes", [outcome("a"), outcome("b", "skipped")])
    assert main(["run", SMOKE, "--device", "cpu", "--out", str(tmp_path), "--no-report"]) == 0


def test_the_report_page_is_rewritten_after_a_run_and_its_failure_only_warns(tmp_path, runner, monkeypatch, capsys):
    built = []

    def fake_build_report(results, out, on_warning):
        built.append((results, out))
        return SimpleNamespace(path=out / "index.html")

    monkeypatch.setattr(run_command, "build_report", fake_build_report)
    assert main(["run", SMOKE, "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert built == [(tmp_path, tmp_path / "report")]
    assert capsys.readouterr().out.splitlines()[-1] == f"report: {tmp_path / 'report' / 'index.html'}"

    def broken(results, out, on_warning):
        raise OSError("disk full")

    monkeypatch.setattr(run_command, "build_report", broken)
    assert main(["run", SMOKE, "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == "moe-bench: warning: the report page failed: disk full\n"
    assert main(["run", SMOKE, "--device", "cpu", "--out", str(tmp_path), "--no-plots"]) == 0  # the old name
    assert len(built) == 1


def test_a_plan_runs_in_this_process_and_prints_one_line_per_scenario(tmp_path, runner, monkeypatch, capsys):
    monkeypatch.setattr(bench.run.launch, "detect_launch", lambda: pytest.fail("a plan is never a launch's rank"))
    monkeypatch.setattr(run_command, "checkpoints_before_run", lambda *a: pytest.fail("a plan resumes nothing"))
    monkeypatch.setattr(run_command, "summary_line", lambda name, metrics, details: f"plan of {name}")
    monkeypatch.setattr(FakeRunner, "outcomes", [outcome("a", mode="plan"), outcome("b", mode="plan")])
    assert main(["plan", SMOKE, "--out", str(tmp_path)]) == 0
    (made,) = runner.made
    assert (str(made["device"]), made["plan_only"]) == ("cpu", True)
    assert capsys.readouterr().out.splitlines() == [
        "plan of a",
        "plan of b",
        f"2 scenarios, 0 not ok; results in {tmp_path / '0.3.0' / 'm'}",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nope.yaml"], "{tmp}/nope.yaml: no such scenario file"),
        (["{tmp}/bad.yaml"], "bad.yaml"),
        ([SMOKE, "--project-on", "h999"], "h999"),
        ([SMOKE, "--out", "{tmp}/file/results"], "{tmp}/file/results: results folder not writable"),
    ],
)
def test_refusals_name_the_bad_input_and_start_nothing(tmp_path, runner, capsys, argv, message):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"schema_version": 1, "mode": "execute", "model": "big"}))
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "results")]
    assert main(["run", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error: ") and message.replace("{tmp}", str(tmp_path)) in err
    assert runner.made == []


def test_a_suite_without_scenarios_is_refused(tmp_path, runner, monkeypatch, capsys):
    suites = []

    def no_files(suite, device):
        suites.append(suite)
        return []

    monkeypatch.setattr(run_command, "suite_files", no_files)
    assert main(["run", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert suites == ["default"]
    assert capsys.readouterr().err == "moe-bench: error: no scenarios to run\n"
    assert runner.made == []


def test_files_and_a_suite_run_together(tmp_path, runner, monkeypatch):
    monkeypatch.setattr(run_command, "suite_files", lambda suite, device: [DP2] if suite == "ci" else [])
    assert main(["run", SMOKE, "--suite", "ci", "--device", "cpu", "--out", str(tmp_path), "--no-report"]) == 0
    assert runner.made[0]["ran"] == ["e8-random-bf16", "e8-dp2-bf16"]


def test_a_checkpoint_that_cannot_be_resumed_is_refused(tmp_path, runner, monkeypatch, capsys):
    def refuse(scenarios, resume, out_root):
        raise ValueError("--resume: e8-random-bf16: no complete checkpoint in results/ckpt")

    monkeypatch.setattr(run_command, "checkpoints_before_run", refuse)
    assert main(["run", SMOKE, "--device", "cpu", "--out", str(tmp_path), "--resume"]) == 2
    assert (
        capsys.readouterr().err
        == "moe-bench: error: --resume: e8-random-bf16: no complete checkpoint in results/ckpt\n"
    )
    assert runner.made == []


def test_a_launchs_other_ranks_run_silently_and_leave(tmp_path, runner, monkeypatch, capsys):
    left = []
    monkeypatch.setattr(bench.run.launch, "detect_launch", lambda: SimpleNamespace(rank=1))
    monkeypatch.setattr(bench.run.launch, "join_launch", lambda launch, device, timeout_s: "rank-1-device")
    monkeypatch.setattr(bench.run.launch, "leave_launch", lambda: left.append(True))
    # Only rank 0 writes results: another rank does not check the folder.
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["run", DP2, "--device", "cpu", "--out", str(blocked / "results")]) == 0
    (made,) = runner.made
    assert (made["device"], made["reporter_factory"], made["launch"].rank) == ("rank-1-device", SilentReporter, 1)
    assert left == [True]
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        ({}, ""),
        ({"fits": None}, ""),
        (
            {"fits": True, "memory_total_gib": 85.23, "cluster": {"device": "b300", "gpu_memory_gib": 268.2}},
            "fits b300 (85.2 of 268.2 GiB)",
        ),
        (
            {"fits": False, "memory_total_gib": 279.44, "cluster": {"device": "b300", "gpu_memory_gib": 268.2}},
            "DOES NOT FIT b300 (279.4 > 268.2 GiB)",
        ),
        ({"fits": True, "cluster": {"name": "h100-8node"}}, "fits h100-8node"),
        ({"fits": False, "memory_total_gib": 90.0}, "DOES NOT FIT the GPU"),
    ],
)
def test_fit_verdict(details, expected):
    assert run_command.fit_verdict(details) == expected


def test_a_proxy_shows_its_first_gpu_projection_marked():
    projections = {
        "h100-sxm": {"tokens_per_s_per_gpu": 12345.6, "tflops_per_gpu": 456.78},
        "b200": {"tokens_per_s_per_gpu": 1.0, "tflops_per_gpu": 1.0},
    }
    proxy = outcome("p", mode="proxy", details={"device_projections": projections})
    assert run_command._proxy_figures(proxy) == ("12,346 (proj. h100-sxm)", "456.8 (proj. h100-sxm)")
    assert run_command._proxy_figures(outcome("p", mode="proxy")) == ("", "")
    partial = outcome("p", mode="proxy", details={"device_projections": {"h100-sxm": {"tflops_per_gpu": 1.0}}})
    assert run_command._proxy_figures(partial) == ("", "")


def test_the_summary_table(capsys):
    executed = outcome(
        "e8",
        metrics={
            "tokens_per_s_per_gpu": metric([12815.4], "tokens/s", "higher"),
            "tflops_per_gpu": metric([0.23024], "TFLOP/s", "higher"),
            "peak_tensor_bytes": metric([2 * 2**30], "bytes", "lower"),
            "total_params": metric([47.1e9], "params", None),
            "active_params": metric([12.9e9], "params", None),
        },
    )
    planned = outcome(
        "big",
        mode="plan",
        details={"fits": False, "memory_total_gib": 90.0, "cluster": {"device": "h100-sxm", "gpu_memory_gib": 80.0}},
    )
    run_command.print_summary([executed, planned])
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if " e8 " in line]
    for cell in ("execute", "ok", "12,815", "0.230", "2.00 GiB", "47.1B / 12.9B"):
        assert cell in row
    (row,) = [line for line in out.splitlines() if " big " in line]
    assert "DOES NOT FIT h100-sxm (90.0 > 80.0 GiB)" in row
    assert "fits the GPU" in out
    run_command.print_summary([executed])
    assert "fits the GPU" not in capsys.readouterr().out
