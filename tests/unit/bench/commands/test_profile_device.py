"""bench.commands.profile_device: ``moe-bench profile-device`` checks its counts and hands its options on;
the measurement itself is stood in for."""

from __future__ import annotations

import pytest

import bench.run.profile.measure
from bench.cli import main
from bench.predict.device import ProfileError
from bench.run.profile.measure import ProfileOptions


@pytest.fixture
def measured(monkeypatch):
    calls = []
    monkeypatch.setattr(
        bench.run.profile.measure,
        "profile_device_command",
        lambda options, out, tiny=False: calls.append((options, out, tiny)),
    )
    return calls


def test_options_reach_the_measurement(measured, capsys):
    argv = ["profile-device", "--device", "cuda:1", "--threads", "4", "--ranks", "8", "--name", "mine"]
    assert main([*argv, "--base", "h200-sxm", "--out", "p.yaml", "--quick", "--tiny"]) == 0
    expected = ProfileOptions(device="cuda:1", threads=4, name="mine", base="h200-sxm", ranks=8, quick=True)
    assert measured == [(expected, "p.yaml", True)]
    assert capsys.readouterr() == ("", "")


def test_defaults(measured):
    assert main(["profile-device"]) == 0
    assert measured == [(ProfileOptions(device="cpu", threads=1, ranks=2, quick=False), None, False)]


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--ranks", "0"], ["--threads", "-2", "--ranks", "3"]])
def test_counts_below_one_are_refused_before_measuring(measured, capsys, argv):
    assert main(["profile-device", *argv]) == 2
    assert capsys.readouterr().err == "moe-bench: error: --threads and --ranks: must be at least 1\n"
    assert measured == []


@pytest.mark.parametrize("error", [ProfileError("h999: no such device profile"), ValueError("cuda:7: no such device")])
def test_a_refused_measurement_is_one_line_of_bad_input(monkeypatch, capsys, error):
    def refuse(options, out, tiny=False):
        raise error

    monkeypatch.setattr(bench.run.profile.measure, "profile_device_command", refuse)
    assert main(["profile-device", "--device", "cuda:7"]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {error}\n"
