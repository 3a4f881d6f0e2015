"""``moe-bench project``: a layout's step on a device kind, every op of a rank's full-size step priced on its profile."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.commands.common import EXIT_BAD_INPUT, fail, unwritable
from bench.predict.breakdown import format_breakdown
from bench.predict.device import DeviceProfile, ProfileError, load_profile
from bench.run.console import trace_display
from bench.run.suites import expand_paths, load_all
from bench.scenario import ScenarioError


def cmd_project(args: argparse.Namespace) -> int:

    # heavy: torch and the engine, loaded only when this command runs
    from bench.run.project import (
        DoesNotFit,
        NotTraceable,
        check_traceable,
        project_on_device,
        summary,
    )

    devices: list[tuple[DeviceProfile, str | None]] = []  # (profile, why it stands in for the --device given, or None)
    try:
        scenarios = load_all(expand_paths(args.files))
        for name in args.device or []:
            path = Path(name)
            if args.fallback_device and path.suffix in (".yaml", ".yml") and not path.exists():
                # A measurement that did not happen (bench/gpu-check.sh's profile step): project on the
                # shipped profile all the same, and say so wherever the numbers go.
                profile = load_profile(args.fallback_device)
                note = (
                    f"{name}: no such profile file; projected on the shipped profile {profile.name} "
                    f"({profile.file}) in its place (--fallback-device)"
                )
                print(f"moe-bench: warning: {note}", file=sys.stderr)
                devices.append((profile, note))
            else:
                devices.append((load_profile(name), None))
    except (ScenarioError, ProfileError) as err:
        return fail(str(err))
    for scenario in scenarios:
        if not devices and not (scenario.cluster and scenario.cluster.device):
            return fail(f"{scenario.file}: cluster.device: missing; name a device with --device NAME")
        try:
            check_traceable(scenario)
        except NotTraceable as err:
            return fail(str(err))
    problem = unwritable(Path(args.out))
    if problem:
        return fail(problem)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = 0
    for scenario in scenarios:
        targets = devices
        if not targets:
            # Checked above: without --device every scenario names its cluster's device.
            assert scenario.cluster is not None and scenario.cluster.device is not None
            targets = [(load_profile(scenario.cluster.device), None)]
        for profile, fallback in targets:
            try:
                with trace_display(sys.stderr):
                    doc = project_on_device(
                        scenario,
                        profile,
                        share_stages=not args.every_stage,
                        breakdown=args.breakdown,
                    )
            except DoesNotFit as err:
                print(f"moe-bench: error: {err}", file=sys.stderr)
                code = EXIT_BAD_INPUT
                continue
            if fallback:
                doc["device_fallback"] = fallback
                doc["assumptions"].append(fallback)
            path = out / f"{scenario.name}.{profile.name}.json"
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(summary(doc))
            if fallback:
                print(f"  {fallback}")
            if args.breakdown:
                b = doc["breakdown"]
                print(
                    f"  projected step of stage {b['pipeline_rank']} by op kind and module "
                    f"({doc['step_s']:.3f} s; hidden: collectives run under compute, not in the step):"
                )
                print(format_breakdown(b))
            print(f"  written to {path}")
    return code


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    project = sub.add_parser(
        "project", help="a layout's step on a device kind, every op of a rank's full-size step priced on its profile"
    )
    project.add_argument("files", nargs="+", help="scenario files or folders (any mode)")
    project.add_argument(
        "--device",
        action="append",
        help="device profile name (devices/NAME.yaml) or file; repeat for several "
        "(default: the scenario's cluster.device)",
    )
    project.add_argument(
        "--out",
        default="results/projections",
        help="folder for the projection documents (default: results/projections; the result loaders, "
        "moe-bench report and gate, pass over a folder named projections)",
    )
    project.add_argument(
        "--fallback-device",
        metavar="NAME",
        help="a --device file that does not exist is replaced by this profile, with a warning and "
        "the replacement recorded in each document (device_fallback)",
    )
    project.add_argument(
        "--breakdown",
        action="store_true",
        help="also print and write (the document's breakdown) the projected step by op kind and by "
        "engine module: time, bytes moved, FLOPs, kernels, share of the step",
    )
    project.add_argument(
        "--every-stage",
        action="store_true",
        help="trace every pipeline stage, identical ones too (by default they share one trace)",
    )
    project.set_defaults(func=cmd_project)
