"""Rows a token sends in an expert-parallel dispatch, by what a row carries (``DispatchRows``), and the
all-to-alls of one dispatch priced on the two link levels of a cluster.

Formulas: ``bench.predict.projection``'s docstring, section "Dispatch rows". Pure arithmetic on the
standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.predict.collectives import Collective, Network, collective_seconds, is_int
from moe_engine.parallel.layout import expected_destinations

__all__ = [
    "ROW_KINDS",
    "DispatchShape",
    "RowsPerToken",
    "dispatch_exchanges",
    "dispatch_seconds",
    "expected_distinct",
    "expected_rows_per_token",
    "measured_rows_per_token",
    "node_groups",
    "resolve_rows",
    "side_bytes",
]

ROW_KINDS = ("per-expert", "per-rank", "per-node")
"""What one all-to-all row carries (``moe_engine.config.DispatchRows`` without ``auto``)."""


def expected_distinct(experts: int, per_group: int, top_k: int) -> float:
    """E[distinct groups hit] when a token picks ``top_k`` of ``experts`` experts uniformly without
    replacement and consecutive experts sit ``per_group`` to a group: the hypergeometric
    G (1 - C(E - L, k) / C(E, k)), G = E / L groups."""
    for name, value in (("experts", experts), ("per_group", per_group), ("top_k", top_k)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    if experts % per_group:
        raise ValueError(f"per_group: {per_group} does not divide experts={experts}")
    if top_k > experts:
        raise ValueError(f"top_k: {top_k} exceeds experts={experts}")
    # The engine's own formula (its no-sync buffers are sized by it): one implementation.
    return expected_destinations(experts, top_k, experts // per_group)


@dataclass(frozen=True)
class RowsPerToken:
    """Rows one token sends per dispatch, by what it leaves through."""

    ranks: float
    """D_r: (token, destination rank) pairs, the token's own rank included."""
    nodes: float
    """D_n: (token, destination node) pairs, the token's own node included."""
    experts: float
    """k: (token, expert) pairs."""


@dataclass(frozen=True)
class DispatchShape:
    """The layout one dispatch runs on."""

    experts: int
    """E: routed experts of the layer."""
    top_k: int
    """k: experts per token."""
    ep: int
    """Ranks of the expert-parallel group (consecutive global ranks)."""
    ranks_per_node: int
    """g: consecutive ranks a node holds (g >= ep: the group is on one node)."""

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "ep", "ranks_per_node"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"dispatch.{name}: must be an integer >= 1, got {value!r}")
        if self.experts % self.ep:
            raise ValueError(f"dispatch.ep: {self.ep} does not divide experts={self.experts}")
        if self.ranks_per_node < self.ep and self.ep % self.ranks_per_node:
            raise ValueError(f"dispatch.ranks_per_node: {self.ranks_per_node} does not divide ep={self.ep}")

    @property
    def nodes(self) -> int:
        """N: nodes the group spans."""
        return max(1, self.ep // self.ranks_per_node)

    @property
    def node_ranks(self) -> int:
        """Ranks of the group on one node: min(g, ep)."""
        return min(self.ranks_per_node, self.ep)


def expected_rows_per_token(shape: DispatchShape) -> RowsPerToken:
    """Random routing's expectation (``expected_distinct``): experts per rank L = E / ep, per node g L."""
    per_rank = shape.experts // shape.ep
    return RowsPerToken(
        ranks=expected_distinct(shape.experts, per_rank, shape.top_k),
        nodes=expected_distinct(shape.experts, per_rank * shape.node_ranks, shape.top_k),
        experts=float(shape.top_k),
    )


def measured_rows_per_token(expert_ids: Iterable[Sequence[int]], shape: DispatchShape) -> RowsPerToken:
    """The same counts over routes as they came: ``expert_ids`` holds each token's k experts."""
    per_rank = shape.experts // shape.ep
    tokens = ranks = nodes = experts = 0
    for row in expert_ids:
        tokens += 1
        destinations = {e // per_rank for e in row}
        ranks += len(destinations)
        nodes += len({r // shape.node_ranks for r in destinations})
        experts += len(row)
    if not tokens:
        raise ValueError("expert_ids: no tokens")
    return RowsPerToken(ranks / tokens, nodes / tokens, experts / tokens)


def resolve_rows(kind: str, shape: DispatchShape) -> str:
    """``auto``: per-node when the group spans nodes, else per-rank (the engine's rule)."""
    if kind == "auto":
        return "per-node" if shape.ranks_per_node < shape.ep else "per-rank"
    if kind not in ROW_KINDS:
        raise ValueError(f"dispatch_rows: unknown kind {kind!r}; expected auto or one of {', '.join(ROW_KINDS)}")
    return kind


def node_groups(shape: DispatchShape, rank: int, first_rank: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(across, inside): the ranks with ``rank``'s local index on every node of its expert group, and
    its node's ranks of the group (the group is ``first_rank`` .. ``first_rank + ep - 1``)."""
    g = shape.node_ranks
    local = (rank - first_rank) % g
    node_start = rank - local
    across = tuple(first_rank + n * g + local for n in range(shape.nodes))
    inside = tuple(range(node_start, node_start + g))
    return across, inside


def side_bytes(shape: DispatchShape, level_experts: int) -> int:
    """Bytes a row carries beside its activations: the router weights and expert ids (fp32 each) of
    min(k, experts a destination holds) columns (``moe_engine.moe.dedup_dispatch``)."""
    return 8 * min(shape.top_k, level_experts)


def dispatch_exchanges(
    kind: str, shape: DispatchShape, rows: RowsPerToken, tokens: int, row_bytes: int, rank: int, first_rank: int = 0
) -> list[Collective]:
    """The all-to-alls one way of one dispatch of ``tokens`` tokens from ``rank`` (its group's ranks are
    ``first_rank`` .. ``first_rank + ep - 1``), each row ``row_bytes`` bytes: per-expert and per-rank one
    over the group (k or D_r rows a token); per-node one over the ranks with the rank's local index on
    each node (D_n rows a token, the inter-node level) and then one over the rank's node (D_r rows a
    token: what arrived at the node spreads to its ranks, the intra-node level)."""
    kind = resolve_rows(kind, shape)
    group = tuple(range(first_rank, first_rank + shape.ep))
    if rank not in group:
        raise ValueError(f"rank: {rank} is not in the expert group {group[0]}..{group[-1]}")
    if kind != "per-node" or shape.nodes == 1:
        per_token = rows.experts if kind == "per-expert" else rows.ranks
        return [Collective("all_to_all", group, round(tokens * per_token * row_bytes), "expert")]
    across, inside = node_groups(shape, rank, first_rank)
    return [
        Collective("all_to_all", across, round(tokens * rows.nodes * row_bytes), "expert"),
        Collective("all_to_all", inside, round(tokens * rows.ranks * row_bytes), "expert"),
    ]


def dispatch_seconds(exchanges: Iterable[Collective], rank: int, net: Network) -> float:
    """One way of a dispatch: its levels one after the other (the intra-node spread waits for the rows)."""
    return sum(collective_seconds(c, rank, net) for c in exchanges)
