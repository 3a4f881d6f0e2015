"""The order of engine versions (semantic: ``0.2.0 < 0.10.0``, unknown strings last), as the plots and
the report use it (the order of runs is ``bench.results.age_key``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = ["sort_versions", "version_sort_key"]

_Version: type[Version] | None
_InvalidVersion: type[Exception]
try:  # packaging ships with pip and matplotlib; keep a fallback so plotting never depends on it.
    from packaging.version import InvalidVersion as _PackagingInvalidVersion
    from packaging.version import Version as _PackagingVersion

    _Version, _InvalidVersion = _PackagingVersion, _PackagingInvalidVersion
except ImportError:  # pragma: no cover - exercised only without packaging
    _Version = None
    _InvalidVersion = ValueError

_FALLBACK_RE = re.compile(
    r"^v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|alpha|b|beta|c|rc|pre|preview)[-_.]?(?P<pre_n>\d*))?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?(?P<post>\d*))?"
    r"(?:[-_.]?dev[-_.]?(?P<dev>\d*))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?$",
    re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


def _fallback_key(text: str) -> tuple | None:
    """A PEP 440-like ordering key for the common forms, or None for an unknown string."""
    m = _FALLBACK_RE.match(text.strip())
    if not m:
        return None
    release = [int(p) for p in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    inf = math.inf
    pre: tuple[float, int]
    if m["pre"]:
        pre = (_PRE_RANK[m["pre"].lower()], int(m["pre_n"] or 0))
    elif m["dev"] is not None and m["post"] is None:
        pre = (-inf, 0)  # 1.0.dev1 sorts before 1.0a1
    else:
        pre = (inf, 0)
    post = int(m["post"] or 0) if m["post"] is not None else -inf
    dev = int(m["dev"] or 0) if m["dev"] is not None else inf
    local = tuple((0, int(p), "") if p.isdigit() else (-1, 0, p) for p in re.split(r"[-_.]", m["local"] or "") if p)
    return (tuple(release), pre, post, dev, local)


def version_sort_key(version: str) -> tuple:
    """Sort key for an engine version string: semantic order, unknown strings last (alphabetical).

    ``0.2.0 < 0.10.0``, ``0.1.0.dev3 < 0.1.0rc1 < 0.1.0 < 0.1.0+g1234.dirty < 0.1.1``.
    """
    if _Version is not None:
        try:
            return (0, _Version(version), version)
        except _InvalidVersion:
            return (1, version)
    key = _fallback_key(version)
    return (0, key, version) if key is not None else (1, version)


def sort_versions(versions: Iterable[str]) -> list[str]:
    """Distinct version strings in semantic order (unknown strings last)."""
    return sorted(set(versions), key=version_sort_key)
