"""Accepted changes: a change made on purpose, accepted by name.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from bench.gate.compare import EPS
from bench.gate.groups import Key
from bench.metrics import names
from bench.results import ResultDocument
from bench.units import format_percent

if TYPE_CHECKING:  # an annotation only: compare imports nothing from here, and work imports both
    from bench.gate.compare import Comparison

GATED_METRICS = names(gated=True)
"""The metrics with a direction that execute, proxy and plan runs write (``bench.run.execute``,
``bench.run.proxy.run``, ``bench.predict.plan``), and the work counters: an acceptance names one of them,
or a metric of the documents it is checked against (``check_metric_names``)."""


ACCEPT_FORMAT = "METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%: REASON"


_METRIC_NAME = re.compile(r"[A-Za-z0-9_]+")


_SCENARIO_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


@dataclass(frozen=True)
class Acceptance:
    """A change of named metrics on named scenarios made on purpose (module doc, Accepted changes)."""

    metrics: tuple[str, ...]
    """The metrics whose regression is accepted."""
    scenarios: tuple[str, ...]
    """The scenarios on which it is accepted."""
    max_change: float
    """The largest change accepted, as a fraction in the worse direction (0.06: 6% worse)."""
    reason: str
    """Why the change is made; the report shows it in place of "regressed"."""
    release: str | None = None
    """The release that made the change (``releases.json``); None for one given on the command line."""

    @property
    def spec(self) -> str:
        """The text ``parse_acceptance`` reads back (what ``releases.json`` stores)."""
        return f"{','.join(self.metrics)}@{','.join(self.scenarios)}<={format_percent(self.max_change)}: {self.reason}"

    def applies(self, base_version: str | None, cand_version: str | None) -> bool:
        """Whether it applies to a baseline and a candidate of these engine versions: a release's when the
        baseline is older than the release and the candidate is that release or newer; one given on
        the command line always."""
        if self.release is None:
            return True
        if base_version is None or cand_version is None:
            return False  # a side of unknown version cannot be placed against the release
        try:
            return Version(base_version) < Version(self.release) <= Version(cand_version)
        except (InvalidVersion, TypeError):
            return False

    def describe(self) -> str:
        """``fp32 gradient buffers (release 0.2.0, up to 6%)``."""
        source = f"release {self.release}" if self.release else "--accept"
        return f"{self.reason} ({source}, up to {format_percent(self.max_change)})"


def parse_acceptance(text: str, release: str | None = None) -> Acceptance:
    """``METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%: REASON``; raises ValueError (one line) otherwise.

    The size is required: an acceptance never covers a change larger than the one it was given for.
    """
    expected = f"expected {ACCEPT_FORMAT}"
    if not isinstance(text, str) or "\n" in text:
        raise ValueError(f"{text!r}: not one line of text; {expected}")
    head, colon, reason = text.partition(":")
    names, at, rest = head.partition("@")
    scenarios, le, size = rest.partition("<=")
    if not at:
        raise ValueError(f"{text!r}: no '@' between the metric and the scenarios; {expected}")
    if not le:
        raise ValueError(f"{text!r}: no accepted size (such as <=6%) after the scenarios; {expected}")
    if not colon or not reason.strip():
        raise ValueError(f"{text!r}: no reason after ':'; {expected}")
    metric_names = tuple(n.strip() for n in names.split(","))
    scenario_names = tuple(n.strip() for n in scenarios.split(","))
    bad = next((n for n in metric_names if not _METRIC_NAME.fullmatch(n)), None)
    if bad is not None:
        raise ValueError(f"{text!r}: {bad!r} is not a metric name; {expected}")
    bad = next((n for n in scenario_names if not _SCENARIO_NAME.fullmatch(n)), None)
    if bad is not None:
        raise ValueError(f"{text!r}: {bad!r} is not a scenario name; {expected}")
    size = size.strip()
    try:
        fraction = float(size[:-1]) / 100 if size.endswith("%") else math.nan
    except ValueError:
        fraction = math.nan
    if not math.isfinite(fraction) or fraction <= 0:
        raise ValueError(f"{text!r}: the accepted size {size!r} is not a percentage above 0, such as 6%")
    return Acceptance(metric_names, scenario_names, fraction, reason.strip(), release)


def check_metric_names(acceptances: Iterable[Acceptance], docs: Iterable[ResultDocument] = ()) -> None:
    """Raise ValueError (one line) for a metric that is neither gated (``GATED_METRICS``) nor in ``docs``:
    an acceptance of a misspelt metric would accept nothing, silently."""
    known = set(GATED_METRICS)
    for doc in docs:
        known |= {name for name, entry in doc.metrics.items() if entry.get("better") is not None}
    for acceptance in acceptances:
        unknown = [name for name in acceptance.metrics if name not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"gated metrics: {', '.join(GATED_METRICS)}"
            raise ValueError(f"{acceptance.spec!r}: unknown metric {unknown[0]} ({hint})")


def acceptance_of(
    acceptances: Iterable[Acceptance], name: str, scenario: str, ratio: float | None, better: str | None
) -> tuple[tuple[Acceptance, ...], bool]:
    """The acceptances naming metric ``name`` on ``scenario``, and whether a change of ``ratio`` (cand /
    base) in the direction ``better`` is within them (their sizes compound)."""
    named = tuple(a for a in acceptances if name in a.metrics and scenario in a.scenarios)
    if not named or ratio is None or better not in ("higher", "lower"):
        return named, False
    if better == "lower":
        return named, ratio <= math.prod(1 + a.max_change for a in named) + EPS
    return named, ratio >= math.prod(1 - a.max_change for a in named) - EPS


def describe_acceptances(named: Iterable[Acceptance]) -> str:
    return "; ".join(a.describe() for a in named)


def beyond(named: Sequence[Acceptance]) -> str:
    """What a regression that acceptances name went beyond (empty when none names it)."""
    return f"; beyond the accepted change: {describe_acceptances(named)}" if named else ""


def applicable(comparison: Comparison, key: Key, acceptances: Iterable[Acceptance]) -> tuple[Acceptance, ...]:
    """The acceptances that apply to the two versions compared for ``key``."""
    base, cand = comparison.base_groups.get(key), comparison.cand_groups.get(key)
    base_version = base.version if base is not None else None
    cand_version = cand.version if cand is not None else None
    return tuple(a for a in acceptances if a.applies(base_version, cand_version))
