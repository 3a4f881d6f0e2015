"""``moe-bench plot``: the report page's charts as PNG files, with an index.html of them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.commands.common import EXIT_OK, fail
from bench.results import ResultValidationError


def cmd_plot(args: argparse.Namespace) -> int:
    # heavy: matplotlib, loaded only by this command
    from bench.report.plot import plot_results

    results_dir = Path(args.results_dir)
    if not results_dir.is_dir():
        return fail(f"{results_dir}: no such results folder")
    try:
        written = plot_results(
            results_dir,
            Path(args.out),
            on_bad_file=lambda err: print(f"moe-bench: warning: {err}; skipped", file=sys.stderr),
        )
    except (ResultValidationError, ValueError) as err:
        return fail(str(err))
    print(f"wrote {len(written)} files; open {Path(args.out) / 'index.html'}")
    return EXIT_OK


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    plot = sub.add_parser(
        "plot", help="the report page's charts as PNG files (and a trend of every metric), with an index.html"
    )
    plot.add_argument("results_dir")
    plot.add_argument("--out", required=True)
    plot.set_defaults(func=cmd_plot)
