"""Dispatch and combine: move each routed token row to its expert, and the expert outputs back.
More: docs/dispatch.md.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_engine.config import DispatchKind
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import (
    ExpertGroups,
    RowMap,
    chunk_major_order,
    chunk_rows,
    combine,
    gather_tokens,
    plan_routing,
    plan_slots,
    reorder_rows,
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
    """Every expert on this device: gather rows in expert order, grouped GEMM, weighted combine; the
    combine as the fused op with ``fused_kernels``."""

    def __init__(self, fused_kernels: bool = False):
        self.fused_kernels = fused_kernels

    def __call__(self, x_TD, route, experts):
        plan = plan_routing(route.expert_TK, experts.num_experts)
        y_ND = experts(x_TD, plan.groups, rows=plan.rows)
        return combine(y_ND, route.weight_TK, plan.rows, self.fused_kernels), _no_drops(x_TD.device)


in_flight_hook: Callable[[], None] | None = None
"""Called while a row all-to-all is in flight, between its start and its wait: another microbatch's
compute runs there during an overlapped step (``moe_engine.parallel.overlap`` sets it); None: wait at once."""


@dataclass(frozen=True)
class HandOver:
    """Whether an exchange's wait hands over to the other program of an overlapped step
    (``in_flight_hook``), in each direction. A chain of exchanges with nothing to compute between
    them (the per-node dispatch's levels) hands over once, at its last exchange in that direction."""

    forward: bool = True
    """The forward's wait for the rows."""
    backward: bool = True
    """The backward's wait for the rows' gradients."""


def all_to_all_rows(
    x: torch.Tensor,
    recv_splits: list[int] | None,
    send_splits: list[int] | None,
    group,
    hand_over: bool = True,
) -> torch.Tensor:
    """``all_to_all_single`` of rows (equal splits when None); ``hand_over`` False: waited at once even
    in an overlapped step (routing counts: a few bytes the next op needs)."""
    rows = x.shape[0] if recv_splits is None else sum(recv_splits)
    out = x.new_empty(rows, *x.shape[1:])
    hook = in_flight_hook if hand_over else None
    if hook is None:
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out
    send = x.contiguous()  # held until the wait: the collective in flight reads it
    work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
    hook()
    work.wait()
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


class _InFlight:
    """One row all-to-all started asynchronously, and (in backward) its reverse."""

    def __init__(
        self, group, recv_splits: list[int] | None, send_splits: list[int] | None, hand_over: HandOver = HandOver()
    ):
        self.group, self.recv_splits, self.send_splits = group, recv_splits, send_splits
        self.hand_over = hand_over
        self.work: dist.Work | None = None
        self.buffers: tuple = ()
        """Tensors the collective in flight reads or writes: held until it is waited for."""

    def start(
        self, send_RD: torch.Tensor, recv_splits, send_splits, recv_RD: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Starts the exchange into ``recv_RD`` (a contiguous block of rows, e.g. a slice of a bigger
        buffer; None: a new one) and returns it."""
        send_RD = send_RD.contiguous()
        rows = send_RD.shape[0] if recv_splits is None else sum(recv_splits)
        if recv_RD is None:
            recv_RD = send_RD.new_empty(rows, *send_RD.shape[1:])
        elif recv_RD.shape != (rows, *send_RD.shape[1:]) or not recv_RD.is_contiguous():
            raise ValueError(f"row all-to-all: receive into {tuple(recv_RD.shape)}, want {rows} contiguous rows")
        self.work = dist.all_to_all_single(recv_RD, send_RD, recv_splits, send_splits, group=self.group, async_op=True)
        self.buffers = (send_RD, recv_RD)
        return recv_RD

    def wait(self, hand_over: bool) -> None:
        if self.work is None:
            raise RuntimeError("row all-to-all: wait() with none in flight (waited twice, or never started)")
        if hand_over and in_flight_hook is not None:
            in_flight_hook()
        self.work.wait()
        for buffer in self.buffers:
            if buffer.is_cuda:
                # Read on the stream that waited, which a chain's may not be the allocating one
                # (``moe_engine.moe.chain_streams``): not reused before that stream is done with it.
                buffer.record_stream(torch.cuda.current_stream(buffer.device))
        self.work, self.buffers = None, ()


class _StartAllToAll(torch.autograd.Function):
    """Starts the row all-to-all; returns its receive buffer, valid once ``_WaitAllToAll`` has run.
    Backward: waits for the gradients that ``_WaitAllToAll``'s backward started sending back."""

    @staticmethod
    def forward(ctx, send_RD, flight: _InFlight):
        ctx.flight = flight
        return flight.start(send_RD, flight.recv_splits, flight.send_splits)

    @staticmethod
    def backward(ctx, grad_recv_RD):
        # grad_recv_RD is what _WaitAllToAll's backward is sending; the sent rows' gradients are what
        # arrives, in the buffer it started receiving into: complete after the wait.
        flight = ctx.flight
        grad_send_RD = flight.buffers[1]
        flight.wait(flight.hand_over.backward)
        return grad_send_RD, None


class _WaitAllToAll(torch.autograd.Function):
    """Waits for the row all-to-all. Backward: starts sending the gradients back (async)."""

    @staticmethod
    def forward(ctx, recv_RD, flight: _InFlight):
        flight.wait(flight.hand_over.forward)
        ctx.flight = flight
        return recv_RD.view_as(recv_RD)

    @staticmethod
    def backward(ctx, grad_recv_RD):
        flight = ctx.flight
        flight.start(grad_recv_RD, flight.send_splits, flight.recv_splits)
        # Passed on to _StartAllToAll's backward, which waits and returns what arrived instead.
        return flight.buffers[0], None


def start_all_to_all(
    send_RD: torch.Tensor,
    group,
    recv_splits: list[int] | None = None,
    send_splits: list[int] | None = None,
    hand_over: HandOver = HandOver(),
) -> Callable[[], torch.Tensor]:
    """Differentiable ``all_to_all_single`` of rows, started now: returns the function that waits for
    it and gives the received rows. Its backward starts the gradients' exchange when they are ready
    and waits for it only where the sent rows' gradients are needed."""
    flight = _InFlight(group, recv_splits, send_splits, hand_over)
    recv_RD = _StartAllToAll.apply(send_RD, flight)
    return lambda: _WaitAllToAll.apply(recv_RD, flight)


class _StartInto(torch.autograd.Function):
    """Starts a row all-to-all that receives into a slice of ``SlicedReceive``'s buffer. Returns an
    empty tensor: the edge that takes the slice's gradient to the sent rows (the slice itself is no
    autograd output, so the exchanges writing the buffer's other slices cannot rewrite its history).
    Backward: waits for the gradients that ``_WaitInto``'s backward started sending back."""

    @staticmethod
    def forward(ctx, send_RD, flight: _InFlight, recv_RD):
        ctx.flight = flight
        flight.start(send_RD, flight.recv_splits, flight.send_splits, recv_RD)
        return send_RD.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight
        grad_send_RD = flight.buffers[1]
        flight.wait(flight.hand_over.backward)
        return grad_send_RD, None, None


class _WaitInto(torch.autograd.Function):
    """Waits for each exchange of a ``SlicedReceive`` in the order started; returns its buffer.
    Backward: starts sending each slice of the gradient back (async), the last exchange's first."""

    @staticmethod
    def forward(ctx, receive: SlicedReceive, *edges):
        for flight in receive.flights:
            flight.wait(flight.hand_over.forward)
        ctx.flights, ctx.rows = receive.flights, receive.rows
        out_RD, receive.out_RD = receive.out_RD, None
        return out_RD

    @staticmethod
    def backward(ctx, grad_out_RD):
        grads = grad_out_RD.split(ctx.rows)
        wanted = ctx.needs_input_grad[1:]
        for k in reversed(range(len(ctx.flights))):
            if wanted[k]:  # else no _StartInto backward would wait for it
                flight = ctx.flights[k]
                flight.start(grads[k], flight.send_splits, flight.recv_splits)
        # Placeholders: each _StartInto's backward waits and returns what arrived instead.
        return None, *(grad_out_RD.new_empty(0) if w else None for w in wanted)


class SlicedReceive:
    """Row all-to-alls whose receives fill consecutive row slices of one buffer, in the order started:
    the chunks of a chunked combine land where a concatenation of them would put them, and ``wait``
    gives the whole buffer without copying it. Differentiable like ``start_all_to_all``: the
    gradient is cut by the same slices and each slice travels back in its exchange's reverse."""

    def __init__(self, rows: list[int]):
        self.rows = list(rows)
        """Rows each exchange receives, in the order they start."""
        self.flights: list[_InFlight] = []
        self.edges: list[torch.Tensor] = []
        self.out_RD: torch.Tensor | None = None

    def start(
        self,
        send_RD: torch.Tensor,
        group,
        recv_splits: list[int] | None = None,
        send_splits: list[int] | None = None,
        hand_over: HandOver = HandOver(),
    ) -> None:
        """Starts the next exchange, receiving into its slice (the buffer takes the first one's dtype)."""
        k = len(self.flights)
        if k == len(self.rows):
            raise RuntimeError(f"sliced receive: {k} exchanges started already, all it has rows for")
        if self.out_RD is None:
            self.out_RD = send_RD.new_empty(sum(self.rows), *send_RD.shape[1:])
        begin = sum(self.rows[:k])
        flight = _InFlight(group, recv_splits, send_splits, hand_over)
        self.edges.append(_StartInto.apply(send_RD, flight, self.out_RD[begin : begin + self.rows[k]]))
        self.flights.append(flight)

    def wait(self) -> torch.Tensor:
        """The buffer, once every exchange has arrived."""
        if len(self.flights) != len(self.rows) or self.out_RD is None:
            raise RuntimeError(f"sliced receive: {len(self.flights)} of {len(self.rows)} exchanges started")
        return _WaitInto.apply(self, *self.edges)


def capacity(num_assignments: int, ep: int, capacity_factor: float) -> int:
    """Rows per destination rank: capacity_factor times the balanced load from one source."""
    # Rounded first so that e.g. 0.1 * 30 counts as 3, not 3.0000000000000004 -> 4.
    return math.ceil(round(capacity_factor * num_assignments / ep, 9))


def received_local_experts(recv_counts_SL: torch.Tensor, slot_capacity: int) -> torch.Tensor:
    """Local expert of each row of a (ep * C) receive buffer; padding rows get L, so they sort last."""
    ends_SL = torch.cumsum(recv_counts_SL, dim=1)
    within_SC = torch.arange(slot_capacity, device=ends_SL.device).expand(ends_SL.shape[0], -1).contiguous()
    return torch.searchsorted(ends_SL, within_SC, right=True).flatten()


def _received_local_experts_sync(recv_counts_SL: torch.Tensor, rows: int) -> torch.Tensor:
    """Local expert of each row received in a sync exchange (rows by source, then local expert)."""
    num_local = recv_counts_SL.shape[1]
    local_ids = torch.arange(num_local, device=recv_counts_SL.device).repeat(recv_counts_SL.shape[0])
    return torch.repeat_interleave(local_ids, recv_counts_SL.flatten(), output_size=rows)


def _expert_rows(local_M: torch.Tensor, num_local: int) -> torch.Tensor:
    """int64 rows of each local expert among ``local_M`` (padding rows, id L, not counted); on the device."""
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=local_M.device)
    return counts.scatter_add_(0, local_M, torch.ones_like(local_M))[:num_local]


def _run_received(
    recv_RD: torch.Tensor,
    local_R: torch.Tensor,
    counts_L: torch.Tensor,
    experts: GroupedExperts,
    padded: bool,
    fused: bool,
) -> torch.Tensor:
    """Expert outputs for received rows, in arrival order; padding rows (local id L) give zeros;
    ``fused``: the gather back to arrival order as the fused op."""
    sort = sort_permutation(local_R)
    groups = ExpertGroups.from_counts(counts_L)
    y_RD = experts(recv_RD, groups, rows=sort)
    back = sort.inverse()
    if padded:
        # Grouped GEMMs leave rows after the last offset uninitialised (possibly NaN). The fused gather
        # back to arrival order writes zeros there instead of reading them (filled_R) and sends them no
        # gradient (kept_N), in its one pass; the eager gather would add mask ops to a where pass.
        real_P = torch.arange(y_RD.shape[0], device=y_RD.device) < groups.offsets_E[-1]
        if fused:
            filled_R = real_P.index_select(0, back.assignment_R)
            back = RowMap(back.row_N, back.assignment_R, 1, kept_N=real_P, filled_R=filled_R)
        else:
            y_RD = torch.where(real_P.unsqueeze(1), y_RD, 0)
    return gather_tokens(y_RD, back, fused)


class AllToAllDispatcher(Dispatcher):
    """Expert parallelism over ``group``: tokens travel to the rank holding their expert and back.

    In the no-sync variant every rank of the group must pass the same number of tokens (the
    equal-split buffers are sized from it); the sync variant accepts any. Every rank of the group
    must use the same ``chunks`` (chunked exchanges: docs/dispatch.md). With ``fused_kernels`` the
    row gathers and the combine run as the fused ops.
    """

    def __init__(
        self,
        group,
        kind: DispatchKind = DispatchKind.NO_SYNC,
        capacity_factor: float = 1.25,
        chunks: int = 1,
        fused_kernels: bool = False,
    ):
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.group = group
        self.ep = dist.get_world_size(group)
        self.kind = DispatchKind(kind)
        self.capacity_factor = capacity_factor
        self.chunks = chunks
        self.fused_kernels = fused_kernels

    @property
    def chunks(self) -> int:
        """All-to-alls each direction of a layer's exchange is cut into (1: the whole buffer at once)."""
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"a2a_chunks must be an integer >= 1, got {chunks!r}")
        self._chunks = chunks

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

    # The two exchanges are methods so that a proxy rank (``bench.run.proxy.rank``) can stand in for its peers.
    def exchange_counts(self, send_counts_SL: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
        """(ep, L) rows each source sends this rank's local experts."""
        return all_to_all_rows(send_counts_SL, None, None, self.group, hand_over=False)

    def exchange_rows(
        self, send_RD: torch.Tensor, recv_splits: list[int] | None, send_splits: list[int] | None, combine: bool
    ) -> torch.Tensor:
        """Differentiable row all-to-all: tokens out to the experts, or (``combine``) outputs back."""
        return all_to_all(send_RD, self.group, recv_splits, send_splits)

    def _sync(self, x_TD, route, experts):
        ep, fused = self.ep, self.fused_kernels
        plan = plan_routing(route.expert_TK, ep * experts.num_experts)
        send_counts_SL = plan.groups.counts_E.view(ep, -1)
        recv_counts_SL = self.exchange_counts(send_counts_SL, route.expert_TK)
        # The one host synchronisation of this variant: both sides' split sizes.
        send_splits, recv_splits = torch.stack([send_counts_SL.sum(dim=1), recv_counts_SL.sum(dim=1)]).tolist()

        if self.chunks > 1:
            rows = reorder_rows(plan.rows, self._chunk_major(send_counts_SL.sum(dim=1), sum(send_splits)))
            local_M = _received_local_experts_sync(recv_counts_SL, sum(recv_splits))
            local_M = local_M.index_select(0, self._chunk_major(recv_counts_SL.sum(dim=1), sum(recv_splits)))
            y_ND = self._chunked(
                gather_tokens(x_TD, rows, fused),
                local_M,
                experts,
                chunk_rows(send_splits, self.chunks),
                chunk_rows(recv_splits, self.chunks),
                padded=False,
            )
            return combine(y_ND, route.weight_TK, rows, fused), _no_drops(x_TD.device)

        recv_MD = self.exchange_rows(gather_tokens(x_TD, plan.rows, fused), recv_splits, send_splits, combine=False)
        local_M = _received_local_experts_sync(recv_counts_SL, recv_MD.shape[0])
        y_MD = _run_received(recv_MD, local_M, recv_counts_SL.sum(dim=0), experts, False, fused)
        y_ND = self.exchange_rows(y_MD, send_splits, recv_splits, combine=True)
        return combine(y_ND, route.weight_TK, plan.rows, fused), _no_drops(x_TD.device)

    def _no_sync(self, x_TD, route, experts):
        ep, fused = self.ep, self.fused_kernels
        num_tokens, top_k = route.expert_TK.shape
        slot_capacity = capacity(num_tokens * top_k, ep, self.capacity_factor)
        plan = plan_routing(route.expert_TK, ep * experts.num_experts)
        slots = plan_slots(plan, ep, slot_capacity)
        recv_counts_SL = self.exchange_counts(slots.kept_E.view(ep, -1), route.expert_TK)

        if self.chunks > 1:
            slots_S = torch.full((ep,), slot_capacity, dtype=torch.int64, device=x_TD.device)
            order_R = self._chunk_major(slots_S, ep * slot_capacity)
            rows = reorder_rows(slots.rows, order_R)
            local_R = received_local_experts(recv_counts_SL, slot_capacity).index_select(0, order_R)
            pieces = chunk_rows([slot_capacity] * ep, self.chunks)
            y_RD = self._chunked(gather_tokens(x_TD, rows, fused), local_R, experts, pieces, pieces, padded=True)
            return combine(y_RD, route.weight_TK, rows, fused), slots.dropped

        # One gather from x_TD writes each kept assignment straight into its slot.
        recv_RD = self.exchange_rows(gather_tokens(x_TD, slots.rows, fused), None, None, combine=False)
        local_R = received_local_experts(recv_counts_SL, slot_capacity)
        y_RD = _run_received(recv_RD, local_R, recv_counts_SL.sum(dim=0), experts, True, fused)
        y_RD = self.exchange_rows(y_RD, None, None, combine=True)
        return combine(y_RD, route.weight_TK, slots.rows, fused), slots.dropped

    # ---- chunked exchanges (docs/dispatch.md) ----------------------------------------------------

    def _chunk_major(self, rows_S: torch.Tensor, total: int) -> torch.Tensor:
        return chunk_major_order(rows_S, total, self.chunks)

    def _overlaps(self) -> bool:
        """Whether chunks travel asynchronously: not where a subclass replaces the row exchange."""
        return type(self).exchange_rows is AllToAllDispatcher.exchange_rows

    def _start_rows(self, send_RD, recv_splits, send_splits) -> Callable[[], torch.Tensor]:
        if self._overlaps():
            return start_all_to_all(send_RD, self.group, recv_splits, send_splits)
        recv_RD = self.exchange_rows(send_RD, recv_splits, send_splits, combine=False)
        return lambda: recv_RD

    def _chunked(
        self,
        send_ND: torch.Tensor,
        local_M: torch.Tensor,
        experts: GroupedExperts,
        send_rows: list[list[int]],
        recv_rows: list[list[int]],
        padded: bool,
    ) -> torch.Tensor:
        """Expert outputs for the chunk-major send buffer ``send_ND``, back in its order.

        ``local_M``: the local expert of each received row, chunk-major (padding rows: L);
        ``send_rows`` / ``recv_rows`` [chunk][rank]: the rows of each chunk to and from each rank."""
        num_local = experts.num_experts
        sends = send_ND.split([sum(rows) for rows in send_rows])
        locals_ = local_M.split([sum(rows) for rows in recv_rows])
        # Equal splits (no-sync) travel as such: the same collective as an unchunked exchange's.
        splits = (lambda rows: None) if padded else (lambda rows: rows)

        def start_dispatch(k: int) -> Callable[[], torch.Tensor]:
            return self._start_rows(sends[k], splits(recv_rows[k]), splits(send_rows[k]))

        # Chunk k's outputs come back into its block of the chunk-major order: no final concatenation.
        returns = SlicedReceive([sum(rows) for rows in send_rows])
        replaced = []  # a replaced row exchange returns its own tensors, concatenated at the end
        pending = start_dispatch(0)
        for k in range(self.chunks):
            recv_MD = pending()
            if k + 1 < self.chunks:
                pending = start_dispatch(k + 1)
            counts_L = _expert_rows(locals_[k], num_local)
            y_MD = _run_received(recv_MD, locals_[k], counts_L, experts, padded, self.fused_kernels)
            if self._overlaps():
                returns.start(y_MD, self.group, splits(send_rows[k]), splits(recv_rows[k]))
            else:
                replaced.append(self.exchange_rows(y_MD, splits(send_rows[k]), splits(recv_rows[k]), combine=True))
        return returns.wait() if self._overlaps() else torch.cat(replaced)
