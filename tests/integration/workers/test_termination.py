"""SIGTERM stops ``moe-bench`` as Ctrl-C does: the worker, in a session of its own, goes too, and the
command says so (a stopped container, a CI timeout)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from own_processes import owned_processes, owned_processes_after, owner_env
from scenario_files import variant, write_scenario

from bench.results import REPO_ROOT


def _workers(env: dict[str, str]) -> list[int]:
    """The marked worker processes. By command line: moe-bench's short-lived children (git, for the version
    label) carry the marker too, and one of them seen instead of the worker would send the signal early."""
    found = []
    for pid in owned_processes(env):
        with contextlib.suppress(OSError):  # gone meanwhile
            if b"bench.run.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


@pytest.mark.slow
def test_sigterm_stops_a_run_and_its_worker(tmp_path):
    # Enough steps that the worker is still training when the signal comes.
    scenario = write_scenario(tmp_path, "long", variant(run__steps=100_000, run__timeout_s=600))
    env = {**os.environ, **owner_env(), "PYTHONPATH": str(REPO_ROOT)}
    # -X faulthandler: a SIGABRT makes it print every thread's traceback, should it hang before its worker.
    command = [sys.executable, "-X", "faulthandler", "-m", "bench.cli", "run", str(scenario)]
    command += ["--out", str(tmp_path / "r"), "--no-plots", "--device", "cpu"]
    # Files, not pipes: nobody reads a pipe while the test waits, and a full one would stop moe-bench there.
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with out_path.open("w") as out, err_path.open("w") as err:
        moe_bench = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _workers(env) and time.monotonic() < deadline:
            if moe_bench.poll() is not None:  # it ended before starting a worker: say why, not a timeout
                break
            time.sleep(0.2)
        if not _workers(env):
            if moe_bench.poll() is None:
                moe_bench.send_signal(signal.SIGABRT)
                moe_bench.wait(timeout=60)
            pytest.fail(
                f"no worker started within 120 s (moe-bench exit code {moe_bench.returncode}):\n"
                f"stdout: {out_path.read_text()[-2000:]}\nstderr: {err_path.read_text()[-6000:]}"
            )
        time.sleep(1.0)  # into its steps
        moe_bench.send_signal(signal.SIGTERM)
        moe_bench.wait(timeout=60)
        stderr = err_path.read_text()
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
