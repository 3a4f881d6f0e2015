"""``moe-bench``: run scenarios, plan, compare, gate, plot and export results.

Exit codes: 0 success; 1 a scenario did not finish ok, or a gate found a regression; 2 bad input
(nothing was run and nothing was written); 130 interrupted, 143 terminated (SIGTERM), each after
stopping its workers. Each command lives in its own module of ``bench.commands``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from bench.commands import (
    ab,
    compare,
    export,
    micro,
    plot,
    profile_device,
    project,
    proxy_check,
    release,
    report,
    run,
    versions,
)
from bench.logs import console_logging
from bench.termination import Terminated, sigterm_as_interrupt

logger = logging.getLogger(__name__)

COMMANDS = (run, compare, export, plot, report, ab, versions, release, project, profile_device, proxy_check, micro)
"""In the order ``moe-bench --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-bench", description=__doc__.splitlines()[0])
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v", "--verbose", action="store_true", help="also log debug lines, each with its module (stderr)"
    )
    loudness.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only (stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["run"]
    args = build_parser().parse_args(argv)
    console_logging(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else None)
    try:
        with sigterm_as_interrupt():
            return args.func(args)
    except Terminated:
        logger.error("moe-bench: terminated")
        return 143
    except KeyboardInterrupt:
        logger.error("moe-bench: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
