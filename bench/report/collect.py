"""The results a report is drawn from: every document under a results folder, by version.
More: docs/report.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gate.groups import Group, group_documents
from bench.report.ordering import sort_versions, version_sort_key
from bench.results import NoResultDocuments, ResultDocument, ResultFileError, load_nonempty

Key = tuple[str, str]
"""(scenario name, machine name), as the gate keys its groups."""


class ReportError(ValueError):
    """Nothing can be drawn, or a version asked for is not there; ``str()`` is one line."""


@dataclass(frozen=True)
class ResultSet:
    """The documents under one results folder, grouped by version."""

    root: Path
    """The folder they were read from."""
    docs: tuple[ResultDocument, ...]
    """Every readable result document."""
    skipped: tuple[ResultFileError, ...]
    """Files that could not be read as result documents (named, with the reason)."""
    releases: tuple[str, ...]
    """The recorded release versions (``releases.json``), oldest first; marked on the trends."""
    _groups: dict[str, dict[Key, Group]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def versions(self) -> list[str]:
        """Every version with documents, in version order (``0.2.0 < 0.10.0``)."""
        return sort_versions(d.version for d in self.docs)

    @property
    def machines(self) -> list[str]:
        return sorted({d.machine for d in self.docs})

    def docs_of(self, version: str) -> list[ResultDocument]:
        return [d for d in self.docs if d.version == version]

    def groups(self, version: str) -> dict[Key, Group]:
        """The gate's groups of one version: (scenario, machine) -> pooled documents."""
        if version not in self._groups:
            self._groups[version] = group_documents(self.docs_of(version))
        return self._groups[version]

    def ok_groups(self, version: str) -> dict[Key, Group]:
        return {key: g for key, g in self.groups(version).items() if g.status == "ok"}

    def newest_first(self) -> list[str]:
        return list(reversed(self.versions))


def load_result_set(
    root: Path,
    releases: Iterable[str] = (),
    on_bad_file: Callable[[ResultFileError], None] | None = None,
) -> ResultSet:
    """Every readable document under ``root``; an unreadable file is skipped (and handed to
    ``on_bad_file`` to warn). Raises ReportError when ``root`` is missing or holds no document."""
    root = Path(root)
    if not root.exists():
        raise ReportError(f"{root}: no such results folder")
    try:
        loaded = load_nonempty(root, on_bad_file=on_bad_file or (lambda err: None))
    except NoResultDocuments as err:
        raise ReportError(f"{err}; nothing to draw") from None
    return ResultSet(root, tuple(loaded.docs), tuple(loaded.skipped), tuple(sort_versions(releases)))


@dataclass(frozen=True)
class VersionPair:
    """The two versions the release comparison sets side by side."""

    base: str
    new: str
    why: str
    """How they were chosen, for the page (``release 0.1.0, the last release before 0.2.0, against release
    0.2.0, the newest results``)."""
    unmeasured: tuple[str, ...] = ()
    """Recorded releases between ``base`` and ``new`` that have no results in the folder: shown as such
    on the page (with the command that compares them), never silently passed over."""


def choose_versions(results: ResultSet, base: str | None = None, new: str | None = None) -> VersionPair | None:
    """The versions to compare: ``new`` defaults to the newest version in the folder, ``base`` to the
    latest release older than ``new`` that the folder holds, else the version just before ``new``.
    None when the folder holds one version only (and none was asked for). ReportError for a version
    asked for that the folder does not hold, or for the same version on both sides."""
    versions = results.versions
    for flag, value in (("--base", base), ("--new", new)):
        if value is not None and value not in versions:
            raise ReportError(
                f"{flag} {value}: no results of that version in {results.root} (versions there: {', '.join(versions)})"
            )
    if base is not None and base == new:
        raise ReportError(f"--base and --new are both {base}: a comparison needs two versions")
    chosen_new = new if new is not None else versions[-1]
    if base is not None:
        if base == chosen_new:
            raise ReportError(
                f"--base {base}: the newest version in {results.root}; name an older one, or --new as well"
            )
        return VersionPair(base, chosen_new, "chosen with --base" + (" and --new" if new else ""))
    older = [v for v in versions if version_sort_key(v) < version_sort_key(chosen_new)]
    if not older:
        return None
    released = [v for v in older if v in results.releases]
    key = version_sort_key(chosen_new)
    unmeasured = tuple(
        r
        for r in results.releases
        if r not in versions and (not released or version_sort_key(r) > version_sort_key(released[-1]))
    )
    between = [r for r in unmeasured if version_sort_key(r) < key]
    if released and between:
        return VersionPair(
            released[-1],
            chosen_new,
            f"release {released[-1]} (the newest release with results here; release{'s' * (len(between) > 1)} "
            f"{', '.join(between)}: none here), against "
            + (f"release {chosen_new}" if chosen_new in results.releases else chosen_new)
            + (" (--new)" if new else ", the newest results"),
            unmeasured,
        )
    if released:
        # "The latest release" only where it is: the newest version may be a later release itself.
        base_text = (
            f"the latest release ({released[-1]})"
            if released[-1] == results.releases[-1]
            else f"release {released[-1]}, the last release before {chosen_new},"
        )
        new_text = f"release {chosen_new}" if chosen_new in results.releases else chosen_new
        return VersionPair(
            released[-1],
            chosen_new,
            f"{base_text} against {new_text}" + (" (--new)" if new else ", the newest results"),
            unmeasured,
        )
    return VersionPair(
        older[-1],
        chosen_new,
        "no release among the results: the version before " + (f"{chosen_new} (--new)" if new else "the newest"),
    )


