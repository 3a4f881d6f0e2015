"""``moe-bench``: run scenarios, plan, compare, gate, plot and export results.

Exit codes: 0 success; 1 a scenario did not finish ok, or a gate found a regression; 2 bad input
(nothing was run and nothing was written).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _fail(message: str) -> int:
    print(f"moe-bench: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_run(args: argparse.Namespace, plan_only: bool = False) -> int:
    from bench.report.comparisons import ComparisonError, load_comparisons
    from bench.run.launch import detect_launch, join_launch, leave_launch
    from bench.run.runner import Runner, SilentReporter, expand_paths, load_all, resolve_device, suite_files
    from bench.scenario import ScenarioError

    try:
        comparisons = load_comparisons()
        device = resolve_device(args.device)
        files = expand_paths(args.files) if args.files else suite_files(args.suite or "default", device)
        if args.files and args.suite:
            files += suite_files(args.suite, device)
        missing = [f for f in files if not Path(f).exists()]
        if missing:
            return _fail(f"{missing[0]}: no such scenario file")
        if not files:
            return _fail("no scenarios to run")
        scenarios = load_all(files)
    except (ScenarioError, ComparisonError) as err:
        return _fail(str(err))

    # A plan is arithmetic in this process: any scenario, whatever its mode, and never a launch's rank.
    launch = None if plan_only else detect_launch()
    force = getattr(args, "force", False)
    if launch is None or launch.rank == 0:
        problem = _unwritable(Path(args.out))
        if problem:
            return _fail(problem)
    resume: dict[str, Path] = {}
    project_on = getattr(args, "project_on", [])
    if project_on:
        from bench.predict.device import ProfileError, load_profile

        try:
            for name in project_on:
                load_profile(name)
        except ProfileError as err:
            return _fail(str(err))
    if not plan_only:
        try:
            resume = _checkpoint_checks(scenarios, getattr(args, "resume", None), Path(args.out))
        except ValueError as err:
            return _fail(str(err))
    if launch is not None:
        # One rank of a torchrun or Slurm launch: the ranks execute each scenario together.
        device = join_launch(launch, device, max(s.run["timeout_s"] for s in scenarios))
        if launch.rank != 0:
            Runner(device, Path(args.out), reporter_factory=SilentReporter, launch=launch, force=force,
                   resume=resume).run(scenarios)
            leave_launch()
            return EXIT_OK
    runner = Runner(device, Path(args.out), launch=launch, plan_only=plan_only, force=force, resume=resume,
                    project_devices=project_on)
    outcomes = runner.run(scenarios)
    if launch is not None:
        leave_launch()
    if plan_only:
        from bench.predict.plan import summary_line

        for o in outcomes:
            print(summary_line(o.name, o.metrics, o.details))
    else:
        print_summary(outcomes)
        print_comparisons(outcomes, comparisons)
    failed = [o for o in outcomes if o.status not in ("ok", "skipped")]
    print(f"{len(outcomes)} scenarios, {len(failed)} not ok; results in {runner.out_dir}")
    if getattr(args, "report", False):
        _report_after_run(Path(args.out))
    return EXIT_FAILED if failed else EXIT_OK


def _checkpoint_checks(scenarios, resume: str | bool | None, out_root: Path) -> dict[str, Path]:
    """Before any step: the checkpoint each scenario resumes from (complete, of its model), and folders
    that can take checkpoints without writing over an earlier run's. Raises ValueError (one line)."""
    from bench.run.checkpointing import check_writable, model_dict, policy_for, resolve_resume

    executes = [s for s in scenarios if s.mode == "execute"]
    given = resume if isinstance(resume, str) else None
    if given is not None and len(executes) != 1:
        raise ValueError(f"--resume {given}: names one checkpoint, for exactly one execute scenario "
                         f"({len(executes)} given)")
    targets: dict[str, Path] = {}
    for scenario in executes:
        policy = policy_for(scenario.spec, out_root)
        if resume is not None:
            targets[scenario.name] = resolve_resume(scenario.spec, model_dict(scenario.model), policy, given)
        if policy is not None:
            check_writable(policy, resuming=resume is not None)
    return targets


