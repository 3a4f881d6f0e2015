"""The processes a test started, found by a marker in their environment.

A test sets ``MOE_TEST_OWNER`` to a value of its own (``owner_env``) before it starts anything; every
process it starts, and theirs, inherits it. Scanning by command line or session would also find the
processes of another test, or of another container sharing the host's process table, that run the
same code.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

OWNER = "MOE_TEST_OWNER"


def owner_env() -> dict[str, str]:
    """The environment entry that marks the processes of one test."""
    return {OWNER: uuid.uuid4().hex}


def owned_processes(env: dict[str, str]) -> list[int]:
    """Live processes (zombies left out) whose environment carries the marker of ``env``."""
    entry = f"{OWNER}={env[OWNER]}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # The command name may contain spaces; the state follows its closing parenthesis.
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environment = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):  # gone meanwhile, or another user's
            continue
        if state != "Z" and entry in environment:
            found.append(int(proc.name))
    return sorted(found)


def owned_processes_after(env: dict[str, str], timeout: float = 30.0) -> list[int]:
    """The marked processes still alive once they are all gone or ``timeout`` seconds have passed
    (a killed process takes a moment to exit)."""
    deadline = time.monotonic() + timeout
    while (left := owned_processes(env)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
