"""``moe-bench release`` and ``moe-bench version``: record and list releases; the engine version."""

from __future__ import annotations

import argparse
import sys

from bench.commands.common import EXIT_OK, fail, parse_accept_options


def cmd_release(args: argparse.Namespace) -> int:
    from bench.release import record

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
    return EXIT_OK


def cmd_version(args: argparse.Namespace) -> int:
    from bench.release.version import engine_version

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
