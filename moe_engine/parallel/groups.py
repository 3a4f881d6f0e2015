"""torch.distributed process groups for a layout: one call on every rank, the same order everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moe_engine.parallel.layout import Layout, RankCoords


@dataclass
class ProcessGroups:
    """This rank's groups. A group of size one is still a group (collectives on it are no-ops)."""

    layout: Layout
    """The layout the groups were built from."""
    coords: RankCoords
    """This rank's coordinates."""
    dp: dist.ProcessGroup
    """Data-parallel group: dense gradients are averaged over it."""
    ep: dist.ProcessGroup
    """Expert-parallel group: tokens travel inside it."""
    edp: dist.ProcessGroup
    """Expert-data-parallel group: expert gradients are averaged over it."""
    pp: dist.ProcessGroup
    """Pipeline group: activations pass along it."""


def build_process_groups(layout: Layout) -> ProcessGroups:
    """Create every group of the layout (``new_group`` is collective) and keep this rank's."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; launch with torchrun or init_process_group first")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"the layout needs {layout.world_size} ranks (dp * pp) but the process group has {dist.get_world_size()}"
        )
    rank = dist.get_rank()
    mine = {}
    for kind in ("dp", "ep", "edp", "pp"):
        for ranks in layout.groups(kind):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return ProcessGroups(layout=layout, coords=layout.coords(rank), **mine)
