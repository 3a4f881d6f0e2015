"""Starting and stopping processes, in one place for every part of ``bench`` that does: the worker's
command and environment, a command run with its output relayed and a timeout, and killing a process
with its whole group and the descendants that left it (Linux ``/proc``).

A process is started in a session of its own (``start_new_session``), so that neither Ctrl-C nor
SIGTERM reaches it directly: whoever started it kills it on the way out (``kill_process_group``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

OUTPUT = logging.getLogger(f"{__name__}.output")
"""Where ``run_with_timeout`` relays a started process's output, one INFO record a line: the console
shows them, or, while a suite runs, the runner's console (``bench.run.console.Reporter``)."""


def worker_command(world_size: int) -> list[str]:
    """The worker, under torchrun when the layout has several ranks (one process per rank)."""
    if world_size == 1:
        return [sys.executable, "-m", "bench.run.worker"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "--max-restarts=0",
        "-m",
        "bench.run.worker",
    ]


QUIET_LIBRARIES = {
    # The profiler's trace markers (USDT profiler_start/stop, one pair per profiled step and rank) print
    # at Kineto's highest level, so only a level above every one of them silences them.
    "KINETO_LOG_LEVEL": "6",
    # c10's C++ warnings, e.g. "No backend of type 0 found ... Assuming no hooks are registered" from every
    # rank as its process groups are destroyed; Python-level warnings are not affected.
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}
"""Log levels of the worker environment that keep library chatter off the user's console; a value the
caller's environment already sets wins (``KINETO_LOG_LEVEL=4 moe-bench run ...`` shows Kineto's errors)."""


def worker_env(world_size: int) -> dict[str, str]:
    """Share the cores between the ranks instead of letting each rank spawn a thread per core; quiet
    the libraries (``QUIET_LIBRARIES``)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    for name, value in QUIET_LIBRARIES.items():
        env.setdefault(name, value)
    return env


def run_with_timeout(
    command: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, list[str]]:
    """Run ``command``, relaying its output lines (``OUTPUT``); kill its whole process group after ``timeout``.

    Returns (exit code or None on timeout, the last output lines).
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        return _relay(process, lines, time.monotonic() + timeout)
    except BaseException:
        # Interrupted (Ctrl-C, or SIGTERM through bench.termination): the worker's own session gets
        # neither signal.
        kill_process_group(process)
        raise


def _relay(process: subprocess.Popen, lines: queue.Queue[str | None], deadline: float) -> tuple[int | None, list[str]]:
    """``run_with_timeout``'s loop: relay lines until the output ends (then wait) or the deadline passes."""
    tail: list[str] = []
    finished_output = False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            kill_process_group(process)
            return None, tail
        try:
            line = lines.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            line = ""
        if line is None:
            finished_output = True
        elif line:
            tail = (tail + [line])[-20:]
            OUTPUT.info(line)
        if finished_output:
            try:
                return process.wait(timeout=max(0.0, deadline - time.monotonic())), tail
            except subprocess.TimeoutExpired:
                kill_process_group(process)
                return None, tail


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # The command name may contain spaces; the parent pid follows its closing parenthesis.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_process_group(process: subprocess.Popen) -> None:
    """Kill the process, its process group, and descendants that left the group (torchrun's ranks)."""
    stragglers = descendants(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone (a zombie group: EPERM)
        os.killpg(process.pid, signal.SIGKILL)
    for pid in stragglers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def session_processes(sid: int) -> list[int]:
    """Live processes of a session: a worker (its session leader) and its ranks."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)
