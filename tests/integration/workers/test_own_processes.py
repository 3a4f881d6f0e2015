"""``own_processes``: the scan the multi-process tests use finds the processes a test started, their
children too, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from own_processes import owned_processes, owned_processes_after, owner_env

# A child that starts a grandchild and waits on it: both inherit the environment they are given.
PARENT = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(300)'])"


def _once_running(env: dict[str, str], count: int, timeout: float = 60.0) -> list[int]:
    """The marked processes once ``count`` of them run (the grandchild starts a moment after its parent)."""
    deadline = time.monotonic() + timeout
    while len(found := owned_processes(env)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_the_marked_tree_is_found_and_an_unmarked_twin_is_not():
    env = owner_env()
    ours = subprocess.Popen([sys.executable, "-c", PARENT], env={**os.environ, **env}, start_new_session=True)
    # The same code under another marker: another test's processes, or another container's.
    theirs = subprocess.Popen([sys.executable, "-c", PARENT], env={**os.environ, **owner_env()}, start_new_session=True)
    try:
        found = _once_running(env, 2)
        assert ours.pid in found and len(found) == 2 and theirs.pid not in found, found
    finally:
        for process in (ours, theirs):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
    assert owned_processes_after(env) == []
