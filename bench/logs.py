"""The benchmark's console log: one handler on the ``bench`` logger, installed by an entry point.

Modules log through ``logging.getLogger(__name__)``; nothing is configured on import, so a library
user (or a test, through ``caplog``) decides where the records go. ``moe-bench`` and each
``python -m bench.<module>`` entry point call ``console_logging`` once: records of level INFO and
above are written as their plain message, so the console reads as a list of lines; ``-v`` (or
``MOE_BENCH_LOG=debug``) adds the debug records, prefixed with their module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import TextIO

ENV_LEVEL = "MOE_BENCH_LOG"
"""Environment variable naming the console's level (``debug``, ``info``, ``warning``, ``error``)."""


class _Plain(logging.Formatter):
    """The message alone; a debug record says which module wrote it."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return f"{record.name}: {message}" if record.levelno < logging.INFO else message


class ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes to the process's current ``sys.stderr`` (or the stream given): a
    live display that redirects stderr while it runs (rich's) keeps the lines above its bars."""

    def __init__(self, stream: TextIO | None = None):
        super().__init__(stream)
        self._fixed = stream

    @property
    def stream(self) -> TextIO:
        return self._fixed if self._fixed is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO | None) -> None:
        self._fixed = value


def console_logging(level: int | str | None = None, stream: TextIO | None = None) -> logging.Handler:
    """Send the ``bench`` logger's records to the console (``stream``, else stderr), one handler whatever
    the calls; ``level``: a ``logging`` level, else ``MOE_BENCH_LOG``, else INFO. Returns the handler."""
    if level is None:
        level = os.environ.get(ENV_LEVEL, "info").upper()
    logger = logging.getLogger("bench")
    for old in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(old)
    handler = ConsoleHandler(stream)
    handler.setFormatter(_Plain("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


@contextlib.contextmanager
def quieted(logger: logging.Logger | str, level: int = logging.WARNING) -> Iterator[None]:
    """Within the block, ``logger`` (or the logger of that name) passes only records of ``level`` and above."""
    logger = logging.getLogger(logger) if isinstance(logger, str) else logger
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
