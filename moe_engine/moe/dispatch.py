"""Dispatch and combine: move each routed token row to its expert, and the expert outputs back.

``Dispatcher`` is the seam the MoE layer calls. ``LocalDispatcher`` runs every expert on this
device. ``AllToAllDispatcher`` is expert parallelism: rank i of an expert-parallel group of ep ranks
holds the global experts [i*L, (i+1)*L), L = E/ep (``Layout.local_experts``), so global expert e
lives on rank e // L as local expert e % L, and assignments sorted by global expert are also sorted
by destination rank. Two variants:

- ``sync``: per-(destination, local expert) counts are exchanged, the split sizes are read on the
  host and the token rows travel in an uneven all-to-all. Dropless.
- ``no-sync``: every rank sends each destination a fixed C = ceil(capacity_factor * T*k / ep) rows
  (``SlotPlan``: over capacity, the tail of the destination's expert-sorted assignments is dropped
  and counted). Counts and rows travel in equal-split all-to-alls; nothing reads device data on
  the host, in forward or backward.

A receiver gets rows ordered by source rank then local expert, sorts them (stably) by local
expert for the grouped GEMM and unsorts the outputs before they travel back.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from moe_engine.config import DispatchKind
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import (
    ExpertGroups,
    combine,
    gather_tokens,
    plan_routing,
    plan_slots,
    sort_permutation,
)
from moe_engine.moe.router import RouterOutput


class Dispatcher(ABC):
    """The seam: experts' outputs for routed tokens, wherever the experts live."""

    @abstractmethod
    def __call__(
        self, x_TD: torch.Tensor, route: RouterOutput, experts: GroupedExperts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, D) weighted sum of each token's expert outputs, and the int64 scalar count of
        assignments dropped for lack of capacity (a device tensor)."""

    def routing_streams(self) -> list:
        """Routers besides the layer's own whose random streams a forward draws from (a recompute
        replays them too)."""
        return []


def _no_drops(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


class LocalDispatcher(Dispatcher):
    """Every expert on this device: gather rows in expert order, grouped GEMM, weighted combine."""

    def __call__(self, x_TD, route, experts):
        plan = plan_routing(route.expert_TK, experts.num_experts)
        y_ND = experts(gather_tokens(x_TD, plan.rows), plan.groups)
        return combine(y_ND, route.weight_TK, plan.rows), _no_drops(x_TD.device)


def all_to_all_rows(x: torch.Tensor, recv_splits: list[int] | None, send_splits: list[int] | None, group) -> torch.Tensor:
    rows = x.shape[0] if recv_splits is None else sum(recv_splits)
    out = x.new_empty(rows, *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Row all-to-all (equal splits when None); backward sends gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, send_RD, recv_splits, send_splits, group):
        ctx.splits = (recv_splits, send_splits)
        ctx.group = group
        return all_to_all_rows(send_RD, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad_recv_RD):
        recv_splits, send_splits = ctx.splits
        return all_to_all_rows(grad_recv_RD, send_splits, recv_splits, ctx.group), None, None, None


def all_to_all(
    send_RD: torch.Tensor, group, recv_splits: list[int] | None = None, send_splits: list[int] | None = None
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of rows; splits None means equal splits."""
    return _AllToAll.apply(send_RD, recv_splits, send_splits, group)


def capacity(num_assignments: int, ep: int, capacity_factor: float) -> int:
    """Rows per destination rank: capacity_factor times the balanced load from one source."""
    # Rounded first so that e.g. 0.1 * 30 counts as 3, not 3.0000000000000004 -> 4.
    return math.ceil(round(capacity_factor * num_assignments / ep, 9))


def received_local_experts(recv_counts_SL: torch.Tensor, slot_capacity: int) -> torch.Tensor:
    """Local expert of each row of a (ep * C) receive buffer; padding rows get L, so they sort last."""
    ends_SL = torch.cumsum(recv_counts_SL, dim=1)
    within_SC = torch.arange(slot_capacity, device=ends_SL.device).expand(ends_SL.shape[0], -1).contiguous()
    return torch.searchsorted(ends_SL, within_SC, right=True).flatten()


def _run_received(
    recv_RD: torch.Tensor, local_R: torch.Tensor, counts_L: torch.Tensor, experts: GroupedExperts, padded: bool
) -> torch.Tensor:
    """Expert outputs for received rows, in arrival order; padding rows (local id L) give zeros."""
    sort = sort_permutation(local_R)
    groups = ExpertGroups.from_counts(counts_L)
    y_RD = experts(gather_tokens(recv_RD, sort), groups)
    if padded:
        # Grouped GEMMs leave rows after the last offset uninitialised (possibly NaN).
        real_R = torch.arange(y_RD.shape[0], device=y_RD.device) < groups.offsets_E[-1]
        y_RD = torch.where(real_R.unsqueeze(1), y_RD, 0)
    return gather_tokens(y_RD, sort.inverse())


