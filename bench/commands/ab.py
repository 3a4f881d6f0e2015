"""``moe-bench ab``: the A/B gate of a baseline git ref against this checkout."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.ab.calibration import render_calibration, run_calibration
from bench.ab.gate import run_ab
from bench.ab.plan import ABError, plan_ab
from bench.ab.resident import WorkerDied
from bench.commands.common import ACCEPT_HELP, EXIT_OK, accepted_increases, accepted_work, fail, parse_accept_options
from bench.gate.formatting import parse_tolerance
from bench.run.suites import expand_paths, load_all, resolve_device, suite_files
from bench.scenario import ScenarioError


def cmd_ab(args: argparse.Namespace) -> int:
    try:
        tolerance = parse_tolerance(args.tolerance)
        device = resolve_device(args.device)
        files = expand_paths(args.files) if args.files else suite_files(args.suite or "ci", device)
        missing = [f for f in files if not Path(f).exists()]
        if missing:
            return fail(f"{missing[0]}: no such scenario file")
        accept = accepted_work(args.accept_work)
        accept_increase = accepted_increases(args.accept_increase)
        acceptances = tuple(parse_accept_options(args.accept, with_releases=False))
        scenarios = load_all(files)
        if args.calibrate:
            found = run_calibration(scenarios, args.budget, device=device.type)
            print(render_calibration(found, args.budget), end="")
            return EXIT_OK
        keep = Path(args.out) if args.out else None
        if keep is not None and keep.exists() and any(keep.iterdir()):
            return fail(f"{keep}: --out must be a new or empty folder")
        plan = plan_ab(
            args.baseline_ref,
            scenarios,
            tolerance,
            args.budget,
            accept_work=accept,
            accept_increase=accept_increase,
            acceptances=acceptances,
            warn_above=parse_tolerance(args.warn_above) if args.warn_above else None,
            deadline_s=args.deadline,
        )
    except (ABError, ScenarioError, ValueError, WorkerDied) as err:
        return fail(str(err))
    print(
        f"ab: baseline {plan.label} ({plan.commit[:12]}) vs this checkout: {len(plan.scenarios)} scenario(s), "
        f"resident blocks for up to {plan.budget_s:g} s each"
        + (f", the whole gate within {plan.deadline_s:g} s" if plan.deadline_s is not None else ""),
        flush=True,
    )
    try:
        report = run_ab(plan, device=device.type, keep=keep)
    except ABError as err:  # the baseline worktree could not be made
        return fail(str(err))
    print(report.render(), end="")
    return report.exit_code


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    ab = sub.add_parser("ab", help="A/B gate: a baseline git ref and this checkout alternately, paired ratios")
    ab.add_argument("files", nargs="*", help="scenario files or folders (default: the --suite)")
    ab.add_argument("--baseline-ref", help="git ref of the baseline (default: the latest release in releases.json)")
    ab.add_argument("--suite", help="suite from scenarios/suites.yaml (default: ci)")
    ab.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds of alternating resident blocks per scenario, at most (default 60)",
    )
    ab.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="the whole gate's time limit: a scenario's extension and confirmation pairs are cut to fit it, "
        "keeping time for the scenarios after it (docs/gates-and-releases.md#the-operating-point; default: none)",
    )
    ab.add_argument(
        "--calibrate",
        action="store_true",
        help="A/A on this machine: the noise floor and the smallest tolerance for --budget",
    )
    ab.add_argument(
        "--accept-work",
        nargs="?",
        const="all",
        metavar="METRICS",
        help="accept an increase of these work metrics (comma-separated; none given: all)",
    )
    ab.add_argument(
        "--accept-increase",
        metavar="METRICS",
        help="accept a regression of these exact metrics, e.g. peak_tensor_bytes (comma-separated): "
        "reported as accepted, not failed",
    )
    ab.add_argument(
        "--accept",
        action="append",
        default=[],
        metavar="SPEC",
        help=ACCEPT_HELP + "; the resident blocks measure step_time_s",
    )
    ab.add_argument(
        "--tolerance",
        default="5%",
        help="a step-time slowdown beyond this fails the gate (default 5%%; CI's operating point: "
        "docs/gates-and-releases.md#the-operating-point)",
    )
    ab.add_argument(
        "--warn-above",
        metavar="PERCENT",
        help="a step-time slowdown beyond this but within --tolerance is a WARNING that passes (default: none)",
    )
    ab.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ab.add_argument("--out", help="keep every run's result document here (default: discarded)")
    ab.set_defaults(func=cmd_ab)