AB_SIDES = ("baseline", "candidate")
"""The side folders ``moe-bench ab --out FOLDER`` writes: ``FOLDER/baseline/<scenario>/...`` and ``FOLDER/candidate/...``."""
VERSIONS_MANIFEST = Path("report") / "versions-results.txt"
"""What ``moe-bench versions --out FOLDER`` writes beside its table: the result files its images wrote (paths
relative to FOLDER, one a line). Those files are one machine's; the folder's other results are stored ones."""


@dataclass(frozen=True)
class SameMachineSource:
    """Results whose versions were measured on one machine in one job: a ``moe-bench ab --out`` folder (the
    baseline ref and the checkout) or the files a ``moe-bench versions`` run wrote (release images)."""

    kind: str
    """``ab`` or ``images``."""
    folder: str
    """Where it lies, relative to the results folder (``.`` for the folder itself)."""
    docs: tuple[ResultDocument, ...]

    def docs_of(self, version: str) -> list[ResultDocument]:
        return [d for d in self.docs if d.version == version]

    @property
    def where(self) -> str:
        return "this results folder" if self.folder == "." else self.folder

    @property
    def command(self) -> str:
        return "moe-bench ab --out" if self.kind == "ab" else "moe-bench versions"


def _ab_folder(path: Path, root: Path) -> str | None:
    """The ``moe-bench ab --out`` folder (relative to ``root``) holding the result file ``path``, if any."""
    try:
        parts = path.relative_to(root).parts[:-1]
    except ValueError:
        return None
    for i, part in enumerate(parts):
        if part in AB_SIDES and all((root.joinpath(*parts[:i]) / side).is_dir() for side in AB_SIDES):
            return Path(*parts[:i]).as_posix() if i else "."
    return None


def _image_files(root: Path) -> dict[Path, str]:
    """Every result file a ``moe-bench versions`` run under ``root`` lists, to the folder (relative to ``root``)."""
    found = {}
    for manifest in sorted(root.rglob(VERSIONS_MANIFEST.name)):
        if manifest.parent.name != VERSIONS_MANIFEST.parent.name:
            continue
        folder = manifest.parent.parent
        where = folder.relative_to(root).as_posix()
        for line in manifest.read_text().splitlines():
            if line.strip():
                found[(folder / line.strip()).resolve()] = where
    return found


def same_machine_sources(results: ResultSet) -> list[SameMachineSource]:
    """Every A/B folder and ``moe-bench versions`` run under the results folder: A/B first, then by folder name."""
    root = results.root.resolve()
    images = _image_files(root)
    found: dict[tuple[str, str], list[ResultDocument]] = {}
    for doc in results.docs:
        if doc.path is None:
            continue
        path = Path(doc.path).resolve()
        ab = _ab_folder(path, root)
        source = ("ab", ab) if ab is not None else ("images", images[path]) if path in images else None
        if source is not None:
            found.setdefault(source, []).append(doc)
    return [
        SameMachineSource(kind, folder, tuple(docs))
        for (kind, folder), docs in sorted(found.items(), key=lambda item: (item[0][0] != "ab", item[0][1]))
    ]


@dataclass(frozen=True)
class Problem:
    """A scenario whose newest run in a version did not finish ok."""

    version: str
    machine: str
    scenario: str
    status: str
    """failed, oom, timeout, skipped, ..."""
    error: str | None
    path: str | None


def problems(results: ResultSet) -> list[Problem]:
    """Every (version, machine, scenario) whose newest document is not ok, newest version first."""
    found = []
    for version in results.newest_first():
        for (scenario, machine), group in sorted(results.groups(version).items()):
            if group.status != "ok":
                path = str(group.newest.path) if group.newest.path is not None else None
                found.append(Problem(version, machine, scenario, group.status, group.error, path))
    return found


def median(group: Group, name: str) -> float | None:
    entry = group.metrics.get(name)
    return None if entry is None else float(entry["median"])


def first_metric(groups: Iterable[Group], names: Iterable[str]) -> str | None:
    """The first of ``names`` that every group has (alternatives: the GPU and the CPU record peak
    memory under different names)."""
    groups = list(groups)
    return next((n for n in names if groups and all(n in g.metrics for g in groups)), None)


def spec_of(group: Group) -> dict[str, Any]:
    return group.newest.data["scenario"].get("spec") or {}