class AllToAllDispatcher(Dispatcher):
    """Expert parallelism over ``group``: tokens travel to the rank holding their expert and back.

    In the no-sync variant every rank of the group must pass the same number of tokens (the
    equal-split buffers are sized from it); the sync variant accepts any.
    """

    def __init__(self, group, kind: DispatchKind = DispatchKind.NO_SYNC, capacity_factor: float = 1.25):
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.group = group
        self.ep = dist.get_world_size(group)
        self.kind = DispatchKind(kind)
        self.capacity_factor = capacity_factor

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copied model talks over the same group.
        return copy.copy(self)

    def __call__(self, x_TD, route, experts):
        if self.kind is DispatchKind.SYNC:
            return self._sync(x_TD, route, experts)
        return self._no_sync(x_TD, route, experts)

    def send_counts(self, expert_TK: torch.Tensor, num_local: int) -> torch.Tensor:
        """(ep, L) rows these routes send each destination's local experts (after capacity drops)."""
        plan = plan_routing(expert_TK, self.ep * num_local)
        if self.kind is DispatchKind.SYNC:
            return plan.groups.counts_E.view(self.ep, -1)
        slot_capacity = capacity(expert_TK.numel(), self.ep, self.capacity_factor)
        return plan_slots(plan, self.ep, slot_capacity).kept_E.view(self.ep, -1)

    # The two exchanges are methods so that a proxy rank (``moe_engine.proxy``) can stand in for its peers.
    def exchange_counts(self, send_counts_SL: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
        """(ep, L) rows each source sends this rank's local experts."""
        return all_to_all_rows(send_counts_SL, None, None, self.group)

    def exchange_rows(
        self, send_RD: torch.Tensor, recv_splits: list[int] | None, send_splits: list[int] | None, combine: bool
    ) -> torch.Tensor:
        """Differentiable row all-to-all: tokens out to the experts, or (``combine``) outputs back."""
        return all_to_all(send_RD, self.group, recv_splits, send_splits)

    def _sync(self, x_TD, route, experts):
        ep = self.ep
        plan = plan_routing(route.expert_TK, ep * experts.num_experts)
        send_counts_SL = plan.groups.counts_E.view(ep, -1)
        recv_counts_SL = self.exchange_counts(send_counts_SL, route.expert_TK)
        # The one host synchronisation of this variant: both sides' split sizes.
        send_splits, recv_splits = torch.stack([send_counts_SL.sum(dim=1), recv_counts_SL.sum(dim=1)]).tolist()

        recv_MD = self.exchange_rows(gather_tokens(x_TD, plan.rows), recv_splits, send_splits, combine=False)
        local_ids = torch.arange(experts.num_experts, device=x_TD.device).repeat(ep)
        local_M = torch.repeat_interleave(local_ids, recv_counts_SL.flatten(), output_size=recv_MD.shape[0])
        y_MD = _run_received(recv_MD, local_M, recv_counts_SL.sum(dim=0), experts, padded=False)
        y_ND = self.exchange_rows(y_MD, send_splits, recv_splits, combine=True)
        return combine(y_ND, route.weight_TK, plan.rows), _no_drops(x_TD.device)

    def _no_sync(self, x_TD, route, experts):
        ep = self.ep
        num_tokens, top_k = route.expert_TK.shape
        slot_capacity = capacity(num_tokens * top_k, ep, self.capacity_factor)
        plan = plan_routing(route.expert_TK, ep * experts.num_experts)
        slots = plan_slots(plan, ep, slot_capacity)
        recv_counts_SL = self.exchange_counts(slots.kept_E.view(ep, -1), route.expert_TK)

        # One gather from x_TD writes each kept assignment straight into its slot.
        recv_RD = self.exchange_rows(gather_tokens(x_TD, slots.rows), None, None, combine=False)
        local_R = received_local_experts(recv_counts_SL, slot_capacity)
        y_RD = _run_received(recv_RD, local_R, recv_counts_SL.sum(dim=0), experts, padded=True)
        y_RD = self.exchange_rows(y_RD, None, None, combine=True)
        return combine(y_RD, route.weight_TK, slots.rows), slots.dropped
