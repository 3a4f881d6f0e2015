"""bench.commands.project: ``moe-bench project`` picks the device profiles, refuses what it cannot project
and writes one document per (scenario, profile); the projection itself is stood in for."""

from __future__ import annotations

import json

import pytest

import bench.commands.project as project_command
import bench.run.project
from bench.cli import main
from bench.predict.device import load_profile
from bench.results import REPO_ROOT

MIXTRAL = str(REPO_ROOT / "scenarios/models/mixtral-8x7b.yaml")  # cluster.device: h100-sxm
SMOKE = str(REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml")  # no cluster


@pytest.fixture
def projected(monkeypatch):
    """Every projection the command asks for, as (scenario, profile, share_stages, breakdown)."""
    calls = []

    def fake_project_on_device(scenario, profile, share_stages=True, breakdown=False):
        calls.append((scenario.name, profile.name, share_stages, breakdown))
        if profile.name == "b200":
            raise bench.run.project.DoesNotFit(f"{scenario.name}: 190 GiB per rank, b200 has 180 GiB")
        return {
            "what": f"{scenario.name} on {profile.name}",
            "assumptions": [],
            "step_s": 1.2345,
            "breakdown": {"pipeline_rank": 3},
        }

    monkeypatch.setattr(bench.run.project, "project_on_device", fake_project_on_device)
    monkeypatch.setattr(bench.run.project, "check_traceable", lambda scenario: None)
    monkeypatch.setattr(bench.run.project, "summary", lambda doc: f"summary: {doc['what']}")
    monkeypatch.setattr(project_command, "format_breakdown", lambda b: f"    table of stage {b['pipeline_rank']}")
    return calls


def test_the_scenarios_own_device_by_default(tmp_path, projected, capsys):
    out = tmp_path / "projections"
    assert main(["project", MIXTRAL, "--out", str(out)]) == 0
    assert projected == [("mixtral-8x7b", "h100-sxm", True, False)]
    path = out / "mixtral-8x7b.h100-sxm.json"
    assert json.loads(path.read_text())["what"] == "mixtral-8x7b on h100-sxm"
    assert capsys.readouterr().out.splitlines() == ["summary: mixtral-8x7b on h100-sxm", f"  written to {path}"]


def test_a_layout_that_does_not_fit_one_device_is_bad_input_and_the_others_are_written(tmp_path, projected, capsys):
    out = tmp_path / "p"
    assert main(["project", MIXTRAL, "--device", "b200", "--device", "h200-sxm", "--out", str(out)]) == 2
    assert [call[1] for call in projected] == ["b200", "h200-sxm"]
    assert sorted(p.name for p in out.iterdir()) == ["mixtral-8x7b.h200-sxm.json"]
    assert capsys.readouterr().err == "moe-bench: error: mixtral-8x7b: 190 GiB per rank, b200 has 180 GiB\n"


def test_a_scenario_without_a_device_needs_one_named(tmp_path, projected, capsys):
    out = tmp_path / "p"
    assert main(["project", SMOKE, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error: ") and err.endswith(
        "e8-random-bf16.yaml: cluster.device: missing; name a device with --device NAME\n"
    )
    assert projected == [] and not out.exists()
    assert main(["project", SMOKE, "--device", "cpu-2core", "--out", str(out)]) == 0
    assert (out / "e8-random-bf16.cpu-2core.json").exists()


def test_an_unknown_device_is_bad_input_before_anything_is_written(tmp_path, projected, capsys):
    out = tmp_path / "p"
    assert main(["project", MIXTRAL, "--device", "h999", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error: ") and "h999" in err
    missing = tmp_path / "measured.yaml"
    assert main(["project", MIXTRAL, "--device", str(missing), "--out", str(out)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert projected == [] and not out.exists()


def test_a_missing_measured_profile_falls_back_and_says_so_everywhere(tmp_path, projected, capsys):
    out, missing = tmp_path / "p", tmp_path / "measured.yaml"
    argv = ["project", MIXTRAL, "--device", str(missing), "--fallback-device", "h100-sxm", "--out", str(out)]
    assert main(argv) == 0
    shipped = load_profile("h100-sxm")
    note = (
        f"{missing}: no such profile file; projected on the shipped profile h100-sxm ({shipped.file}) in its place "
        "(--fallback-device)"
    )
    captured = capsys.readouterr()
    assert captured.err == f"moe-bench: warning: {note}\n"
    doc = json.loads((out / "mixtral-8x7b.h100-sxm.json").read_text())
    assert doc["device_fallback"] == note
    assert doc["assumptions"] == [note]
    assert captured.out.splitlines()[1] == f"  {note}"


def test_the_fallback_is_only_for_a_missing_profile_file(tmp_path, projected, capsys):
    assert main(["project", MIXTRAL, "--device", "h999", "--fallback-device", "h100-sxm", "--out", str(tmp_path)]) == 2
    assert "h999" in capsys.readouterr().err


def test_breakdown_and_every_stage(tmp_path, projected, capsys):
    assert main(["project", MIXTRAL, "--breakdown", "--every-stage", "--out", str(tmp_path / "p")]) == 0
    assert projected == [("mixtral-8x7b", "h100-sxm", False, True)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == [
        "  projected step of stage 3 by op kind and module (1.234 s; hidden: collectives run under compute, not in "
        "the step):",
        "    table of stage 3",
    ]


def test_an_untraceable_layout_or_an_unwritable_folder_is_refused(tmp_path, projected, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["project", MIXTRAL, "--out", str(blocker / "p")]) == 2
    assert capsys.readouterr().err.startswith(f"moe-bench: error: {blocker / 'p'}: results folder not writable")

    def untraceable(scenario):
        raise bench.run.project.NotTraceable(f"{scenario.file}: parallel.dp_mode: fsdp with pipeline stages")

    monkeypatch.setattr(bench.run.project, "check_traceable", untraceable)
    assert main(["project", MIXTRAL, "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.endswith(": parallel.dp_mode: fsdp with pipeline stages\n")
    assert projected == []
