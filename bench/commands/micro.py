"""``moe-bench micro``: the micro-benchmarks folded into a result document."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_micro(args: argparse.Namespace) -> int:
    # heavy: torch and the engine, loaded only when this command runs
    from bench.run.micro import run_micro

    return run_micro(args.device, Path(args.out))


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    micro = sub.add_parser("micro", help="run the micro-benchmarks and fold them into a result document")
    micro.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    micro.add_argument("--out", default="results")
    micro.set_defaults(func=cmd_micro)
