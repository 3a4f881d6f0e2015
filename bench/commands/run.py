"""``moe-bench run`` and ``moe-bench plan``: run or plan scenarios, write their result documents, print the summary."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.commands.common import EXIT_FAILED, EXIT_OK, fail, unwritable
from bench.metrics import headline_memory
from bench.predict.device import ProfileError, load_profile
from bench.predict.plan import summary_line
from bench.report.comparisons import PairComparisonError, comparison_lines, load_comparisons, pair_ratios
from bench.report.page import build_report
from bench.run.checkpointing import checkpoints_before_run
from bench.run.console import SilentReporter
from bench.run.suites import expand_paths, load_all, resolve_device, suite_files
from bench.scenario import ScenarioError
from bench.units import format_count, format_gib


def cmd_run(args: argparse.Namespace, plan_only: bool = False) -> int:
    # heavy: torch and the engine, loaded only when this command runs
    from bench.run.launch import detect_launch, join_launch, leave_launch
    from bench.run.runner import Runner

    try:
        comparisons = load_comparisons()
        device = resolve_device(args.device)
        files = expand_paths(args.files) if args.files else suite_files(args.suite or "default", device)
        if args.files and args.suite:
            files += suite_files(args.suite, device)
        missing = [f for f in files if not Path(f).exists()]
        if missing:
            return fail(f"{missing[0]}: no such scenario file")
        if not files:
            return fail("no scenarios to run")
        scenarios = load_all(files)
    except (ScenarioError, PairComparisonError) as err:
        return fail(str(err))

    # A plan is arithmetic in this process: any scenario, whatever its mode, and never a launch's rank.
    launch = None if plan_only else detect_launch()
    force = getattr(args, "force", False)
    if launch is None or launch.rank == 0:
        problem = unwritable(Path(args.out))
        if problem:
            return fail(problem)
    resume: dict[str, Path] = {}
    project_on = getattr(args, "project_on", [])
    if project_on:
        try:
            for name in project_on:
                load_profile(name)
        except ProfileError as err:
            return fail(str(err))
    if not plan_only:
        try:
            resume = checkpoints_before_run(scenarios, getattr(args, "resume", None), Path(args.out))
        except ValueError as err:
            return fail(str(err))
    if launch is not None:
        # One rank of a torchrun or Slurm launch: the ranks execute each scenario together.
        device = join_launch(launch, device, max(s.run.timeout_s for s in scenarios))
        if launch.rank != 0:
            Runner(
                device, Path(args.out), reporter_factory=SilentReporter, launch=launch, force=force, resume=resume
            ).run(scenarios)
            leave_launch()
            return EXIT_OK
    runner = Runner(
        device,
        Path(args.out),
        launch=launch,
        plan_only=plan_only,
        force=force,
        resume=resume,
        project_devices=project_on,
    )
    outcomes = runner.run(scenarios)
    if launch is not None:
        leave_launch()
    if plan_only:
        for o in outcomes:
            print(summary_line(o.name, o.metrics, o.details))
    else:
        print_summary(outcomes)
        print_comparisons(outcomes, comparisons, on_cpu=device.type == "cpu")
    failed = [o for o in outcomes if o.status not in ("ok", "skipped")]
    print(f"{len(outcomes)} scenarios, {len(failed)} not ok; results in {runner.out_dir}")
    if getattr(args, "report", False):
        _report_after_run(Path(args.out))
    return EXIT_FAILED if failed else EXIT_OK


def _report_after_run(out_root: Path) -> None:
    """Rewrite the report page of everything under the results root; a report problem never hides results.

    A result file there that cannot be read (an old, truncated one) is skipped with a warning.
    """

    try:
        report = build_report(
            out_root, out_root / "report", on_warning=lambda text: print(f"moe-bench: warning: {text}", file=sys.stderr)
        )
        print(f"report: {report.path}")
    except Exception as err:  # the results are written; report and go on
        print(f"moe-bench: warning: the report page failed: {err}", file=sys.stderr)


def print_summary(outcomes) -> None:
    table = Table(title="moe-bench results")
    for column in (
        "scenario",
        "mode",
        "status",
        "tokens/s/GPU",
        "TFLOP/s/GPU",
        "MFU",
        "peak memory",
        "params (total/active)",
        *(["fits the GPU"] if any(o.details.get("fits") is not None for o in outcomes) else []),
    ):
        table.add_column(
            column,
            justify="left" if column in ("scenario", "mode", "status", "fits the GPU") else "right",
            no_wrap=True,
        )
    for o in outcomes:
        m = o.metrics

        def med(name, fmt):
            return fmt(m[name]["median"]) if name in m else ""

        memory = headline_memory(m)
        params = ""
        if "total_params" in m:
            params = f"{format_count(m['total_params']['median'])} / {format_count(m['active_params']['median'])}"
        tokens = med("tokens_per_s_per_gpu", lambda v: f"{v:,.0f}")
        tflops = med("tflops_per_gpu", lambda v: f"{v:.3f}")
        if o.scenario.mode == "proxy":
            tokens, tflops = _proxy_figures(o)
        table.add_row(
            o.scenario.name,
            o.scenario.mode,
            o.status,
            tokens,
            tflops,
            med("mfu", lambda v: f"{v:.1%}"),
            format_gib(m[memory]["median"]) if memory else "",
            params,
            *([fit_verdict(o.details)] if table.columns[-1].header == "fits the GPU" else []),
        )
    # Wide enough for the longest scenario names and marked projections whole (logs are read in editors).
    Console(width=max(170, Console().width)).print(table)


def fit_verdict(details: dict) -> str:
    """A plan's verdict on its most loaded rank against its cluster's GPU: ``fits b300 (85.2 of 268.2 GiB)``,
    ``DOES NOT FIT b300 (279.4 > 268.2 GiB)``; empty for a result without one (an execute run, which ran)."""
    fits, cluster = details.get("fits"), details.get("cluster") or {}
    if fits is None:
        return ""
    device = cluster.get("device") or cluster.get("name") or "the GPU"
    need, have = details.get("memory_total_gib"), cluster.get("gpu_memory_gib")
    if need is None or have is None:
        return f"fits {device}" if fits else f"DOES NOT FIT {device}"
    if fits:
        return f"fits {device} ({need:.1f} of {have:.1f} GiB)"
    return f"DOES NOT FIT {device} ({need:.1f} > {have:.1f} GiB)"


def _proxy_figures(o) -> tuple[str, str]:
    """A proxy measured one rank of a cluster; the cluster's figures are projections. The summary shows
    the projection onto the first GPU profile (``details.device_projections``), marked with its name:
    the one at the measuring machine's own compute prices a GPU cluster at CPU speed and says nothing
    about it (it stays in the result document, ``projected_*``)."""
    projections = o.details.get("device_projections") or {}
    device, projection = next(iter(projections.items()), (None, None))
    if projection is None or "tokens_per_s_per_gpu" not in projection:
        return "", ""
    mark = f" (proj. {device})"
    return f"{projection['tokens_per_s_per_gpu']:,.0f}{mark}", f"{projection['tflops_per_gpu']:.1f}{mark}"


def print_comparisons(outcomes, comparisons, on_cpu: bool = False) -> None:
    """Each pair of the reference release's comparisons that ran: its ratio, beside the published figure
    (``bench.report.comparisons.comparison_lines``; ``on_cpu``: the runs ran on a CPU)."""

    rows = pair_ratios(comparisons, {o.name: (o.status, o.metrics) for o in outcomes})
    for line in comparison_lines(rows, on_cpu=on_cpu):
        print(line)


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    run = sub.add_parser("run", help="run scenarios (default: the default suite)")
    run.add_argument("files", nargs="*", help="scenario files or folders")
    run.add_argument("--suite", help="a suite from scenarios/suites.yaml (default, ci, gpu)")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument("--out", default="results", help="results root (default: results)")
    # --no-plots: the flag's name before the report page replaced the plots (older releases' A/B runs pass it).
    run.add_argument(
        "--no-report",
        "--no-plots",
        dest="report",
        action="store_false",
        help="skip rewriting the report page <out>/report/index.html",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="start execute scenarios whose plan needs more memory than the device has (default: "
        "recorded oom without starting)",
    )
    run.add_argument(
        "--project-on",
        action="append",
        default=[],
        metavar="DEVICE",
        help="also project each proxy result onto this device profile (repeatable), beside its cluster.device",
    )
    run.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="continue each execute scenario from the latest complete checkpoint in its checkpoint "
        "folder, or (one scenario) from PATH: a checkpoint, or a folder of them",
    )
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser(
        "plan",
        help="plan any scenario's whole layout: parameters, FLOPs, per-rank memory and traffic, and "
        "whether it fits the cluster's GPUs",
    )
    plan.add_argument("files", nargs="+", help="scenario files or folders (plan, proxy or execute)")
    plan.add_argument("--out", default="results", help="results root (default: results)")
    plan.set_defaults(
        func=lambda a: cmd_run(argparse.Namespace(**vars(a), suite=None, device="cpu", report=False), plan_only=True)
    )
