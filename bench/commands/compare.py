"""``moe-bench compare`` and ``moe-bench gate``: two result sets metric by metric, and the gate's verdict."""

from __future__ import annotations

import argparse

from rich.console import Console

from bench.commands.common import (
    ACCEPT_HELP,
    ACCEPT_WORK_HELP,
    EXIT_OK,
    accepted_work,
    fail,
    load_side,
    parse_accept_options,
)
from bench.gate.compare import compare
from bench.gate.formatting import parse_tolerance
from bench.gate.tables import render_rich_table
from bench.gate.verdict import accept_changes, accepted_lines, gate
from bench.gate.work import work_findings


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        accept = accepted_work(args.accept_work)
        base, cand = load_side(args.base), load_side(args.cand)
        acceptances = parse_accept_options(args.accept, [*base, *cand])
        comparison = accept_changes(compare(base, cand), accept, acceptances)
    except (FileNotFoundError, ValueError) as err:
        return fail(str(err))

    Console(width=160).print(render_rich_table(comparison, title=f"{args.base} -> {args.cand}"))
    for issue in comparison.issues:
        print(issue.describe())
    for line in accepted_lines(comparison) + work_findings(comparison, accept, acceptances):
        print(line)
    return EXIT_OK


def cmd_gate(args: argparse.Namespace) -> int:
    try:
        tolerance = parse_tolerance(args.tolerance)
        accept = accepted_work(args.accept_work)
        base, cand = load_side(args.baseline), load_side(args.candidate)
        acceptances = parse_accept_options(args.accept, [*base, *cand])
        result = gate(compare(base, cand, tolerance), tolerance, accept, acceptances)
    except (FileNotFoundError, ValueError) as err:
        return fail(str(err))
    print(result.report, end="")
    return result.exit_code


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    compare = sub.add_parser("compare", help="compare two result sets metric by metric")
    compare.add_argument("base")
    compare.add_argument("cand")
    compare.add_argument("--accept-work", nargs="?", const="all", metavar="METRICS", help=ACCEPT_WORK_HELP)
    compare.add_argument("--accept", action="append", default=[], metavar="SPEC", help=ACCEPT_HELP)
    compare.set_defaults(func=cmd_compare)

    gate = sub.add_parser("gate", help="exit 1 on a regression outside tolerance and noise, or on more work")
    gate.add_argument("--baseline", required=True)
    gate.add_argument("--candidate", required=True)
    gate.add_argument("--tolerance", default="5%")
    gate.add_argument("--accept-work", nargs="?", const="all", metavar="METRICS", help=ACCEPT_WORK_HELP)
    gate.add_argument("--accept", action="append", default=[], metavar="SPEC", help=ACCEPT_HELP)
    gate.set_defaults(func=cmd_gate)
