"""The release record: which commit each release is, kept in ``releases.json`` at the repository root.
More: docs/gates-and-releases.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from packaging.version import InvalidVersion, Version

import moe_engine
from bench.gate.accept import Acceptance, parse_acceptance
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
    accepted: tuple[Acceptance, ...] = ()
    """The changes it makes on purpose (each with ``release`` set to this version)."""
    baseline: dict | None = None
    """Where its results from the machine that cut it are (module doc); None: none were stored."""

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    def compare_elsewhere(self) -> str:
        """The commands that compare this release with a checkout on any one machine."""
        return (
            f"moe-bench ab --baseline-ref {self.tag} (this checkout and the release, on this machine), "
            f"or moe-bench versions <image of {self.version}> <image of the checkout>"
        )

    def baseline_text(self) -> str:
        """One line: where its stored results are, or that there are none."""
        if not self.baseline:
            return f"no stored results; compare with {self.compare_elsewhere()}"
        where = self.baseline["results"]
        at = f" at commit {self.baseline['commit'][:12]}" if self.baseline.get("commit") else ""
        return f"results of {self.baseline['machine']} in {where}{at}; elsewhere: {self.compare_elsewhere()}"


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
        specs = entry.get("accepted", [])
        if not isinstance(specs, list):
            raise ReleaseError(f"{where}.accepted: expected a list of accepted changes")
        accepted = []
        for number, spec in enumerate(specs):
            try:
                accepted.append(parse_acceptance(spec, release=entry["version"]))
            except ValueError as err:
                raise ReleaseError(f"{where}.accepted[{number}]: {err}") from None
        baseline = entry.get("baseline")
        if baseline is not None and not (
            isinstance(baseline, dict)
            and isinstance(baseline.get("machine"), str)
            and isinstance(baseline.get("results"), str)
        ):
            raise ReleaseError(f"{where}.baseline: expected an object with the strings machine and results")
        releases.append(Release(entry["version"], entry["commit"], entry["date"], tuple(accepted), baseline))
    return sorted(releases, key=lambda r: Version(r.version))


def latest_release(path: Path = RELEASES_PATH) -> Release | None:
    releases = load_releases(path)
    return releases[-1] if releases else None


def write_releases(releases: list[Release], path: Path = RELEASES_PATH) -> None:
    """Replace the record atomically (oldest version first)."""
    ordered = sorted(releases, key=lambda r: Version(r.version))
    entries = [
        {
            "version": r.version,
            "commit": r.commit,
            "date": r.date,
            **({"accepted": [a.spec for a in r.accepted]} if r.accepted else {}),
            **({"baseline": r.baseline} if r.baseline else {}),
        }
        for r in ordered
    ]
    text = json.dumps({"releases": entries}, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=".tmp-releases-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cut_release(
    version: str, root: Path = REPO_ROOT, tag: bool = True, accepted: tuple[Acceptance, ...] = ()
) -> Release:
    """Record HEAD of the checkout at ``root`` as release ``version`` (see the module doc), with the
    changes it makes on purpose."""
    root = Path(root)
    path = root / RELEASES_PATH.name
    parsed = release_version(version)
    try:
        commit, dirty = checkout_head(root)
    except NotACheckout as err:
        raise ReleaseError(f"{err}: a release is a commit") from None
    if dirty:
        raise ReleaseError("tracked files have uncommitted changes: commit (or stash) them, the release is HEAD")
    if version != moe_engine.__version__:
        raise ReleaseError(
            f"{version} differs from the package version {moe_engine.__version__}: set version in pyproject.toml, "
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
    release = Release(
        version,
        commit,
        datetime.now(timezone.utc).date().isoformat(),
        tuple(replace(a, release=version) for a in accepted),
    )
    write_releases([*releases, release], path)
    if tag and not tagged:
        try:
            git(root, "tag", tag_name, commit)
        except (OSError, subprocess.SubprocessError):
            raise ReleaseError(f"recorded {version} in {path.name}, but creating the tag {tag_name} failed") from None
    return release


def record_acceptances(version: str, accepted: tuple[Acceptance, ...], path: Path = RELEASES_PATH) -> Release:
    """Add changes made on purpose to the recorded release ``version`` (one already recorded is kept once)."""
    releases = load_releases(path)
    release = next((r for r in releases if r.version == version), None)
    if release is None:
        raise ReleaseError(
            f"{version} is not a recorded release (recorded: {', '.join(r.version for r in releases) or 'none'})"
        )
    added = [replace(a, release=version) for a in accepted]
    new = [a for a in dict.fromkeys(added) if a not in release.accepted]
    updated = replace(release, accepted=(*release.accepted, *new))
    write_releases([updated if r is release else r for r in releases], path)
    return updated


def record_baseline(
    version: str, machine: str, results: str, commit: str | None = None, path: Path = RELEASES_PATH
) -> Release:
    """Record where release ``version``'s own results are (module doc)."""
    releases = load_releases(path)
    release = next((r for r in releases if r.version == version), None)
    if release is None:
        raise ReleaseError(f"{version} is not a recorded release")
    updated = replace(release, baseline={"machine": machine, "results": results, "commit": commit})
    write_releases([updated if r is release else r for r in releases], path)
    return updated
