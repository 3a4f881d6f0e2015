"""Where an MoE layer's experts live and how tokens reach them, chosen before the model is built.

A ``DispatchSpec`` goes to the model's constructor (``Transformer(config, dispatch=...)``, down to
each ``MoELayer``), which builds its experts (all, or this rank's block) and its dispatcher from it:
nothing is swapped in after the build. ``DispatchSpec.build`` is the seam for another dispatcher
class: a subclass (a frozen dataclass with any fields of its own) overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from moe_engine.config import DispatchKind, DispatchRows, MoEConfig, ParallelConfig
from moe_engine.moe.dedup_dispatch import DedupDispatcher, DispatchLevel
from moe_engine.moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher

if TYPE_CHECKING:
    from moe_engine.parallel.groups import NodeGroups, ProcessGroups


@dataclass(frozen=True)
class DispatchSpec:
    """The dispatcher every MoE layer of a model builds; the default keeps every expert on this device."""

    group: Any = None
    """The expert-parallel ``torch.distributed`` group tokens travel in; None: every expert on this device."""
    ep_rank: int = 0
    """This rank's index in ``group``: it holds the ``ep_rank``-th block of experts."""
    ep: int = 1
    """Ranks of ``group`` (the expert-parallel degree)."""
    kind: DispatchKind = DispatchKind.NO_SYNC
    """Sync (host split sizes) or no-sync (fixed-capacity slots) all-to-alls."""
    capacity_factor: float = 1.25
    """No-sync slots per destination, as a multiple of the balanced share."""
    a2a_chunks: int = 1
    """All-to-alls each direction of a layer's exchange is cut into (1: the whole buffer at once)."""
    rows: DispatchRows = DispatchRows.PER_EXPERT
    """What one row carries: per expert, per rank, per node (auto: per node where ``nodes`` is given)."""
    nodes: NodeGroups | None = None
    """``group`` split by node, for per-node rows."""

    def __post_init__(self) -> None:
        # Coerced here, so that a spec built from strings compares equal to one built from the enums.
        object.__setattr__(self, "kind", DispatchKind(self.kind))
        object.__setattr__(self, "rows", DispatchRows(self.rows))
        if self.group is None:
            if self.ep != 1 or self.ep_rank != 0:
                raise ValueError(f"ep={self.ep}, ep_rank={self.ep_rank} need an expert-parallel group")
            return
        if dist.get_world_size(self.group) != self.ep:
            raise ValueError(
                f"the expert-parallel group has {dist.get_world_size(self.group)} ranks, expected ep={self.ep}"
            )
        if not 0 <= self.ep_rank < self.ep:
            raise ValueError(f"ep_rank={self.ep_rank} is outside an expert-parallel group of {self.ep}")
        if self.rows is DispatchRows.PER_NODE and self.nodes is None:
            raise ValueError("per-node dispatch needs the expert-parallel group's node groups")

    @classmethod
    def from_parallel(cls, parallel: ParallelConfig, groups: ProcessGroups | None) -> DispatchSpec:
        """The dispatch of a rank of ``parallel``'s layout: local where ep = 1, else over ``groups.ep``."""
        if parallel.ep == 1:
            return cls()
        if groups is None:
            raise ValueError(f"ep={parallel.ep} needs process groups")
        return cls(
            group=groups.ep,
            ep_rank=groups.coords.ep_rank,
            ep=parallel.ep,
            kind=parallel.dispatch,
            capacity_factor=parallel.capacity_factor,
            a2a_chunks=parallel.a2a_chunks,
            rows=parallel.resolved_dispatch_rows,
            nodes=groups.nodes,
        )

    @property
    def local(self) -> bool:
        """Whether every expert stays on this device."""
        return self.group is None

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts a layer of ``num_experts`` holds here."""
        if self.local:
            return range(num_experts)
        if num_experts % self.ep != 0:
            raise ValueError(f"ep={self.ep} does not divide num_experts={num_experts}")
        # Imported here: the parallel package builds on models, so a module-level import could cycle.
        from moe_engine.parallel.layout import Layout

        return Layout(ParallelConfig(dp=self.ep, ep=self.ep)).local_experts(self.ep_rank, num_experts)

    def build(self, moe: MoEConfig, d_model: int, layer_idx: int, fused_kernels: bool) -> Dispatcher:
        """The dispatcher of MoE layer ``layer_idx`` (``moe``, width ``d_model``), its row gathers and
        combines fused or not as ``fused_kernels`` says. A subclass overrides it to build another class."""
        if self.local:
            return LocalDispatcher(fused_kernels)
        args = (self.kind, self.capacity_factor, self.a2a_chunks)
        rows = self.rows
        if rows is DispatchRows.AUTO:
            rows = DispatchRows.PER_RANK if self.nodes is None else DispatchRows.PER_NODE
        if rows is DispatchRows.PER_EXPERT:
            return AllToAllDispatcher(self.group, *args, fused_kernels=fused_kernels)
        if rows is DispatchRows.PER_RANK:
            return DedupDispatcher([DispatchLevel(self.group, 1)], *args, fused_kernels=fused_kernels)
        assert self.nodes is not None  # checked in __post_init__
        per_node = dist.get_world_size(self.nodes.intra)
        levels = [DispatchLevel(self.nodes.inter, per_node), DispatchLevel(self.nodes.intra, 1)]
        return DedupDispatcher(levels, *args, fused_kernels=fused_kernels)
