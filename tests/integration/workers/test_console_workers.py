"""The console while workers run: their lines under their scenario, and no library chatter from the ranks of
a multi-rank run."""

import io
import logging
import os
import re
import signal
import subprocess
import sys

import pytest
import yaml

from bench.results import REPO_ROOT
from bench.run.console import Reporter
from bench.run.process import OUTPUT, QUIET_LIBRARIES, run_with_timeout

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
        cwd=REPO_ROOT,
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
