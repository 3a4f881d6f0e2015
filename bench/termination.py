"""SIGTERM handled as Ctrl-C, so that a stopped container or a CI timeout runs the interrupt's cleanups.

Workers run in sessions of their own (a timeout kills each with its ranks), so neither signal reaches
them: every place that starts one kills it on the way out of an interrupt. Python's default SIGTERM
action ends the process without unwinding, which would leave them running, and temporary trees behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``) in the main thread; the
    previous handler comes back after it. Outside the main thread (where no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
