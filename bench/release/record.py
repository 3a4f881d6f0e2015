"""The release record: which commit each release is, kept in ``releases.json`` at the repository root.

The A/B gate (``moe-bench ab`` without ``--baseline-ref``) and the version strings read this file,
so neither depends on git tags having been fetched. Format::

    {"releases": [{"version": "0.1.0", "commit": "<40 hex digits>", "date": "2025-12-01"}]}

``cut_release`` (``moe-bench release VERSION``) records HEAD as release VERSION: the checkout must be
clean, VERSION must be the package version (``pyproject.toml``) and newer than every recorded
release. It also tags the commit ``v<VERSION>`` for ``git describe``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from packaging.version import InvalidVersion, Version

from bench.release.git import NotACheckout, checkout_head, git, try_git
from bench.results import REPO_ROOT

RELEASES_PATH = REPO_ROOT / "releases.json"
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ReleaseError(ValueError):
    """A release record that cannot be read, or a release that cannot be cut (one-line reason)."""


@dataclass(frozen=True)
class Release:
    version: str
    """A public PEP 440 version, e.g. ``0.1.0``."""
    commit: str
    """The full commit hash of the release."""
    date: str
    """The day it was recorded (UTC, ``YYYY-MM-DD``)."""


def release_version(text: str) -> Version:
    """``text`` as a release version: PEP 440, normalised, without a local part (``+...``)."""
    try:
        version = Version(text)
    except (InvalidVersion, TypeError):
        raise ReleaseError(f"{text!r} is not a PEP 440 version such as 0.1.0") from None
    if version.local is not None or str(version) != text:
        raise ReleaseError(f"{text!r} is not a release version (write it as {version.public!s})")
    return version


def load_releases(path: Path = RELEASES_PATH) -> list[Release]:
    """The recorded releases, oldest version first; ``[]`` when the file does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ReleaseError(f"{path}: cannot read the release record: {err}") from None
    entries = data.get("releases") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ReleaseError(f'{path}: expected an object with a "releases" list')
    releases: list[Release] = []
    for index, entry in enumerate(entries):
        where = f"{path}: releases[{index}]"
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("version", "commit", "date")):
            raise ReleaseError(f"{where}: needs the strings version, commit and date")
        try:
            release_version(entry["version"])
        except ReleaseError as err:
            raise ReleaseError(f"{where}.version: {err}") from None
        if not _COMMIT.fullmatch(entry["commit"]):
            raise ReleaseError(f"{where}.commit: expected a full 40-digit commit hash")
        if any(r.version == entry["version"] for r in releases):
            raise ReleaseError(f"{where}.version: {entry['version']} is recorded twice")
        releases.append(Release(entry["version"], entry["commit"], entry["date"]))
    return sorted(releases, key=lambda r: Version(r.version))


def latest_release(path: Path = RELEASES_PATH) -> Release | None:
    releases = load_releases(path)
    return releases[-1] if releases else None


def write_releases(releases: list[Release], path: Path = RELEASES_PATH) -> None:
    """Replace the record atomically (oldest version first)."""
    ordered = sorted(releases, key=lambda r: Version(r.version))
    text = json.dumps({"releases": [asdict(r) for r in ordered]}, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=".tmp-releases-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cut_release(version: str, root: Path = REPO_ROOT, tag: bool = True) -> Release:
    """Record HEAD of the checkout at ``root`` as release ``version`` (see the module doc)."""
    from moe_engine import __version__

    root = Path(root)
    path = root / RELEASES_PATH.name
    parsed = release_version(version)
    try:
        commit, dirty = checkout_head(root)
    except NotACheckout as err:
        raise ReleaseError(f"{err}: a release is a commit") from None
    if dirty:
        raise ReleaseError("tracked files have uncommitted changes: commit (or stash) them, the release is HEAD")
    if version != __version__:
        raise ReleaseError(
            f"{version} differs from the package version {__version__}: set version in pyproject.toml, "
            "commit, reinstall (pip install -e .) and run this again"
        )
    releases = load_releases(path)
    if releases and parsed <= Version(releases[-1].version):
        raise ReleaseError(f"{version} is not newer than the latest release {releases[-1].version}")
    if any(r.commit == commit for r in releases):
        raise ReleaseError(f"HEAD {commit[:12]} is already a release")
    tag_name = f"v{version}"
    tagged = try_git(root, "rev-parse", "--verify", "--quiet", f"{tag_name}^{{commit}}")
    if tag and tagged and tagged != commit:
        raise ReleaseError(f"tag {tag_name} already exists at {tagged[:12]}, not at HEAD")
    release = Release(version, commit, datetime.now(timezone.utc).date().isoformat())
    write_releases([*releases, release], path)
    if tag and not tagged:
        try:
            git(root, "tag", tag_name, commit)
        except (OSError, subprocess.SubprocessError):
            raise ReleaseError(f"recorded {version} in {path.name}, but creating the tag {tag_name} failed") from None
    return release