def _unwritable(out_root: Path) -> str | None:
    """Why the results folder cannot take results (None when it can); checked before any work."""
    folder = out_root
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    owner = f"owned by uid {folder.stat().st_uid}" if folder.exists() else "missing"
    return (
        f"{out_root}: results folder not writable by uid {os.getuid()} ({folder} is {owner}); in a container, "
        "leave HOST_UID/HOST_GID unset (the run takes the folder's owner) or make the folder writable (see docs/install.md)"
    )


def _report_after_run(out_root: Path) -> None:
    """Rewrite the report page of everything under the results root; a report problem never hides results.

    A result file there that cannot be read (an old, truncated one) is skipped with a warning.
    """
    from bench.report.page import build_report

    try:
        report = build_report(out_root, out_root / "report",
                              on_warning=lambda text: print(f"moe-bench: warning: {text}", file=sys.stderr))
        print(f"report: {report.path}")
    except Exception as err:  # the results are written; report and go on
        print(f"moe-bench: warning: the report page failed: {err}", file=sys.stderr)


def print_summary(outcomes) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="moe-bench results")
    for column in ("scenario", "mode", "status", "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "peak memory", "params (total/active)"):
        table.add_column(column, justify="left" if column in ("scenario", "mode", "status") else "right")
    for o in outcomes:
        m = o.metrics

        def med(name, fmt):
            return fmt(m[name]["median"]) if name in m else ""

        memory = next((n for n in ("cuda_peak_active_bytes", "peak_tensor_bytes", "memory_total_bytes") if n in m), None)
        params = ""
        if "total_params" in m:
            params = f"{m['total_params']['median'] / 1e9:.2f}B / {m['active_params']['median'] / 1e9:.2f}B"
        # A proxy measured one rank; its cluster figures are projections, marked as such.
        prefix, mark = ("projected_", " (proj.)") if o.scenario.mode == "proxy" else ("", "")
        table.add_row(
            o.scenario.name, o.scenario.mode, o.status,
            med(f"{prefix}tokens_per_s_per_gpu", lambda v: f"{v:,.0f}{mark}"),
            med(f"{prefix}tflops_per_gpu", lambda v: f"{v:.3f}{mark}"),
            med("mfu", lambda v: f"{v:.1%}"),
            f"{m[memory]['median'] / 2**30:.2f} GiB" if memory else "",
            params,
        )
    Console(width=max(120, Console().width)).print(table)


def print_comparisons(outcomes, comparisons) -> None:
    """Each pair of the reference release's comparisons that ran: its ratio, beside the published figure."""
    from bench.report.comparisons import pair_ratios

    rows = pair_ratios(comparisons, {o.name: (o.status, o.metrics) for o in outcomes})
    if not rows:
        return
    print("comparisons (ratio of the medians, numerator / denominator, [95% interval from the two runs' steps]):")
    for row in rows:
        print(f"  {row.comparison.label}: {row.numerator} / {row.denominator} = {row.describe()}"
              f"  [published: {row.comparison.reference}; {row.comparison.mirrors}]")


def cmd_project(args: argparse.Namespace) -> int:
    import json

    from bench.predict.device import ProfileError, load_profile
    from bench.run.breakdown import format_breakdown
    from bench.run.project import (
        DoesNotFit,
        NotTraceable,
        check_traceable,
        project_on_device,
        summary,
        trace_progress,
    )
    from bench.run.runner import expand_paths, load_all
    from bench.scenario import ScenarioError

    devices = []  # (profile, why it stands in for the --device given, or None)
    try:
        scenarios = load_all(expand_paths(args.files))
        for name in args.device or []:
            path = Path(name)
            if args.fallback_device and path.suffix in (".yaml", ".yml") and not path.exists():
                # A measurement that did not happen (bench/gpu-check.sh's profile step): project on the
                # shipped profile all the same, and say so wherever the numbers go.
                profile = load_profile(args.fallback_device)
                note = (f"{name}: no such profile file; projected on the shipped profile {profile.name} "
                        f"({profile.file}) in its place (--fallback-device)")
                print(f"moe-bench: warning: {note}", file=sys.stderr)
                devices.append((profile, note))
            else:
                devices.append((load_profile(name), None))
    except (ScenarioError, ProfileError) as err:
        return _fail(str(err))
    for scenario in scenarios:
        if not devices and not (scenario.cluster or {}).get("device"):
            return _fail(f"{scenario.file}: cluster.device: missing; name a device with --device NAME")
        try:
            check_traceable(scenario)
        except NotTraceable as err:
            return _fail(str(err))
    problem = _unwritable(Path(args.out))
    if problem:
        return _fail(problem)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = 0
    for scenario in scenarios:
        for profile, fallback in devices or [(load_profile(scenario.cluster["device"]), None)]:
            try:
                with trace_progress(sys.stdout) as progress:
                    doc = project_on_device(scenario, profile, progress=progress, share_stages=not args.every_stage,
                                            breakdown=args.breakdown)
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
                print(f"  projected step of stage {b['pipeline_rank']} by op kind and module "
                      f"({doc['step_s']:.3f} s; hidden: collectives run under compute, not in the step):")
                print(format_breakdown(b))
            print(f"  written to {path}")
    return code


def cmd_profile_device(args: argparse.Namespace) -> int:
    from bench.predict.device import ProfileError
    from bench.run.profile_device import profile_device_command

    if args.threads < 1 or args.ranks < 1:
        return _fail("--threads and --ranks: must be at least 1")
    try:
        profile_device_command(args.device, args.threads, args.name, args.base, args.ranks, args.out,
                               progress=lambda line: print(line, flush=True), quick=args.quick, tiny=args.tiny)
    except (ValueError, ProfileError) as err:
        return _fail(str(err))
    return EXIT_OK


def cmd_proxy_check(args: argparse.Namespace) -> int:
    import json

    from bench.run.runner import Reporter, Runner, expand_paths, load_all, resolve_device
    from bench.scenario import ScenarioError
    from bench.validate.proxy_check import DEFAULT_SCENARIOS, check

    try:
        scenarios = load_all(expand_paths(args.files or list(DEFAULT_SCENARIOS)))
    except ScenarioError as err:
        return _fail(str(err))
    bad = [s for s in scenarios if s.mode != "execute" or s.world_size < 2]
    if bad:
        return _fail(f"{bad[0].file}: proxy-check needs execute scenarios of 2 ranks or more")
    from moe_engine.parallel.layout import check_proxy_layout

    for scenario in scenarios:
        try:
            check_proxy_layout(scenario.parallel_config)
        except ValueError as err:
            return _fail(f"{scenario.file}: {err}")
    problem = _unwritable(Path(args.out))
    if problem:
        return _fail(problem)
    if args.runs < 1:
        return _fail(f"--runs: must be at least 1, got {args.runs}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        return _fail(f"--warmup-steps: must be at least 0, got {args.warmup_steps}")
    profile = None
    if args.device_profile:
        from bench.predict.device import ProfileError, load_profile

        try:
            profile = load_profile(args.device_profile)
        except ProfileError as err:
            return _fail(str(err))
    runner = Runner(resolve_device("cpu"), Path(args.out))
    reporter = Reporter(len(scenarios) * args.runs)
    try:
        report = check(runner, scenarios, reporter.line, runs=args.runs, profile=profile,
                       warmup_steps=args.warmup_steps)
    except RuntimeError as err:
        print(f"moe-bench: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        reporter.close()
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
        op_level = (f", op-level {entry['median_op_level_error']:+.1%}"
                    if entry["median_op_level_error"] is not None else "")
        print(f"{name}: median error over {entry['runs']} runs {entry['median_error']:+.1%} "
              f"({entry['median_error_without_skew']:+.1%} without skew){op_level}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return EXIT_OK if all(r["status"] == "ok" for r in report["rows"]) else EXIT_FAILED


def cmd_micro(args: argparse.Namespace) -> int:
    from bench.run.micro import run_micro

    return run_micro(args.device, Path(args.out))


def _load_side(path: str, skip_bad: bool = False):
    """The result documents of a file or folder. A file that cannot be read as a result document
    raises ResultFileError (a ValueError: one line naming the file and the reason); with
    ``skip_bad`` it is left out with a warning on stderr instead. No documents at all is bad input."""
    from bench.results import load_results

    skipped = []

    def warn(err) -> None:
        skipped.append(err)
        print(f"moe-bench: warning: {err}; skipped", file=sys.stderr)

    docs = load_results(Path(path), on_bad_file=warn if skip_bad else None)
    if not docs:
        unread = f" ({len(skipped)} unreadable file{'s' if len(skipped) != 1 else ''} skipped)" if skipped else ""
        raise ValueError(f"{path}: no result documents{unread}")
    return docs


def cmd_compare(args: argparse.Namespace) -> int:
    from bench.gate.compare import accept_changes, accepted_lines, compare, render_rich_table, work_findings

    try:
        accept = _accepted_work(args.accept_work)
        base, cand = _load_side(args.base), _load_side(args.cand)
        acceptances = _acceptances(args.accept, [*base, *cand])
        comparison = accept_changes(compare(base, cand), accept, acceptances)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    from rich.console import Console

    Console(width=160).print(render_rich_table(comparison, title=f"{args.base} -> {args.cand}"))
    for issue in comparison.issues:
        print(issue.describe())
    for line in accepted_lines(comparison) + work_findings(comparison, accept, acceptances):
        print(line)
    return EXIT_OK


def cmd_gate(args: argparse.Namespace) -> int:
    from bench.gate.compare import compare, gate, parse_tolerance

    try:
        tolerance = parse_tolerance(args.tolerance)
        accept = _accepted_work(args.accept_work)
        base, cand = _load_side(args.baseline), _load_side(args.candidate)
        acceptances = _acceptances(args.accept, [*base, *cand])
        result = gate(compare(base, cand, tolerance), tolerance, accept, acceptances)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    print(result.report, end="")
    return result.exit_code


def _acceptances(specs: list[str], docs=(), with_releases: bool = True) -> list:
    """``--accept SPEC`` (each checked: its form, and a metric that is gated or in ``docs``), then the
    accepted changes of every recorded release (each applies only where its versions say). Raises
    ValueError (one line)."""
    from bench.gate.compare import check_metric_names, parse_acceptance
    from bench.release import record

    given = []
    for spec in specs:
        try:
            given.append(parse_acceptance(spec))
        except ValueError as err:
            raise ValueError(f"--accept {err}") from None
    try:
        check_metric_names(given, docs)
    except ValueError as err:
        raise ValueError(f"--accept {err}") from None
    if not with_releases:
        return given
    return given + [a for release in record.load_releases(record.RELEASES_PATH) for a in release.accepted]


def cmd_export(args: argparse.Namespace) -> int:
    from bench.report.export import export_files

    try:
        files = export_files(_load_side(args.results, skip_bad=True), args.format,
                             include_machine=args.include_machine)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in files.items():
        target = out.parent / f"{out.name}{suffix}"
        target.write_text(text)
        print(f"wrote {target}")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from bench.report.plot import plot_results
    from bench.results import ResultValidationError

    results_dir = Path(args.results_dir)
    if not results_dir.is_dir():
        return _fail(f"{results_dir}: no such results folder")
    try:
        written = plot_results(results_dir, Path(args.out),
                               on_bad_file=lambda err: print(f"moe-bench: warning: {err}; skipped", file=sys.stderr))
    except (ResultValidationError, ValueError) as err:
        return _fail(str(err))
    print(f"wrote {len(written)} files; open {Path(args.out) / 'index.html'}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from bench.gate.compare import parse_tolerance
    from bench.report.page import ReportError, build_report

    try:
        tolerance = parse_tolerance(args.tolerance)
        out = Path(args.out) if args.out else Path(args.results) / "report"
        problem = _unwritable(out)
        if problem:
            return _fail(problem)
        report = build_report(Path(args.results), out, base=args.base, new=args.new, tolerance=tolerance,
                              on_warning=lambda text: print(f"moe-bench: warning: {text}", file=sys.stderr))
    except (ReportError, ValueError) as err:
        return _fail(str(err))
    if report.comparison is not None:
        print(f"release comparison {report.comparison.versions.base} -> {report.comparison.versions.new}: "
              f"{report.comparison.header}")
    print(f"wrote {report.path} ({len(report.charts)} charts)")
    if args.screenshot:
        from bench.report.screenshot import BrowserMissing, chromium, undrawn, view_page

        try:
            with chromium() as browser:
                view = view_page(browser, report.path, Path(args.screenshot))
        except (BrowserMissing, OSError) as err:
            return _fail(f"--screenshot: {err}")
        problems = undrawn(view) + [f"browser console: {e}" for e in view.errors]
        if problems:
            return _fail(f"--screenshot: the page did not render cleanly: {'; '.join(problems)}")
        print(f"wrote {view.screenshot} (every chart drawn in headless Chromium)")
    return EXIT_OK


def cmd_version(args: argparse.Namespace) -> int:
    from bench.release.version import engine_version

    version = engine_version()
    print(version.version)
    print(f"({version.source})", file=sys.stderr)
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    from bench.release import record

    try:
        accepted = tuple(_acceptances(args.accept, with_releases=False))
        releases = record.load_releases(record.RELEASES_PATH)
        if args.version is None:
            if accepted:
                return _fail(
                    "--accept: name the release that makes the change: moe-bench release VERSION --accept SPEC")
            for release in releases[-1:] if args.latest else releases:
                print(release.version if args.latest else f"{release.version}  {release.commit}  {release.date}")
                for acceptance in [] if args.latest else release.accepted:
                    print(f"  accepted: {acceptance.spec}")
            return EXIT_OK
        if accepted and any(r.version == args.version for r in releases):
            release = record.record_acceptances(args.version, accepted, record.RELEASES_PATH)
            for acceptance in accepted:
                print(f"release {release.version} accepts {acceptance.spec}")
            return EXIT_OK
        release = record.cut_release(args.version, tag=args.tag, accepted=accepted)
    except ValueError as err:  # a ReleaseError, or a malformed --accept
        return _fail(str(err))
    tagged = f", tagged v{release.version}" if args.tag else ""
    print(f"recorded release {release.version} = {release.commit} in releases.json{tagged}")
    return EXIT_OK


def cmd_ab(args: argparse.Namespace) -> int:
    from bench.gate.ab import ABError, plan_ab, render_calibration, run_ab, run_calibration
    from bench.gate.compare import parse_tolerance
    from bench.gate.resident import WorkerDied
    from bench.run.runner import expand_paths, load_all, resolve_device, suite_files
    from bench.scenario import ScenarioError

    try:
        tolerance = parse_tolerance(args.tolerance)
        device = resolve_device(args.device)
        files = expand_paths(args.files) if args.files else suite_files(args.suite or "ci", device)
        missing = [f for f in files if not Path(f).exists()]
        if missing:
            return _fail(f"{missing[0]}: no such scenario file")
        accept = _accepted_work(args.accept_work)
        accept_increase = _accepted_increases(args.accept_increase)
        acceptances = tuple(_acceptances(args.accept, with_releases=False))
        scenarios = load_all(files)
        if args.calibrate:
            found = run_calibration(scenarios, args.budget, device=device.type, log=lambda line: print(line, flush=True))
            print(render_calibration(found, args.budget), end="")
            return EXIT_OK
        keep = Path(args.out) if args.out else None
        if keep is not None and keep.exists() and any(keep.iterdir()):
            return _fail(f"{keep}: --out must be a new or empty folder")
        plan = plan_ab(args.baseline_ref, scenarios, tolerance, args.budget, accept_work=accept,
                       accept_increase=accept_increase, acceptances=acceptances)
    except (ABError, ScenarioError, ValueError, WorkerDied) as err:
        return _fail(str(err))
    print(f"ab: baseline {plan.label} ({plan.commit[:12]}) vs this checkout: {len(plan.scenarios)} scenario(s), "
          f"resident blocks for up to {plan.budget_s:g} s each", flush=True)
    try:
        report = run_ab(plan, device=device.type, keep=keep, log=lambda line: print(line, flush=True))
    except ABError as err:  # the baseline worktree could not be made
        return _fail(str(err))
    print(report.render(), end="")
    return report.exit_code


def _accepted_work(value: str | None) -> frozenset[str] | None:
    """``--accept-work`` (every work metric) or ``--accept-work a,b``; unknown names are bad input."""
    from bench.gate.compare import WORK_METRICS

    if value is None:
        return None
    if value == "all":
        return frozenset(WORK_METRICS)
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - set(WORK_METRICS))
    if unknown:
        raise ValueError(f"--accept-work: unknown work metric {unknown[0]} (known: {', '.join(sorted(WORK_METRICS))})")
    return names


def _accepted_increases(value: str | None) -> frozenset[str]:
    """``--accept-increase a,b``: exact metrics (not work counters, not timings) whose regression passes."""
    from bench.gate.ab import ACCEPTABLE_INCREASES

    names = frozenset(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - set(ACCEPTABLE_INCREASES))
    if unknown:
        raise ValueError(
            f"--accept-increase: {unknown[0]} is not an exact metric the gate can accept "
            f"(known: {', '.join(ACCEPTABLE_INCREASES)}; work counters: --accept-work)"
        )
    return names


def cmd_versions(args: argparse.Namespace) -> int:
    from bench.release.images import VersionsError, run_versions

    try:
        code, table = run_versions(args.images, args.suite, Path(args.out), args.gpus,
                                   log=lambda line: print(line, flush=True))
    except VersionsError as err:
        return _fail(str(err))
    print(table, end="")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run scenarios (default: the default suite)")
    run.add_argument("files", nargs="*", help="scenario files or folders")
    run.add_argument("--suite", help="a suite from scenarios/suites.yaml (default, ci, gpu)")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument("--out", default="results", help="results root (default: results)")
    # --no-plots: the flag's name before the report page replaced the plots (older releases' A/B runs pass it).
    run.add_argument("--no-report", "--no-plots", dest="report", action="store_false",
                     help="skip rewriting the report page <out>/report/index.html")
    run.add_argument("--force", action="store_true",
                     help="start execute scenarios whose plan needs more memory than the device has (default: "
                          "recorded oom without starting)")
    run.add_argument("--project-on", action="append", default=[], metavar="DEVICE",
                     help="also project each proxy result onto this device profile (repeatable), beside its "
                          "cluster.device")
    run.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                     help="continue each execute scenario from the latest complete checkpoint in its checkpoint "
                          "folder, or (one scenario) from PATH: a checkpoint, or a folder of them")
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser(
        "plan", help="plan any scenario's whole layout: parameters, FLOPs, per-rank memory and traffic, and "
                     "whether it fits the cluster's GPUs")
    plan.add_argument("files", nargs="+", help="scenario files or folders (plan, proxy or execute)")
    plan.add_argument("--out", default="results", help="results root (default: results)")
    plan.set_defaults(func=lambda a: cmd_run(argparse.Namespace(**vars(a), suite=None, device="cpu", report=False), plan_only=True))

    accept_work_help = ("accept an increase of these work counters (comma-separated work_* names; none given: "
                        "every one): reported as accepted, not failed")
    accept_help = ("accept a change made on purpose, METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%%: REASON, e.g. "
                   "'peak_tensor_bytes@e8-random-bf16<=6%%: fp32 gradient buffers': a regression of those metrics on "
                   "those scenarios at most N%% worse is reported as accepted with the reason (repeatable; the "
                   "releases' own, from releases.json, apply where the versions compared span them)")
    compare = sub.add_parser("compare", help="compare two result sets metric by metric")
    compare.add_argument("base")
    compare.add_argument("cand")
    compare.add_argument("--accept-work", nargs="?", const="all", metavar="METRICS", help=accept_work_help)
    compare.add_argument("--accept", action="append", default=[], metavar="SPEC", help=accept_help)
    compare.set_defaults(func=cmd_compare)

    gate = sub.add_parser("gate", help="exit 1 on a regression outside tolerance and noise, or on more work")
    gate.add_argument("--baseline", required=True)
    gate.add_argument("--candidate", required=True)
    gate.add_argument("--tolerance", default="5%")
    gate.add_argument("--accept-work", nargs="?", const="all", metavar="METRICS", help=accept_work_help)
    gate.add_argument("--accept", action="append", default=[], metavar="SPEC", help=accept_help)
    gate.set_defaults(func=cmd_gate)

    export = sub.add_parser("export", help="export metrics for CI dashboards")
    export.add_argument("results")
    export.add_argument("--format", required=True, choices=["github-action-benchmark", "bencher"])
    export.add_argument("--out", default="moe-bench-export", help="output path prefix (suffixes are added)")
    export.add_argument("--include-machine", action="store_true", help="prefix names with the machine")
    export.set_defaults(func=cmd_export)

    plot = sub.add_parser("plot", help="PNG plots of every scenario across versions, and an index.html")
    plot.add_argument("results_dir")
    plot.add_argument("--out", required=True)
    plot.set_defaults(func=cmd_plot)

    report = sub.add_parser("report", help="one self-contained HTML page: problems, the release comparison, "
                                           "trends and the reference experiments")
    report.add_argument("results", help="results folder (results/<version>/<machine>/*.json)")
    report.add_argument("--out", help="folder for index.html (default: RESULTS/report)")
    report.add_argument("--base", metavar="VERSION",
                        help="baseline version of the comparison (default: the latest release older than --new)")
    report.add_argument("--new", metavar="VERSION", help="candidate version (default: the newest in RESULTS)")
    report.add_argument("--tolerance", default="5%", help="the gate's tolerance for the verdicts (default 5%%)")
    report.add_argument("--screenshot", metavar="PNG",
                        help="also open the page in headless Chromium and save the whole page there (needs "
                             "selenium, chromium and chromium-driver); fails if a chart is not drawn")
    report.set_defaults(func=cmd_report)

    ab = sub.add_parser("ab", help="A/B gate: a baseline git ref and this checkout alternately, paired ratios")
    ab.add_argument("files", nargs="*", help="scenario files or folders (default: the --suite)")
    ab.add_argument("--baseline-ref", help="git ref of the baseline (default: the latest release in releases.json)")
    ab.add_argument("--suite", help="suite from scenarios/suites.yaml (default: ci)")
    ab.add_argument("--budget", type=float, default=60.0,
                    help="seconds of alternating resident blocks per scenario, at most (default 60)")
    ab.add_argument("--calibrate", action="store_true",
                    help="A/A on this machine: the noise floor and the smallest tolerance for --budget")
    ab.add_argument("--accept-work", nargs="?", const="all", metavar="METRICS",
                    help="accept an increase of these work metrics (comma-separated; none given: all)")
    ab.add_argument("--accept-increase", metavar="METRICS",
                    help="accept a regression of these exact metrics, e.g. peak_tensor_bytes (comma-separated): "
                         "reported as accepted, not failed")
    ab.add_argument("--accept", action="append", default=[], metavar="SPEC",
                    help=accept_help + "; the resident blocks measure step_time_s")
    ab.add_argument("--tolerance", default="5%")
    ab.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ab.add_argument("--out", help="keep every run's result document here (default: discarded)")
    ab.set_defaults(func=cmd_ab)

    versions = sub.add_parser("versions", help="run one suite in several engine images (Docker) and compare them")
    versions.add_argument("images", nargs="+", metavar="IMAGE")
    versions.add_argument("--suite", default="default")
    versions.add_argument("--out", default="results", help="results root (default: results)")
    versions.add_argument("--gpus", choices=["auto", "all", "none"], default="auto",
                          help="request the host's GPUs (auto: when nvidia-smi lists one)")
    versions.set_defaults(func=cmd_versions)

    release = sub.add_parser("release", help="record HEAD as release VERSION in releases.json; list releases")
    release.add_argument("version", nargs="?", help="the version to release (default: list the recorded releases)")
    release.add_argument("--latest", action="store_true", help="print only the latest release's version")
    release.add_argument("--no-tag", dest="tag", action="store_false", help="do not create the tag vVERSION")
    release.add_argument("--accept", action="append", default=[], metavar="SPEC",
                         help="a change the release makes on purpose, METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%%: "
                              "REASON, recorded with it in releases.json (repeatable; for a release recorded "
                              "before, added to it)")
    release.set_defaults(func=cmd_release)

    version = sub.add_parser("version", help="print the engine version (the folder name under results/)")
    version.set_defaults(func=cmd_version)

    project = sub.add_parser(
        "project", help="a layout's step on a device kind, every op of a rank's full-size step priced on its profile")
    project.add_argument("files", nargs="+", help="scenario files or folders (any mode)")
    project.add_argument("--device", action="append",
                         help="device profile name (devices/NAME.yaml) or file; repeat for several "
                              "(default: the scenario's cluster.device)")
    project.add_argument("--out", default="results/projections", help="folder for the projection documents")
    project.add_argument("--fallback-device", metavar="NAME",
                         help="a --device file that does not exist is replaced by this profile, with a warning and "
                              "the replacement recorded in each document (device_fallback)")
    project.add_argument("--breakdown", action="store_true",
                         help="also print and write (the document's breakdown) the projected step by op kind and by "
                              "engine module: time, bytes moved, FLOPs, kernels, share of the step")
    project.add_argument("--every-stage", action="store_true",
                         help="trace every pipeline stage, identical ones too (by default they share one trace)")
    project.set_defaults(func=cmd_project)

    profile = sub.add_parser(
        "profile-device", help="measure this device's GEMM, grouped-GEMM, attention and memory curves into a "
                               "device profile (devices/NAME.yaml)")
    profile.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    profile.add_argument("--threads", type=int, default=1, help="CPU threads per rank while measuring (default 1)")
    profile.add_argument("--ranks", type=int, default=2,
                         help="ranks one host runs: the gloo links are measured between this many processes (CPU)")
    profile.add_argument("--name", help="profile name (default: from the device)")
    profile.add_argument("--base", help="on a GPU: the profile whose peaks, network and sources to keep (e.g. h200-sxm)")
    profile.add_argument("--out", help="file to write (default devices/NAME.yaml)")
    profile.add_argument("--quick", action="store_true",
                         help="20 ms per point, on a GPU a smaller sweep (a check within a device budget)")
    profile.add_argument("--tiny", action="store_true",
                         help="a few seconds' sweep of tiny sizes (bench/gpu-check.sh --dry-run on a CPU)")
    profile.set_defaults(func=cmd_profile_device)

    check = sub.add_parser(
        "proxy-check", help="projection vs measurement: real multi-rank runs here and proxies of each of their ranks"
    )
    check.add_argument("files", nargs="*", help="execute scenarios of 2+ ranks (default: the 2-rank smoke layouts)")
    check.add_argument("--out", default="results", help="results root for the runs (default: results)")
    check.add_argument("--json", default=None, help="also write the report here")
    check.add_argument("--runs", type=int, default=1, help="real runs of each scenario (default 1)")
    check.add_argument("--warmup-steps", type=int, default=None,
                       help="untimed steps before the timed ones, replacing the scenarios' own (a fresh process "
                            "runs its first steps slower; a device profile prices the steady state)")
    check.add_argument("--device-profile", metavar="PROFILE",
                       help="also check the op-level projection on this device profile (e.g. cpu-2core, the "
                            "profile of the machine it runs on) against the same real runs")
    check.set_defaults(func=cmd_proxy_check)

    micro = sub.add_parser("micro", help="run the micro-benchmarks and fold them into a result document")
    micro.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    micro.add_argument("--out", default="results")
    micro.set_defaults(func=cmd_micro)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["run"]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("moe-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
