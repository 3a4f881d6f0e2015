"""``moe-bench export``: metrics for CI dashboards."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.commands.common import EXIT_OK, fail, load_side
from bench.report.export import export_files


def cmd_export(args: argparse.Namespace) -> int:
    try:
        files = export_files(load_side(args.results, skip_bad=True), args.format, include_machine=args.include_machine)
    except (FileNotFoundError, ValueError) as err:
        return fail(str(err))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in files.items():
        target = out.parent / f"{out.name}{suffix}"
        target.write_text(text)
        print(f"wrote {target}")
    return EXIT_OK


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    export = sub.add_parser("export", help="export metrics for CI dashboards")
    export.add_argument("results")
    export.add_argument("--format", required=True, choices=["github-action-benchmark", "bencher"])
    export.add_argument("--out", default="moe-bench-export", help="output path prefix (suffixes are added)")
    export.add_argument("--include-machine", action="store_true", help="prefix names with the machine")
    export.set_defaults(func=cmd_export)
