"""The console log (``bench.logs``): one handler on the ``bench`` logger, plain lines at INFO, the
level from ``-v``/``-q`` or ``MOE_BENCH_LOG``; nothing configured on import."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from bench.cli import build_parser
from bench.logs import ConsoleHandler, console_logging, quieted


@pytest.fixture
def bench_logger():
    """The ``bench`` logger as a test found it, put back after."""
    logger = logging.getLogger("bench")
    before = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(before[0])
    logger.handlers[:] = before[1]


def test_one_handler_whatever_the_calls_and_plain_lines(bench_logger, monkeypatch):
    monkeypatch.delenv("MOE_BENCH_LOG", raising=False)
    stream = io.StringIO()
    console_logging()
    console_logging(stream=stream)
    assert [type(h) for h in bench_logger.handlers if isinstance(h, ConsoleHandler)] == [ConsoleHandler]
    logging.getLogger("bench.run.runner").info("step 1/2 warm-up")
    logging.getLogger("bench.ab.gate").warning("versions: warning: skipped")
    logging.getLogger("bench.ab.gate").debug("not shown at INFO")
    assert stream.getvalue() == "step 1/2 warm-up\nversions: warning: skipped\n"


def test_the_level_from_the_environment_and_debug_lines_name_their_module(bench_logger, monkeypatch):
    monkeypatch.setenv("MOE_BENCH_LOG", "debug")
    stream = io.StringIO()
    console_logging(stream=stream)
    logging.getLogger("bench.run.trace").debug("1,024 ops")
    assert stream.getvalue() == "bench.run.trace: 1,024 ops\n"
    console_logging(logging.WARNING, stream=stream)
    logging.getLogger("bench.run.trace").info("hidden")
    assert stream.getvalue() == "bench.run.trace: 1,024 ops\n"


def test_the_handler_writes_to_the_stderr_of_the_moment(bench_logger, monkeypatch):
    """A live display swaps ``sys.stderr`` while it draws; the lines go where stderr is now."""
    console_logging()
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)
    logging.getLogger("bench.run").info("a line")
    assert swapped.getvalue() == "a line\n"


def test_quieted_passes_warnings_only_and_restores(bench_logger, caplog):
    logger = logging.getLogger("bench.run.process.output")
    caplog.set_level(logging.INFO)
    with quieted(logger):
        logger.info("hidden")
        logger.warning("shown")
    logger.info("after")
    assert caplog.messages == ["shown", "after"]


def test_verbose_and_quiet_flags():
    parser = build_parser()
    assert parser.parse_args(["-v", "run"]).verbose and parser.parse_args(["-q", "run"]).quiet
    with pytest.raises(SystemExit):
        parser.parse_args(["-v", "-q", "run"])
