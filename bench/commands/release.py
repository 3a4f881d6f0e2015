"""``moe-bench release`` and ``moe-bench version``: record and list releases; the engine version."""

from __future__ import annotations

import argparse
import sys

from bench.commands.common import EXIT_OK, fail, parse_accept_options
from bench.release import record
from bench.release.version import engine_version
from bench.results import REPO_ROOT
from bench.run.suites import load_all, resolve_device, suite_files


def cmd_release(args: argparse.Namespace) -> int:
    try:
        accepted = tuple(parse_accept_options(args.accept, with_releases=False))
        releases = record.load_releases(record.RELEASES_PATH)
        if args.version is None:
            if accepted:
                return fail("--accept: name the release that makes the change: moe-bench release VERSION --accept SPEC")
            for release in releases[-1:] if args.latest else releases:
                print(release.version if args.latest else f"{release.version}  {release.commit}  {release.date}")
                for acceptance in [] if args.latest else release.accepted:
                    print(f"  accepted: {acceptance.spec}")
                if not args.latest:
                    print(f"  {release.baseline_text()}")
            return EXIT_OK
        if accepted and any(r.version == args.version for r in releases):
            release = record.record_acceptances(args.version, accepted, record.RELEASES_PATH)
            for acceptance in accepted:
                print(f"release {release.version} accepts {acceptance.spec}")
            return EXIT_OK
        release = record.cut_release(args.version, tag=args.tag, accepted=accepted)
    except ValueError as err:  # a ReleaseError, or a malformed --accept
        return fail(str(err))
    tagged = f", tagged v{release.version}" if args.tag else ""
    print(f"recorded release {release.version} = {release.commit} in releases.json{tagged}")
    if args.suite:
        return _record_baseline(release, args.suite)
    print(f"  {release.baseline_text()}")
    return EXIT_OK


def _record_baseline(release, suite: str) -> int:
    """Run ``suite`` on this machine into results/ as the release's baseline, and record where it is."""
    # heavy: torch and the engine, loaded only when this command runs
    from bench.run.runner import Runner

    device = resolve_device("auto")
    runner = Runner(device, REPO_ROOT / "results")
    outcomes = runner.run(load_all(suite_files(suite, device)))
    folder = runner.out_dir.relative_to(REPO_ROOT).as_posix()
    release = record.record_baseline(release.version, runner.machine["name"], folder, path=record.RELEASES_PATH)
    bad = [o.scenario.name for o in outcomes if o.status != "ok" or o.noisy]
    print(f"  baseline: {len(outcomes)} scenario(s) of the {suite} suite in {folder}; commit them with releases.json")
    if bad:
        print(f"  not ok or noisy: {', '.join(bad)}: rerun them on a quiet machine before committing")
    print(f"  elsewhere: {release.compare_elsewhere()}")
    return 1 if bad else EXIT_OK


def cmd_version(args: argparse.Namespace) -> int:
    version = engine_version()
    print(version.version)
    print(f"({version.source})", file=sys.stderr)
    return EXIT_OK


def register(sub) -> None:
    """Add the command's parser(s) to ``sub``, the subparsers of ``moe-bench``."""
    release = sub.add_parser("release", help="record HEAD as release VERSION in releases.json; list releases")
    release.add_argument("version", nargs="?", help="the version to release (default: list the recorded releases)")
    release.add_argument("--latest", action="store_true", help="print only the latest release's version")
    release.add_argument("--no-tag", dest="tag", action="store_false", help="do not create the tag vVERSION")
    release.add_argument(
        "--suite",
        default="ci",
        help="after recording VERSION, run this suite here into results/ as the release's baseline and record "
        "where it is (default: ci; the release carries its results, elsewhere it is compared with moe-bench ab)",
    )
    release.add_argument(
        "--no-results",
        dest="suite",
        action="store_const",
        const=None,
        help="record the release without running a suite",
    )
    release.add_argument(
        "--accept",
        action="append",
        default=[],
        metavar="SPEC",
        help="a change the release makes on purpose, METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%%: "
        "REASON, recorded with it in releases.json (repeatable; for a release recorded "
        "before, added to it)",
    )
    release.set_defaults(func=cmd_release)

    version = sub.add_parser("version", help="print the engine version (the folder name under results/)")
    version.set_defaults(func=cmd_version)
