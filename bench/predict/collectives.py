"""The network and its collectives as the projection prices them: ``Network`` (the links of a cluster),
``Collective`` (one call as a rank issued it), the alpha-beta price of each (``collective_seconds``) and the
table of a run's collectives (``summarize_collectives``).

Formulas: ``bench.predict.projection``'s docstring, sections "Network" and "Collectives". Pure arithmetic on the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OPS",
    "PHASES",
    "Collective",
    "Network",
    "collective_seconds",
    "is_int",
    "is_number",
    "summarize_collectives",
]

OPS = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "send", "recv")
PHASES = ("expert", "pipeline", "fsdp", "grad", "other")

_CLUSTER_DEFAULTS: dict[str, Any] = {
    "gpus_per_node": 8,
    "intra_node_gbps": 900.0,
    "inter_node_gbps": 50.0,
    "latency_us": 10.0,
}


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    # bool is an int subclass; True as a rank or byte count is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Network:
    """The links of a cluster as the projection prices them."""

    gpus_per_node: int
    """GPUs (ranks) per node; rank r sits on node r // gpus_per_node."""
    intra_node_gbps: float
    """Per-GPU bandwidth inside a node, GB/s (1e9 bytes/s)."""
    inter_node_gbps: float
    """Per-GPU bandwidth between nodes, GB/s (1e9 bytes/s)."""
    latency_us: float
    """Alpha: fixed cost of one message (one step of a collective), microseconds."""

    def __post_init__(self) -> None:
        if not is_int(self.gpus_per_node) or self.gpus_per_node < 1:
            raise ValueError(f"network.gpus_per_node: must be an integer >= 1, got {self.gpus_per_node!r}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ValueError(f"network.{name}: must be a number > 0, got {value!r}")
        if not is_number(self.latency_us) or not self.latency_us >= 0:
            raise ValueError(f"network.latency_us: must be a number >= 0, got {self.latency_us!r}")

    @classmethod
    def from_cluster(cls, cluster: Mapping[str, Any]) -> Network:
        """The network of a scenario's ``cluster:`` mapping; missing keys take the defaults, other keys are ignored."""
        values = {key: cluster.get(key, default) for key, default in _CLUSTER_DEFAULTS.items()}
        return cls(**values)

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_node_gbps * 1e9

    @property
    def inter_bytes_per_s(self) -> float:
        return self.inter_node_gbps * 1e9

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        return len({self.node(r) for r in ranks}) > 1

    def beta(self, ranks: Iterable[int]) -> float:
        """Bytes per second a group's ring moves: the slowest link it crosses."""
        return self.inter_bytes_per_s if self.spans_nodes(ranks) else self.intra_bytes_per_s


@dataclass(frozen=True)
class Collective:
    """One collective call as this rank issued it."""

    op: str
    """One of all_to_all, all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv."""
    ranks: tuple[int, ...]
    """Global ranks of the group; for send and recv the pair (this rank, peer)."""
    nbytes: int
    """all_to_all: this rank's send buffer; all_reduce, broadcast: the tensor; reduce_scatter: the whole
    input; all_gather: the whole output; send, recv: the message; barrier: 0."""
    phase: str
    """expert (token dispatch, inside a microbatch), pipeline (stage messages, per microbatch), fsdp
    (FSDP's parameter gathers, per microbatch), grad (gradient / parameter sync, once per step) or
    other (anything else, once per step)."""
    count: int = 1
    """How many identical calls this entry stands for."""

    def __post_init__(self) -> None:
        # Records may come from JSON, where the group is a list; keep the frozen, hashable tuple.
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.op not in OPS:
            raise ValueError(f"collective.op: unknown op {self.op!r}; expected one of {', '.join(OPS)}")
        if self.phase not in PHASES:
            raise ValueError(f"collective.phase: unknown phase {self.phase!r}; expected one of {', '.join(PHASES)}")
        if not self.ranks:
            raise ValueError(f"collective.ranks: {self.op} needs at least one rank")
        if not all(is_int(r) and r >= 0 for r in self.ranks):
            raise ValueError(f"collective.ranks: ranks must be integers >= 0, got {self.ranks!r}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"collective.ranks: {self.op} group lists a rank twice: {self.ranks!r}")
        if self.op in ("send", "recv") and len(self.ranks) != 2:
            raise ValueError(f"collective.ranks: {self.op} needs (this rank, peer), got {self.ranks!r}")
        if not is_int(self.nbytes) or self.nbytes < 0:
            raise ValueError(f"collective.nbytes: must be an integer >= 0, got {self.nbytes!r}")
        if self.op == "barrier" and self.nbytes != 0:
            raise ValueError(f"collective.nbytes: a barrier carries no payload, got {self.nbytes}")
        if not is_int(self.count) or self.count < 1:
            raise ValueError(f"collective.count: must be an integer >= 1, got {self.count!r}")


def _all_to_all_seconds(c: Collective, rank: int, net: Network) -> float:
    n, b = len(c.ranks), c.nbytes
    local = sum(1 for r in c.ranks if net.node(r) == net.node(rank))
    on_node = b * (local - 1) / n / net.intra_bytes_per_s
    off_node = b * (n - local) / n / net.inter_bytes_per_s
    return (n - 1) * net.alpha_s + max(on_node, off_node)


def _one_call_seconds(c: Collective, rank: int, net: Network) -> float:
    n, b, alpha = len(c.ranks), c.nbytes, net.alpha_s
    if c.op in ("send", "recv"):
        return alpha + b / net.beta(c.ranks)
    if n == 1:
        return 0.0
    if c.op == "all_to_all":
        return _all_to_all_seconds(c, rank, net)
    if c.op == "barrier":
        return 2 * math.ceil(math.log2(n)) * alpha
    beta = net.beta(c.ranks)
    if c.op == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / beta
    if c.op in ("reduce_scatter", "all_gather"):
        return (n - 1) * alpha + (n - 1) / n * b / beta
    # broadcast: a pipelined ring moves every byte over each link once.
    return (n - 1) * alpha + b / beta


def collective_seconds(c: Collective, rank: int, net: Network) -> float:
    """Seconds ``rank`` spends in ``c`` (all ``c.count`` calls) on ``net`` (formulas in ``bench.predict.projection``'s docstring)."""
    if rank not in c.ranks:
        raise ValueError(f"collective.ranks: rank {rank} is not in the {c.op} group {c.ranks!r}")
    return c.count * _one_call_seconds(c, rank, net)


def summarize_collectives(items: list[Collective]) -> list[dict[str, Any]]:
    """Identical (op, group size, nbytes, phase) entries merged, JSON-ready, the most bytes first."""
    counts: dict[tuple[str, int, int, str], int] = {}
    for c in items:
        key = (c.op, len(c.ranks), c.nbytes, c.phase)
        counts[key] = counts.get(key, 0) + c.count
    rows: list[dict[str, Any]] = [
        {"op": op, "group_size": size, "nbytes": nbytes, "phase": phase, "count": count, "total_bytes": nbytes * count}
        for (op, size, nbytes, phase), count in counts.items()
    ]
    # Ties are ordered by the key so the table does not depend on the order collectives were recorded in.
    rows.sort(key=lambda r: (-r["total_bytes"], r["op"], r["phase"], r["group_size"], r["nbytes"]))
    return rows
