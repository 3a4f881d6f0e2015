"""``moe-bench report``: the self-contained HTML page of a results folder (and its screenshot)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.commands.common import EXIT_OK, fail, unwritable
from bench.gate.formatting import parse_tolerance
from bench.report.page import ReportError, build_report
from bench.report.screenshot import BrowserMissing, chromium, illegible, undrawn, view_page


def cmd_report(args: argparse.Namespace) -> int:
    try:
        tolerance = parse_tolerance(args.tolerance)
        out = Path(args.out) if args.out else Path(args.results) / "report"
        problem = unwritable(out)
        if problem:
            return fail(problem)
        report = build_report(
            Path(args.results),
            out,
            base=args.base,
            new=args.new,
            tolerance=tolerance,
            on_warning=lambda text: print(f"moe-bench: warning: {text}", file=sys.stderr),
        )
    except (ReportError, ValueError) as err:
        return fail(str(err))
    if report.comparison is not None:
        print(
            f"release comparison {report.comparison.versions.base} -> {report.comparison.versions.new}: "
            f"{report.comparison.header}"
        )
        for line in report.comparison.sources:
            print(f"  compared from {line}")
    print(f"wrote {report.path} ({len(report.charts)} charts)")
    if args.screenshot:
        try:
            with chromium() as browser:
                view = view_page(browser, report.path, Path(args.screenshot))
        except (BrowserMissing, OSError) as err:
            return fail(f"--screenshot: {err}")
        problems = undrawn(view) + illegible(view) + [f"browser console: {e}" for e in view.errors]
        if problems:
            return fail(f"--screenshot: the page did not render cleanly: {'; '.join(problems)}")
        print(f"wrote {view.screenshot} (every chart drawn in headless Chromium, no label over another)")
    return EXIT_OK


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    report = sub.add_parser(
        "report",
        help="one self-contained HTML page: problems, the release comparison, trends and the reference experiments",
    )
    report.add_argument("results", help="results folder (results/<version>/<machine>/*.json)")
    report.add_argument("--out", help="folder for index.html (default: RESULTS/report)")
    report.add_argument(
        "--base",
        metavar="VERSION",
        help="baseline version of the comparison (default: the latest release older than --new)",
    )
    report.add_argument("--new", metavar="VERSION", help="candidate version (default: the newest in RESULTS)")
    report.add_argument("--tolerance", default="5%", help="the gate's tolerance for the verdicts (default 5%%)")
    report.add_argument(
        "--screenshot",
        metavar="PNG",
        help="also open the page in headless Chromium and save the whole page there (needs "
        "selenium, chromium and chromium-driver); fails if a chart is not drawn",
    )
    report.set_defaults(func=cmd_report)
