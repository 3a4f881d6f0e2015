"""The engine version a result is labelled with: the folder name under ``results/``.
More: docs/gates-and-releases.md#versions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import moe_engine
from bench.logs import console_logging
from bench.release.git import NotACheckout, checkout_head, git
from bench.release.record import ReleaseError, load_releases
from bench.results import REPO_ROOT

logger = logging.getLogger(__name__)

RELEASE_TAGS = "v[0-9]*"
"""``git describe`` considers tags of this form (``v0.1.0``) as releases."""
BAKED_ENGINE_FILE = Path("bench") / "engine.json"
"""Written by the image build from the checkout it was built from (images carry no ``.git``)."""
UNKNOWN = "unknown"
"""The local version label of code whose commit is not known."""


@dataclass(frozen=True)
class EngineVersion:
    """What a result records of the code that produced it, and how that was found out."""

    version: str
    """PEP 440 version; the folder name under ``results/``."""
    git_commit: str | None
    """Full commit hash, None when unknown."""
    git_dirty: bool | None
    """Uncommitted changes to tracked code; None when unknown."""
    source: str
    """One sentence: where the version came from (or why it is unknown)."""

    def record(self) -> dict[str, Any]:
        """The ``engine`` object of a result document."""
        return {"version": self.version, "git_commit": self.git_commit, "git_dirty": self.git_dirty}


def engine_version(root: Path | None = None) -> EngineVersion:
    """The version of the code at ``root`` (default: this package's tree): its checkout, else the image
    build's record, else unknown."""
    root = REPO_ROOT if root is None else root
    try:
        return checkout_version(root, moe_engine.__version__)
    except NotACheckout as err:
        no_checkout = str(err)
    baked_path = Path(root) / BAKED_ENGINE_FILE
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        baked = json.loads(baked_path.read_text())
        return EngineVersion(
            baked["version"],
            baked["git_commit"],
            baked["git_dirty"],
            f"recorded by the image build in {BAKED_ENGINE_FILE}",
        )
    return EngineVersion(
        f"{moe_engine.__version__}+{UNKNOWN}",
        None,
        None,
        f"no provenance: {no_checkout}, and no {BAKED_ENGINE_FILE} was recorded by an image build "
        f"(build the image from a git clone, not a worktree or a source tree, with git in the base image)",
    )


def engine_info(root: Path | None = None) -> dict[str, Any]:
    """``engine_version(root).record()``: version, commit and dirtiness for a result document."""
    return engine_version(root).record()


def checkout_version(root: Path, package_version: str) -> EngineVersion:
    """The version of the git checkout at ``root``; raises ``NotACheckout`` outside one."""
    commit, dirty = checkout_head(root)
    release = nearest_release(root, commit)
    version = format_version(package_version, release, commit, dirty)
    return EngineVersion(
        version, commit, dirty, f"git checkout {root} at {commit[:12]}" + (" (dirty)" if dirty else "")
    )


def format_version(package_version: str, release: tuple[str, int] | None, commit: str, dirty: bool) -> str:
    """A PEP 440 version that sorts between releases and is safe as a folder name.

    ``release`` is (version, commits since it) of the nearest release at or before ``commit``.
    """
    if release is None:
        return f"{package_version}+g{commit[:7]}" + (".dirty" if dirty else "")
    version, distance = release
    if distance == 0 and not dirty:
        return version
    return f"{version}+{distance}.g{commit[:7]}" + (".dirty" if dirty else "")


def nearest_release(root: Path, commit: str) -> tuple[str, int] | None:
    """(version, distance) of the closest release that ``commit`` descends from.

    ``git describe`` over the release tags when they were fetched, else the release record
    (``releases.json``), which does not depend on tags.
    """
    with contextlib.suppress(subprocess.CalledProcessError):
        described = git(root, "describe", "--tags", "--long", "--match", RELEASE_TAGS, commit)
        match = re.fullmatch(r"v(.+)-(\d+)-g[0-9a-f]+", described)
        if match:
            return match[1], int(match[2])
    try:
        releases = load_releases(Path(root) / "releases.json")
    except ReleaseError:
        return None
    best = None
    for release in releases:
        with contextlib.suppress(subprocess.CalledProcessError):  # not an ancestor, or not in this clone
            git(root, "merge-base", "--is-ancestor", release.commit, commit)
            distance = int(git(root, "rev-list", "--count", f"{release.commit}..{commit}"))
            if best is None or distance < best[1]:
                best = (release.version, distance)
    return best


def _main() -> int:
    """Print the checkout's ``engine`` record for the image build; exit 1 (and say why) outside a checkout."""
    try:
        sys.stdout.write(json.dumps(checkout_version(REPO_ROOT, moe_engine.__version__).record()) + "\n")
    except NotACheckout as err:
        logger.error(f"no version recorded: {err}")
        return 1
    return 0


if __name__ == "__main__":  # the image build bakes the version of the checkout it was built from
    console_logging()
    sys.exit(_main())
