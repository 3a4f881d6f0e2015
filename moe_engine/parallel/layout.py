"""Where every rank sits in a pp x dp layout (ep inside dp): pure arithmetic, no processes.

Ranks are numbered ``rank = pp_rank * dp + dp_rank`` and ``dp_rank = edp_rank * ep + ep_rank``, so
the ranks of one expert-parallel group are adjacent (the all-to-all stays inside a node first).
The plan (arithmetic over huge layouts) and the process groups (real runs) both read this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_engine.config import DataParallelMode, ParallelConfig


@dataclass(frozen=True)
class RankCoords:
    """A rank's coordinates in the layout."""

    rank: int
    """Global rank."""
    pp_rank: int
    """Pipeline rank (which stages it runs)."""
    dp_rank: int
    """Position in its data-parallel group."""
    ep_rank: int
    """Position in its expert-parallel group (which experts it holds)."""
    edp_rank: int
    """Position in its expert-data-parallel group (which replica of its experts it is)."""


class Layout:
    """The process grid of a ``ParallelConfig``: coordinates, groups, stages and local experts."""

    def __init__(self, config: ParallelConfig):
        self.config = config

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        cfg = self.config
        pp_rank, dp_rank = divmod(rank, cfg.dp)
        edp_rank, ep_rank = divmod(dp_rank, cfg.ep)
        return RankCoords(rank, pp_rank, dp_rank, ep_rank, edp_rank)

    def rank_of(self, pp_rank: int, edp_rank: int, ep_rank: int) -> int:
        return pp_rank * self.config.dp + edp_rank * self.config.ep + ep_rank

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind (``dp``, ``ep``, ``edp`` or ``pp``), each as its sorted ranks."""
        cfg = self.config
        if kind == "dp":
            return [[self.rank_of(p, d, e) for d in range(cfg.edp) for e in range(cfg.ep)] for p in range(cfg.pp)]
        if kind == "ep":
            return [[self.rank_of(p, d, e) for e in range(cfg.ep)] for p in range(cfg.pp) for d in range(cfg.edp)]
        if kind == "edp":
            return [[self.rank_of(p, d, e) for d in range(cfg.edp)] for p in range(cfg.pp) for e in range(cfg.ep)]
        if kind == "pp":
            return [[self.rank_of(p, d, e) for p in range(cfg.pp)] for d in range(cfg.edp) for e in range(cfg.ep)]
        raise ValueError(f"unknown group kind {kind!r}; expected dp, ep, edp or pp")

    def stage_indices(self, pp_rank: int) -> list[int]:
        """Pipeline stages run by ``pp_rank``: r, r + pp, ..., r + (v-1) * pp."""
        cfg = self.config
        return list(range(pp_rank, cfg.num_stages, cfg.pp))

    def local_experts(self, ep_rank: int, num_experts: int) -> range:
        """Global indices of the experts this expert-parallel rank holds (a contiguous block)."""
        per_rank = num_experts // self.config.ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def stage_blocks(n_layers: int, num_stages: int) -> list[range]:
    """Blocks of each pipeline stage: stage s of S gets ceil(L/S) blocks when s < L mod S, else floor."""
    base, extra = divmod(n_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


def stage_layers(n_layers: int, pp: int, virtual_stages: int = 1) -> list[list[int]]:
    """Block indices held by each pipeline rank (all of its stages, in order)."""
    chunks = stage_blocks(n_layers, pp * virtual_stages)
    return [[i for c in range(r, pp * virtual_stages, pp) for i in chunks[c]] for r in range(pp)]


def check_proxy_layout(parallel: ParallelConfig) -> None:
    """What a proxy rank can replay; raises ``ValueError`` naming the field otherwise."""
    if parallel.dp_mode is not DataParallelMode.DDP:
        raise ValueError("parallel.dp_mode: a proxy rank replays ddp layouts (with or without zero1), not fsdp")
    if parallel.pp > 1 and parallel.virtual_stages != 1:
        raise ValueError("parallel.virtual_stages: a proxy rank runs one pipeline stage per rank")
    if parallel.pp > 1 and parallel.schedule.value not in ("gpipe", "1f1b"):
        raise ValueError(f"parallel.schedule: a proxy rank runs gpipe or 1f1b, not {parallel.schedule.value}")


def destination_share(num_experts: int, top_k: int, destinations: int) -> float:
    """Probability that a token's ``top_k`` distinct experts, drawn uniformly from ``num_experts``,
    include at least one of a given destination's ``num_experts / destinations``: hypergeometric,
    1 - C(E - E/G, k) / C(E, k)."""
    per_destination = num_experts // destinations
    return 1.0 - math.comb(num_experts - per_destination, top_k) / math.comb(num_experts, top_k)


def expected_destinations(num_experts: int, top_k: int, destinations: int) -> float:
    """Expected distinct destinations (ranks or nodes, of ``destinations`` equal blocks of experts) of
    a token under uniform random top-k routing: the rows it is sent as, per token."""
    return destinations * destination_share(num_experts, top_k, destinations)
