"""``moe-bench profile-device``: measure this device's curves into a device profile."""

from __future__ import annotations

import argparse

from bench.commands.common import EXIT_OK, fail
from bench.predict.device import ProfileError


def cmd_profile_device(args: argparse.Namespace) -> int:
    # heavy: torch and the engine, loaded only when this command runs
    from bench.run.profile.measure import ProfileOptions, profile_device_command

    if args.threads < 1 or args.ranks < 1:
        return fail("--threads and --ranks: must be at least 1")
    options = ProfileOptions(
        device=args.device, threads=args.threads, name=args.name, base=args.base, ranks=args.ranks, quick=args.quick
    )
    try:
        profile_device_command(options, args.out, tiny=args.tiny)
    except (ValueError, ProfileError) as err:
        return fail(str(err))
    return EXIT_OK


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    profile = sub.add_parser(
        "profile-device",
        help="measure this device's GEMM, grouped-GEMM, attention and memory curves into a "
        "device profile (devices/NAME.yaml)",
    )
    profile.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    profile.add_argument("--threads", type=int, default=1, help="CPU threads per rank while measuring (default 1)")
    profile.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="ranks one host runs: the gloo links are measured between this many processes (CPU)",
    )
    profile.add_argument("--name", help="profile name (default: from the device)")
    profile.add_argument(
        "--base", help="on a GPU: the profile whose peaks, network and sources to keep (e.g. h200-sxm)"
    )
    profile.add_argument("--out", help="file to write (default devices/NAME.yaml)")
    profile.add_argument(
        "--quick",
        action="store_true",
        help="20 ms per point, on a GPU a smaller sweep (a check within a device budget)",
    )
    profile.add_argument(
        "--tiny", action="store_true", help="a few seconds' sweep of tiny sizes (bench/gpu-check.sh --dry-run on a CPU)"
    )
    profile.set_defaults(func=cmd_profile_device)
