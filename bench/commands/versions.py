"""``moe-bench versions``: one suite in several engine images, compared."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.ab.images import VersionsError, run_versions
from bench.commands.common import fail


def cmd_versions(args: argparse.Namespace) -> int:
    try:
        code, table = run_versions(args.images, args.suite, Path(args.out), args.gpus)
    except VersionsError as err:
        return fail(str(err))
    print(table, end="")
    return code


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    versions = sub.add_parser("versions", help="run one suite in several engine images (Docker) and compare them")
    versions.add_argument("images", nargs="+", metavar="IMAGE")
    versions.add_argument("--suite", default="default")
    versions.add_argument("--out", default="results", help="results root (default: results)")
    versions.add_argument(
        "--gpus",
        choices=["auto", "all", "none"],
        default="auto",
        help="request the host's GPUs (auto: when nvidia-smi lists one)",
    )
    versions.set_defaults(func=cmd_versions)
