"""Grouping one side's documents by (scenario, machine), and pooling several runs of one scenario.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.results import ResultDocument, age_key, metric
from bench.scenario import ScenarioError, scenario_from_dict

Key = tuple[str, str]  # (scenario name, machine name)


@dataclass(frozen=True)
class Group:
    """All documents of one side for one (scenario, machine), pooled."""

    scenario: str
    machine: str
    newest: ResultDocument
    """The newest document: decides status, error, hash and version."""
    pooled: tuple[ResultDocument, ...]
    """The ``ok`` documents whose samples were pooled (same hash and version as ``newest``;
    empty when ``newest`` is not ok)."""
    ignored: tuple[ResultDocument, ...]
    """Documents of this scenario left out of the pool (other hash/version, or not ok)."""
    metrics: dict[str, dict[str, Any]]
    """Pooled metric entries (``bench.results.metric`` format)."""

    @property
    def key(self) -> Key:
        return (self.scenario, self.machine)

    @property
    def status(self) -> str:
        return self.newest.status

    @property
    def error(self) -> str | None:
        return self.newest.data.get("error")

    @property
    def hash(self) -> str:
        return self.newest.data["scenario"]["hash"]

    @property
    def version(self) -> str:
        return self.newest.version

    @property
    def paths(self) -> tuple[str, ...]:
        docs = self.pooled or (self.newest,)
        return tuple(str(d.path) for d in docs if d.path is not None)


def _pool_metrics(docs: Sequence[ResultDocument]) -> dict[str, dict[str, Any]]:
    """Concatenate samples per metric (newest document's unit and direction win); a metric without
    a spread in every document stays without one (exact: see the module doc)."""
    samples: dict[str, list[float]] = {}
    meta: dict[str, tuple[str, str | None]] = {}
    exact: dict[str, bool] = {}
    for doc in docs:  # oldest first, so the newest document's unit/better is kept last
        for name, entry in doc.metrics.items():
            samples.setdefault(name, []).extend(float(v) for v in entry["samples"])
            meta[name] = (entry["unit"], entry["better"])
            exact[name] = exact.get(name, True) and entry["spread"] is None
    if len(docs) == 1:
        return {name: dict(entry) for name, entry in docs[0].metrics.items()}
    pooled = {name: metric(values, *meta[name]) for name, values in samples.items()}
    for name, entry in pooled.items():
        if exact[name]:
            entry["spread"] = None
    return pooled


def _with_todays_defaults(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        return scenario_from_dict(json.loads(json.dumps(spec))).spec
    except (ScenarioError, ValueError, KeyError, TypeError):
        return None


def same_scenario(base: Group, cand: Group) -> bool:
    """Whether two sides ran the same scenario (docs/gate-statistics.md, scenario-level outcomes)."""
    if base.hash == cand.hash:
        return True
    base_spec = base.newest.data["scenario"].get("spec")
    cand_spec = cand.newest.data["scenario"].get("spec")
    if base_spec is None or cand_spec is None:
        return False
    # Both at today's defaults: a field added after both versions, at its default, changes neither.
    base_today, cand_today = _with_todays_defaults(base_spec), _with_todays_defaults(cand_spec)
    return base_today is not None and base_today == cand_today


def group_documents(docs: Iterable[ResultDocument]) -> dict[Key, Group]:
    """Group a side's documents by (scenario, machine) and pool repeated runs (see module doc)."""
    by_key: dict[Key, list[ResultDocument]] = {}
    for doc in docs:
        by_key.setdefault((doc.name, doc.machine), []).append(doc)
    groups: dict[Key, Group] = {}
    for key in sorted(by_key):
        members = sorted(by_key[key], key=age_key)
        newest = members[-1]
        if newest.status == "ok":
            same = lambda d: (
                d.status == "ok"
                and d.data["scenario"]["hash"] == newest.data["scenario"]["hash"]
                and d.version == newest.version
            )
            pooled = tuple(d for d in members if same(d))
        else:
            pooled = ()
        pooled_ids = {id(d) for d in pooled}
        ignored = tuple(d for d in members if id(d) not in pooled_ids and d is not newest)
        groups[key] = Group(
            scenario=key[0],
            machine=key[1],
            newest=newest,
            pooled=pooled,
            ignored=ignored,
            metrics=_pool_metrics(pooled) if pooled else {},
        )
    return groups
