"""``moe-bench proxy-check``: projection against measurement on real multi-rank runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.commands.common import EXIT_FAILED, EXIT_OK, fail, unwritable
from bench.predict.device import ProfileError, load_profile
from bench.run.suites import expand_paths, load_all, resolve_device
from bench.scenario import ScenarioError
from moe_engine.parallel.layout import check_proxy_layout


def cmd_proxy_check(args: argparse.Namespace) -> int:

    # heavy: torch and the engine, loaded only when this command runs
    from bench.run.runner import Runner
    from bench.validate.proxy_check import DEFAULT_SCENARIOS, check

    try:
        scenarios = load_all(expand_paths(args.files or list(DEFAULT_SCENARIOS)))
    except ScenarioError as err:
        return fail(str(err))
    bad = [s for s in scenarios if s.mode != "execute" or s.world_size < 2]
    if bad:
        return fail(f"{bad[0].file}: proxy-check needs execute scenarios of 2 ranks or more")

    for scenario in scenarios:
        try:
            check_proxy_layout(scenario.parallel_config)
        except ValueError as err:
            return fail(f"{scenario.file}: {err}")
    problem = unwritable(Path(args.out))
    if problem:
        return fail(problem)
    if args.runs < 1:
        return fail(f"--runs: must be at least 1, got {args.runs}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        return fail(f"--warmup-steps: must be at least 0, got {args.warmup_steps}")
    profile = None
    if args.device_profile:
        try:
            profile = load_profile(args.device_profile)
        except ProfileError as err:
            return fail(str(err))
    runner = Runner(resolve_device("cpu"), Path(args.out))
    try:
        report = check(runner, scenarios, runs=args.runs, profile=profile, warmup_steps=args.warmup_steps)
    except RuntimeError as err:
        print(f"moe-bench: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    for world, net in report["networks"].items():
        print(f"gloo links, {world} ranks: latency {net['latency_us']:.1f} us, {net['gbps']:.2f} GB/s")
    for row in report["rows"]:
        if row["status"] != "ok":
            print(f"{row['scenario']} run {row['run'] + 1}: real run {row['status']}: {row['error']}")
            continue
        gaps = ", ".join(f"{g:+.1%}" for g in row["plan_memory_gap"])
        op_level = f", op-level {row['op_level_error']:+.1%}" if "op_level_error" in row else ""
        print(
            f"{row['scenario']} run {row['run'] + 1}: measured {row['measured_step_s'] * 1e3:.1f} ms/step, projected "
            f"{row['projected_step_s'] * 1e3:.1f} ms/step (skew cv {row['step_time_cv']:.3f}), error "
            f"{row['error']:+.1%} ({row['error_without_skew']:+.1%} without skew){op_level}; plan vs proxy memory {gaps}"
        )
    for name, entry in report["summary"].items():
        op_level = (
            f", op-level {entry['median_op_level_error']:+.1%}" if entry["median_op_level_error"] is not None else ""
        )
        print(
            f"{name}: median error over {entry['runs']} runs {entry['median_error']:+.1%} "
            f"({entry['median_error_without_skew']:+.1%} without skew){op_level}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return EXIT_OK if all(r["status"] == "ok" for r in report["rows"]) else EXIT_FAILED


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    check = sub.add_parser(
        "proxy-check", help="projection vs measurement: real multi-rank runs here and proxies of each of their ranks"
    )
    check.add_argument("files", nargs="*", help="execute scenarios of 2+ ranks (default: the 2-rank smoke layouts)")
    check.add_argument("--out", default="results", help="results root for the runs (default: results)")
    check.add_argument("--json", default=None, help="also write the report here")
    check.add_argument("--runs", type=int, default=1, help="real runs of each scenario (default 1)")
    check.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="untimed steps before the timed ones, replacing the scenarios' own (a fresh process "
        "runs its first steps slower; a device profile prices the steady state)",
    )
    check.add_argument(
        "--device-profile",
        metavar="PROFILE",
        help="also check the op-level projection on this device profile (e.g. cpu-2core, the "
        "profile of the machine it runs on) against the same real runs",
    )
    check.set_defaults(func=cmd_proxy_check)
