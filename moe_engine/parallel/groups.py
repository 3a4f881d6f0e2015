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
    nodes: NodeGroups | None = None
    """The expert-parallel group split by node, where it spans nodes (``ranks_per_node`` < ep)."""


@dataclass
class NodeGroups:
    """An expert-parallel group that spans nodes, split for node-aware dispatch."""

    intra: dist.ProcessGroup
    """This rank's node's ranks of its expert-parallel group, in order (group rank = local index)."""
    inter: dist.ProcessGroup
    """The ranks with this rank's local index on every node of its expert-parallel group (group rank = node)."""


def build_node_groups(ep_groups: list[list[int]], ranks_per_node: int) -> NodeGroups:
    """Split every expert-parallel group (each as its sorted ranks, a node holding ``ranks_per_node``
    consecutive ones) into intra- and inter-node groups; keep this rank's. Collective: every rank of
    the world calls it with the same arguments."""
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for ranks in ep_groups:
        if len(ranks) % ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node={ranks_per_node} does not divide an expert-parallel group of {len(ranks)}"
            )
        nodes = [ranks[n : n + ranks_per_node] for n in range(0, len(ranks), ranks_per_node)]
        for name, members in [("intra", node) for node in nodes] + [
            ("inter", [node[i] for node in nodes]) for i in range(ranks_per_node)
        ]:
            group = dist.new_group(members)
            if rank in members:
                mine[name] = group
    return NodeGroups(**mine)


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
    per_node = layout.config.ranks_per_node
    if per_node is not None and per_node < layout.config.ep:
        mine["nodes"] = build_node_groups(layout.groups("ep"), per_node)
    return ProcessGroups(layout=layout, coords=layout.coords(rank), **mine)
