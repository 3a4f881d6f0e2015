"""What the main job prints: the runner's lines and real warnings, no library chatter from the workers."""

import io
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.run.console import Reporter
from bench.run.process import OUTPUT, QUIET_LIBRARIES, run_with_timeout, worker_env

TWO_RANKS = {
    "schema_version": 1,
    "description": "two ranks of a tiny layout, profiled once for the work counters",
    "mode": "execute",
    "model": {
        "vocab_size": 256,
        "d_model": 64,
        "n_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "seq_len": 64,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "fp32",
    "parallel": {"dp": 2, "ep": 2, "dispatch": "no-sync", "capacity_factor": 1.25},
    "run": {"warmup_steps": 1, "steps": 2, "tokens_per_step": 256, "timeout_s": 300},
}

# Kineto's trace markers and c10's C++ warnings ("[W1202 06:23:14.164 ProcessGroup.hpp:1006] Warning: ...").
CHATTER = re.compile(r"USDT:|STAGE:|SyncActivityProfilerHandler|\[W\d{4} |No backend of type")


def test_the_reporter_shows_a_workers_lines_under_its_scenario_while_open(caplog, monkeypatch):
    monkeypatch.setenv("CI", "1")  # plain lines
    stream, level = io.StringIO(), OUTPUT.level
    reporter = Reporter(1, stream=stream)
    with caplog.at_level(logging.INFO):
        code, tail = run_with_timeout([sys.executable, "-c", "print('step 1/2'); print('work step')"], 60)
        reporter.close()
        OUTPUT.info("after the suite")
    assert code == 0 and tail == ["step 1/2", "work step"]
    assert stream.getvalue() == "    step 1/2\n    work step\n"
    # While the reporter is open it alone takes them; closed, they are plain log lines again.
    assert caplog.messages == ["after the suite"]
    assert OUTPUT.propagate and OUTPUT.level == level


def test_the_worker_environment_quiets_the_libraries_unless_the_caller_chose(monkeypatch):
    for name in QUIET_LIBRARIES:
        monkeypatch.delenv(name, raising=False)
    assert {name: worker_env(2)[name] for name in QUIET_LIBRARIES} == QUIET_LIBRARIES
    monkeypatch.setenv("KINETO_LOG_LEVEL", "4")
    assert worker_env(2)["KINETO_LOG_LEVEL"] == "4"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_multi_rank_run_prints_no_library_chatter(tmp_path):
    scenario = tmp_path / "two-ranks.yaml"
    scenario.write_text(yaml.safe_dump(TWO_RANKS))
    env = {k: v for k, v in os.environ.items() if k not in QUIET_LIBRARIES}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.cli",
            "run",
            str(scenario),
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
            "--no-report",
        ],
        cwd=Path(__file__).resolve().parents[3],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the runner, torchrun and both ranks
        process.communicate()
        raise
    assert process.returncode == 0, output
    assert "work step (counted, untimed)" in output  # the profiled step ran, where the markers came from
    assert [line for line in output.splitlines() if CHATTER.search(line)] == []


def test_plan_rows_give_their_fit_verdict_and_counts_in_t_b_m(tmp_path, capsys):
    """The 1.2T layout needs more than a B300 holds per rank: the summary says so, in GiB, beside
    parameter counts in T and B (hand-checked against the plan's own document)."""
    import json

    from bench.cli import main

    files = ["scenarios/olmo-core3/moe-1.2t-512gpu-fsdp.yaml", "scenarios/olmo-core3/moe-128e-47b.yaml"]
    assert main(["run", *files, "--out", str(tmp_path), "--no-report"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    for name in ("moe-1.2t-512gpu-fsdp", "moe-128e-47b"):
        (path,) = tmp_path.rglob(f"{name}.json")
        doc = json.loads(path.read_text())
        need, have = doc["details"]["memory_total_gib"], doc["details"]["cluster"]["gpu_memory_gib"]
        total = doc["metrics"]["total_params"]["median"]
        if doc["details"]["fits"]:
            assert f"fits b300 ({need:.1f} of {have:.1f} GiB)" in rows[name]
        else:
            assert f"DOES NOT FIT b300 ({need:.1f} > {have:.1f} GiB)" in rows[name]
        assert (need > have) == (not doc["details"]["fits"])
        unit, scale = ("T", 1e12) if total >= 1e12 else ("B", 1e9)
        assert f"{total / scale:.3g}{unit} /" in rows[name]
    assert "DOES NOT FIT" in rows["moe-1.2t-512gpu-fsdp"] and "1.19T /" in rows["moe-1.2t-512gpu-fsdp"]
    assert "fits b300" in rows["moe-128e-47b"]


@pytest.mark.parametrize(
    "n,text",
    [(1193.9e9, "1.19T"), (46.9e9, "46.9B"), (3.18e9, "3.18B"), (3.2e6, "3.2M"), (2.38e12, "2.38T"), (512, "512")],
)
def test_parameter_counts_read_in_t_b_m(n, text):
    from bench.units import format_count

    assert format_count(n) == text
