"""Expert-parallel dispatch that sends each token once per destination, not once per expert.
More: docs/dispatch.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_engine.config import DispatchKind
from moe_engine.moe.chain_streams import ChainStreams
from moe_engine.moe.dispatch import Dispatcher, HandOver, SlicedReceive, all_to_all_rows, start_all_to_all
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import (
    ExpertGroups,
    RoutingPlan,
    RowMap,
    chunk_major_order,
    chunk_rows,
    combine,
    gather_tokens,
    plan_routing,
    plan_slots,
    reorder_rows,
)
from moe_engine.parallel.layout import destination_share


@dataclass(frozen=True)
class DispatchLevel:
    """One exchange of a ``DedupDispatcher``."""

    group: dist.ProcessGroup
    """The group rows travel in; its rank g is destination g."""
    ranks_below: int
    """Expert-parallel ranks each destination stands for (1: a rank; ranks per node: a node)."""


@dataclass
class _HopPlan:
    """Where one level's rows go: the send buffer's map, its cuts per chunk and what was dropped."""

    rows: RowMap
    """Input entries (row r, column j: r*width + j) <-> send buffer rows; an entry has a send row
    when it is the first of its row's entries for that destination (and, no-sync, got a slot)."""
    send_chunks: list[list[int]]
    """[chunk][destination] rows sent."""
    recv_chunks: list[list[int]]
    """[chunk][source] rows received."""
    dropped: torch.Tensor
    """int64 scalar: assignments (valid entries) whose row got no slot."""
    below: list[tuple[list[int], list[int]]] | None = None
    """Sync with a level below: per chunk, the rows this rank sends and receives there, by destination
    and by source (``DedupDispatcher.sync_splits``); None: that level counts for itself."""


