"""bench.commands.micro: ``moe-bench micro`` hands its device and results folder to the micro-benchmark run
and returns its exit code; the run itself is stood in for."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.run.micro
from bench.cli import main


@pytest.mark.parametrize(
    ("argv", "device", "out", "code"),
    [([], "cpu", Path("results"), 0), (["--device", "cuda", "--out", "elsewhere/r"], "cuda", Path("elsewhere/r"), 1)],
)
def test_options_reach_the_run_and_its_exit_code_comes_back(monkeypatch, argv, device, out, code):
    calls = []

    def fake_run_micro(device, out):
        calls.append((device, out))
        return code

    monkeypatch.setattr(bench.run.micro, "run_micro", fake_run_micro)
    assert main(["micro", *argv]) == code
    assert calls == [(device, out)]
    assert isinstance(calls[0][1], Path)
