"""SIGTERM stops ``moe-bench`` as Ctrl-C does: the worker, in a session of its own, goes too, and the
command says so (a stopped container, a CI timeout)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from own_processes import owned_processes, owned_processes_after, owner_env
from scenario_files import variant, write_scenario

from bench.results import REPO_ROOT


@pytest.mark.slow
def test_sigterm_stops_a_run_and_its_worker(tmp_path):
    # Enough steps that the worker is still training when the signal comes.
    scenario = write_scenario(tmp_path, "long", variant(run__steps=100_000, run__timeout_s=600))
    env = {**os.environ, **owner_env(), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "bench.cli", "run", str(scenario), "--out", str(tmp_path / "r"), "--no-plots"]
    moe_bench = subprocess.Popen(
        [*command, "--device", "cpu"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not [p for p in owned_processes(env) if p != moe_bench.pid] and time.monotonic() < deadline:
            if moe_bench.poll() is not None:  # it ended before starting a worker: say why, not a timeout
                break
            time.sleep(0.2)
        workers = [p for p in owned_processes(env) if p != moe_bench.pid]
        if not workers:
            if moe_bench.poll() is None:
                moe_bench.kill()
            _, stderr = moe_bench.communicate(timeout=60)
            pytest.fail(
                f"no worker started within 120 s (moe-bench exit code {moe_bench.returncode}):\n{stderr[-3000:]}"
            )
        time.sleep(1.0)  # into its steps
        moe_bench.send_signal(signal.SIGTERM)
        _, stderr = moe_bench.communicate(timeout=60)
        left = owned_processes_after(env, timeout=30)
    finally:
        for pid in owned_processes(env):
            os.kill(pid, signal.SIGKILL)
        if moe_bench.poll() is None:
            moe_bench.kill()
    assert moe_bench.returncode == 143 and "moe-bench: terminated" in stderr, stderr[-2000:]
    assert left == [], f"processes left behind: {left}"


def test_an_interrupt_while_relaying_a_worker_kills_its_session(caplog):
    """A worker that prints a line and then stays silent (a long step) would outlive its parent: it
    only notices a closed pipe when it next writes. The interrupt kills its session at once."""
    from bench.run.process import OUTPUT, run_with_timeout

    env = {**os.environ, **owner_env()}
    silent = "import time; print('step 1', flush=True); time.sleep(120)"

    class Interrupting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise KeyboardInterrupt  # as SIGTERM raises it (bench.termination), while the line is relayed

    handler = Interrupting()
    OUTPUT.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger=OUTPUT.name), pytest.raises(KeyboardInterrupt):
            run_with_timeout([sys.executable, "-c", silent], 60, env=env)
        left = owned_processes_after(env, timeout=5)
    finally:
        OUTPUT.removeHandler(handler)
        for pid in owned_processes(env):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"the worker outlived the interrupt: {left}"
