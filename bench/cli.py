"""``moe-bench``: run scenarios, plan, compare, gate, plot and export results.

Exit codes: 0 success; 1 a scenario did not finish ok, or a gate found a regression; 2 bad input
(nothing was run and nothing was written); 130 interrupted, 143 terminated (SIGTERM), each after
stopping its workers. Each command lives in its own module of ``bench.commands``.
"""

from __future__ import annotations

import argparse
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
from bench.termination import Terminated, sigterm_as_interrupt

COMMANDS = (run, compare, export, plot, report, ab, versions, release, project, profile_device, proxy_check, micro)
"""In the order ``moe-bench --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["run"]
    args = build_parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():
            return args.func(args)
    except Terminated:
        print("moe-bench: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("moe-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
