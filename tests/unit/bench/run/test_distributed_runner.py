"""moe-bench run with multi-rank layouts: torchrun launch, gathered metrics, dead and hung ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_runner import write_scenario

from bench.cli import main
from bench.results import load_results
from bench.run.launch import detect_launch

pytestmark = pytest.mark.slow


def run(tmp_path: Path, scenarios: dict[str, dict], env: dict[str, str] | None = None):
    files = [str(write_scenario(tmp_path, name, data)) for name, data in scenarios.items()]
    out = tmp_path / "results"
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        code = main(["run", *files, "--out", str(out), "--device", "cpu"])
    finally:
        os.environ.clear()
        os.environ.update(old)
    return code, {d.name: d for d in load_results(out)} if out.exists() else {}


def test_launch_detection():
    assert detect_launch({}) is None
    assert detect_launch({"WORLD_SIZE": "1", "RANK": "0"}) is None
    torchrun = detect_launch({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert (torchrun.rank, torchrun.world_size, torchrun.source) == (2, 4, "torchrun")
    slurm = detect_launch({"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.source) == (5, 8, 1, "slurm")