class DedupDispatcher(Dispatcher):
    """Expert parallelism with one row per (token, destination) at each of ``levels`` (docs/dispatch.md).

    The levels' sizes multiply to the expert-parallel degree ep; this rank's expert-parallel rank is
    its rank in the first level's group times the second's size plus its rank there (ranks of a node
    consecutive), and it holds experts [ep_rank * L, (ep_rank + 1) * L). In the no-sync variant every
    rank must pass the same number of tokens; every rank must use the same ``chunks``. With
    ``fused_kernels`` the row gathers and combines run as the fused ops.
    """

    def __init__(
        self,
        levels: Sequence[DispatchLevel],
        kind: DispatchKind = DispatchKind.NO_SYNC,
        capacity_factor: float = 1.25,
        chunks: int = 1,
        fused_kernels: bool = False,
    ):
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"a2a_chunks must be an integer >= 1, got {chunks!r}")
        self.levels = list(levels)
        self.sizes = [dist.get_world_size(level.group) for level in self.levels]
        self.ep = math.prod(self.sizes)
        below = self.ep
        for level, size in zip(self.levels, self.sizes):
            below //= size
            if level.ranks_below != below:
                raise ValueError(f"level of {size} destinations stands for {level.ranks_below} ranks, expected {below}")
        self.kind = DispatchKind(kind)
        self.capacity_factor = capacity_factor
        self.chunks = chunks
        self.fused_kernels = fused_kernels

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copied model talks over the same groups.
        return copy.copy(self)

    def __call__(self, x_TD, route, experts):
        shares = [destination_share(experts.num_experts * self.ep, route.expert_TK.shape[1], s) for s in self._dests()]
        streams = ChainStreams.for_device(x_TD.device, len(self.levels) > 1)
        return self._hop(0, x_TD, route.expert_TK, route.weight_TK, experts, shares, self.chunks, streams)

    def _dests(self) -> list[int]:
        """Destinations of each level's kind in the whole expert-parallel group (nodes, then ranks)."""
        return [self.ep // level.ranks_below for level in self.levels]

    def _slots(self, level: int, rows_in: int, shares: list[float]) -> int:
        """No-sync rows per destination at ``level`` for ``rows_in`` input rows (docs/dispatch.md)."""
        factor = shares[0] * self.capacity_factor if level == 0 else shares[level] / shares[level - 1]
        # Rounded first so that e.g. 0.1 * 30 counts as 3, not 3.0000000000000004 -> 4.
        return max(1, math.ceil(round(factor * rows_in, 9)))

    def plan(
        self,
        level: int,
        ids_RK: torch.Tensor,
        block: int,
        shares: list[float],
        chunks: int,
        known: tuple[list[int], list[int]] | None = None,
    ) -> _HopPlan:
        """The rows ``level`` sends for the entries ``ids_RK`` (expert ids in the level's scope of
        ``size * block`` experts; that count itself marks an unused entry); ``known``: sync, the
        rows per destination and per source, counted by the level above."""
        size = self.sizes[level]
        rows_in, width = ids_RK.shape
        dest_RK = torch.div(ids_RK, block, rounding_mode="floor")
        # Each entry's first entry in its row with the same destination: the one that carries the row.
        first_RK = (dest_RK.unsqueeze(2) == dest_RK.unsqueeze(1)).to(torch.int8).argmax(dim=2)
        column_K = torch.arange(width, device=ids_RK.device)
        leader_RK = (first_RK == column_K) & (dest_RK < size)
        # Non-leading entries sort after every destination: no row (plan_slots' unrouted assignments).
        sorted_plan = plan_routing(torch.where(leader_RK, dest_RK, size), size + 1)
        counts_S = sorted_plan.groups.counts_E[:size]
        below = None
        if self.kind is DispatchKind.SYNC:
            if known is not None:
                send_S, recv_S = known
            else:
                send_S, recv_S, below = self.sync_splits(
                    level, ids_RK, block, leader_RK, sorted_plan.rows, counts_S, chunks
                )
            leader_N = leader_RK.flatten()
            rows = RowMap(
                row_N=torch.where(leader_N, sorted_plan.rows.row_N, 0),
                assignment_R=sorted_plan.rows.assignment_R[: sum(send_S)],
                top_k=width,
                kept_N=leader_N,
            )
            rows_S, dropped = counts_S, torch.zeros((), dtype=torch.int64, device=ids_RK.device)
        else:
            slots = self._slots(level, rows_in, shares)
            slot_plan = plan_slots(RoutingPlan(sorted_plan.rows, ExpertGroups.from_counts(counts_S)), size, slots)
            rows = slot_plan.rows
            assert rows.kept_N is not None  # plan_slots always marks kept assignments
            row_kept_RK = rows.kept_N.view(rows_in, width).gather(1, first_RK)
            dropped = ((dest_RK < size) & ~row_kept_RK).sum()
            send_S = recv_S = [slots] * size
            rows_S = torch.full((size,), slots, dtype=torch.int64, device=ids_RK.device)
        if chunks > 1:
            rows = reorder_rows(rows, chunk_major_order(rows_S, rows.assignment_R.numel(), chunks))
        return _HopPlan(rows, chunk_rows(send_S, chunks), chunk_rows(recv_S, chunks), dropped, below)

    def sync_splits(
        self,
        level: int,
        ids_RK: torch.Tensor,
        block: int,
        leader_RK: torch.Tensor,
        sorted_rows: RowMap,
        counts_S: torch.Tensor,
        chunks: int,
    ) -> tuple[list[int], list[int], list[tuple[list[int], list[int]]] | None]:
        """Sync: (rows to each destination, rows from each source, and for the level below, per chunk,
        its rows by destination and by source), read on the host at once. The level below's are
        counted here, before any row travels: each row's destinations there travel with this level's
        counts, so that the chain between the levels (docs/dispatch.md) never waits on the host."""
        size, group = self.sizes[level], self.levels[level].group
        if level + 1 == len(self.levels):
            recv_counts_S = all_to_all_rows(counts_S, None, None, group, hand_over=False)
            send_S, recv_S = torch.stack([counts_S, recv_counts_S]).tolist()
            return send_S, recv_S, None
        below_size = self.sizes[level + 1]
        # Each row's destinations below: the next level's ranks holding any of its entries for this
        # row's destination (a row per (token, destination): its leader entry's row).
        dest_RK = torch.div(ids_RK, block, rounding_mode="floor")
        valid_RK = dest_RK < size
        local_RK = torch.where(
            valid_RK, torch.div(ids_RK % block, block // below_size, rounding_mode="floor"), below_size
        )
        hits_RKL = (local_RK.unsqueeze(2) == torch.arange(below_size, device=ids_RK.device)).float()
        same_RKK = (dest_RK.unsqueeze(2) == dest_RK.unsqueeze(1)).float()
        reach_NL = (torch.bmm(same_RKK, hits_RKL) > 0).flatten(0, 1).long()
        # The chunk each row travels in: chunk_major_order's rule on its place in its destination's run.
        leader_N = leader_RK.flatten()
        dest_N = dest_RK.flatten().clamp(max=size - 1)
        start_S = torch.cumsum(counts_S, dim=0) - counts_S
        within_N = sorted_rows.row_N - start_S.index_select(0, dest_N)
        chunk_N = torch.div(
            (within_N + 1) * chunks - 1, counts_S.index_select(0, dest_N).clamp(min=1), rounding_mode="floor"
        )
        segment_N = torch.where(leader_N, chunk_N * size + dest_N, chunks * size)
        reach_XL = torch.zeros(chunks * size + 1, below_size, dtype=torch.int64, device=ids_RK.device)
        reach_XL = reach_XL.index_add_(0, segment_N, reach_NL)[:-1]
        per_dest = reach_XL.view(chunks, size, below_size).transpose(0, 1).reshape(size, chunks * below_size)
        recv_SX = all_to_all_rows(
            torch.cat([counts_S.unsqueeze(1), per_dest], dim=1), None, None, group, hand_over=False
        )
        forward_CL = recv_SX[:, 1:].reshape(size, chunks, below_size).sum(dim=0)
        below_group = self.levels[level + 1].group
        arrive_LC = all_to_all_rows(forward_CL.t().contiguous(), None, None, below_group, hand_over=False)
        # The one host synchronisation of a layer's exchanges.
        flat = torch.cat([counts_S, recv_SX[:, 0], forward_CL.flatten(), arrive_LC.t().flatten()]).tolist()
        send_S, recv_S = flat[:size], flat[size : 2 * size]
        sends = flat[2 * size : 2 * size + chunks * below_size]
        arrives = flat[2 * size + chunks * below_size :]
        below = [
            (sends[k * below_size : (k + 1) * below_size], arrives[k * below_size : (k + 1) * below_size])
            for k in range(chunks)
        ]
        return send_S, recv_S, below

    def _hop(
        self, level, x_RD, ids_RK, w_RK, experts: GroupedExperts, shares, chunks, streams: ChainStreams, known=None
    ):
        """(rows_in, D) weighted sum of each input row's experts' outputs, and the assignments dropped.

        Between two levels nothing computes but the next level's plan: the exchanges form a chain
        (docs/dispatch.md) that hands over once per direction, and on a GPU its inside runs on the
        side stream (``streams.chain``), so that the other program's compute never queues behind it."""
        if level == len(self.levels):
            return _local_experts(x_RD, ids_RK, w_RK, experts, self.fused_kernels), torch.zeros(
                (), dtype=torch.int64, device=x_RD.device
            )
        group, fused = self.levels[level].group, self.fused_kernels
        last = level == len(self.levels) - 1
        # The dispatch's chain ends at the last level, the combine's at the first; the backward runs
        # each the other way round. The side buffer travels beside its rows: it never hands over.
        dispatch_hand_over, combine_hand_over = HandOver(last, level == 0), HandOver(level == 0, last)
        quiet = HandOver(False, False)
        block = self.levels[level].ranks_below * experts.num_experts
        plan = self.plan(level, ids_RK, block, shares, chunks, known)
        width_out = min(ids_RK.shape[1], block)
        sends = gather_tokens(x_RD, plan.rows, fused).split([sum(rows) for rows in plan.send_chunks])
        sides = _side_rows(plan.rows, ids_RK, w_RK, block, width_out).split([sum(r) for r in plan.send_chunks])
        # Equal splits (no-sync) travel as such.
        splits = (lambda rows: rows) if self.kind is DispatchKind.SYNC else (lambda rows: None)

        def start_dispatch(k: int):
            recv, send = splits(plan.recv_chunks[k]), splits(plan.send_chunks[k])
            return (
                start_all_to_all(sends[k], group, recv, send, dispatch_hand_over),
                start_all_to_all(sides[k], group, recv, send, quiet),
            )

        # The last level's experts run on the compute stream; the levels above it wait and plan on the chain's.
        region = streams.compute if last else streams.chain
        # Chunk k's outputs come back into its block of the chunk-major order: no final concatenation.
        returns = SlicedReceive([sum(rows) for rows in plan.send_chunks])
        pending, dropped = start_dispatch(0), plan.dropped
        for k in range(chunks):
            with region():
                wait_x, wait_side = pending
                recv_MD, side_MW = wait_x(), wait_side()
                if k + 1 < chunks:
                    pending = start_dispatch(k + 1)
                ids_MW = side_MW[:, width_out:].detach().round().to(torch.int64)
                below = None if plan.below is None else plan.below[k]
                y_MD, dropped_below = self._hop(
                    level + 1, recv_MD, ids_MW, side_MW[:, :width_out], experts, shares, 1, streams, below
                )
                dropped = dropped + dropped_below
                returns.start(y_MD, group, splits(plan.send_chunks[k]), splits(plan.recv_chunks[k]), combine_hand_over)
        y_SD = returns.wait()
        # Each destination's row already holds its experts' weighted sum: the rows add with weight 1.
        ones_RK = torch.ones(ids_RK.shape, dtype=y_SD.dtype, device=y_SD.device)
        return combine(y_SD, ones_RK, plan.rows, fused), dropped


def _side_rows(rows: RowMap, ids_RK: torch.Tensor, w_RK: torch.Tensor, block: int, width_out: int) -> torch.Tensor:
    """(send rows, 2 * width_out) fp32: each send row's router weights, then its expert ids relative to
    its destination (``block`` where unused), the destination's entries first in their column order."""
    width = ids_RK.shape[1]
    token_R = torch.div(rows.assignment_R, width, rounding_mode="floor")
    dest_RK = torch.div(ids_RK, block, rounding_mode="floor")
    dest_R = dest_RK.flatten().index_select(0, rows.assignment_R)
    on_RK = dest_RK.index_select(0, token_R) == dest_R.unsqueeze(1)
    if rows.filled_R is not None:
        on_RK = on_RK & rows.filled_R.unsqueeze(1)
    order_RW = torch.argsort((~on_RK).to(torch.int8), dim=1, stable=True)[:, :width_out]
    on_RW = on_RK.gather(1, order_RW)
    ids_RW = ids_RK.index_select(0, token_R).gather(1, order_RW) - dest_R.unsqueeze(1) * block
    ids_RW = torch.where(on_RW, ids_RW, block)
    w_RW = torch.where(on_RW, w_RK.index_select(0, token_R).gather(1, order_RW), 0)
    return torch.cat([w_RW.float(), ids_RW.float()], dim=1)


def _local_experts(
    x_RD: torch.Tensor, ids_RW: torch.Tensor, w_RW: torch.Tensor, experts: GroupedExperts, fused: bool
) -> torch.Tensor:
    """(R, D): row r's weighted sum over its entries j with ids_RW[r, j] < L of that local expert's
    output; ``fused``: the combine as the fused op."""
    num_local = experts.num_experts
    rows_in, width = ids_RW.shape
    plan = plan_routing(ids_RW, num_local + 1)
    groups = ExpertGroups.from_counts(plan.groups.counts_E[:num_local])
    # Unused entries (id L) sort last, past the last offset: padding rows, zero in and never read.
    filled_P = torch.arange(rows_in * width, device=ids_RW.device) < groups.offsets_E[-1]
    rows = RowMap(
        plan.rows.row_N, plan.rows.assignment_R, width, kept_N=ids_RW.flatten() < num_local, filled_R=filled_P
    )
    y_PD = experts(x_RD, groups, rows=rows)
    return combine(y_PD, w_RW, rows, fused)
