"""Routing metadata and the row movements of dispatch and combine, without host syncs.

The T*k assignments of a step are flattened (assignment n = t*k + j). A ``RowMap`` places them in
the R rows of a buffer and holds the map in both directions, so every movement of rows in forward
and backward is a gather (no scatter with duplicates):

- on one device the rows are the assignments stably sorted by expert (R = N, a permutation);
- in no-sync expert parallelism the rows are fixed-capacity slots per destination rank, where some
  rows hold no assignment and some assignments (over capacity) have no row.

Chunked exchanges (``chunk_major_order``) move a buffer's rows in chunks: each destination's run of
rows is cut into the same number of nearly equal pieces, and the buffer reordered so that chunk k,
every destination's k-th piece, is one contiguous block of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_engine import kernels
from moe_engine.moe.router import expert_counts


@dataclass
class RowMap:
    """Assignments <-> buffer rows, each direction as a gather index. Every tensor stays on the device."""

    row_N: torch.Tensor
    """int64 row holding each flattened assignment (any in-range row where the assignment is dropped)."""
    assignment_R: torch.Tensor
    """int64 flattened assignment held by each row (any in-range assignment where the row is empty)."""
    top_k: int
    """Assignments per token."""
    kept_N: torch.Tensor | None = None
    """bool, whether each assignment has a row; None when all have one."""
    filled_R: torch.Tensor | None = None
    """bool, whether each row holds an assignment; None when all do."""

    def inverse(self) -> RowMap:
        """The reverse movement of a permutation of single rows (top_k 1, nothing dropped or empty)."""
        assert self.top_k == 1 and self.kept_N is None and self.filled_R is None
        return RowMap(row_N=self.assignment_R, assignment_R=self.row_N, top_k=1)


@dataclass
class ExpertGroups:
    """Rows sorted by expert: all an expert backend needs to know about them."""

    counts_E: torch.Tensor
    """int64 rows each expert receives."""
    offsets_E: torch.Tensor
    """int32 cumulative row counts (end of each expert's rows), as grouped GEMMs take them. Rows
    after the last offset, if any, are padding that belongs to no expert."""

    @classmethod
    def from_counts(cls, counts_E: torch.Tensor) -> ExpertGroups:
        return cls(counts_E, torch.cumsum(counts_E, dim=0).to(torch.int32))


@dataclass
class RoutingPlan:
    """One device's assignments sorted by expert (stable, so in token order within an expert)."""

    rows: RowMap
    """row_N: expert-sorted position of each assignment; assignment_R: assignment at each position."""
    groups: ExpertGroups
    """Per-expert counts and offsets of the sorted rows."""


def sort_permutation(key_R: torch.Tensor) -> RowMap:
    """Rows stably sorted by ``key_R``, as a permutation of single rows."""
    order_R = torch.argsort(key_R, stable=True)
    inverse_R = torch.empty_like(order_R)
    inverse_R.scatter_(0, order_R, torch.arange(order_R.numel(), device=order_R.device))
    return RowMap(row_N=inverse_R, assignment_R=order_R, top_k=1)


def plan_routing(expert_TK: torch.Tensor, num_experts: int) -> RoutingPlan:
    flat_N = expert_TK.reshape(-1)
    sort = sort_permutation(flat_N)
    rows = RowMap(row_N=sort.row_N, assignment_R=sort.assignment_R, top_k=expert_TK.shape[1])
    return RoutingPlan(rows, ExpertGroups.from_counts(expert_counts(flat_N, num_experts)))


def _zero_where_not(mask: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the rows of a freshly gathered tensor where ``mask`` is false."""
    # A fill, not a multiply: masked rows may hold garbage (NaN) that must not leak.
    if mask is None:
        return rows
    return rows.masked_fill_(~mask.view(-1, *([1] * (rows.dim() - 1))), 0)


def _sum_token_copies(grad_ND: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k == 1:
        return grad_ND
    return grad_ND.view(-1, top_k, grad_ND.shape[-1]).sum(dim=1)


class _GatherRows(torch.autograd.Function):
    """rows_RD[r] = x_TD[assignment_R[r] // k] (zero where empty); backward sums a token's k rows."""

    @staticmethod
    def forward(ctx, x_TD, rows: RowMap):
        ctx.rows = rows
        token_R = rows.assignment_R
        if rows.top_k > 1:
            token_R = torch.div(token_R, rows.top_k, rounding_mode="floor")
        return _zero_where_not(rows.filled_R, x_TD.index_select(0, token_R))

    @staticmethod
    def backward(ctx, grad_RD):
        rows = ctx.rows
        grad_ND = _zero_where_not(rows.kept_N, grad_RD.index_select(0, rows.row_N))
        return _sum_token_copies(grad_ND, rows.top_k), None


class _Combine(torch.autograd.Function):
    """y_TD[t] = sum_j w_TK[t, j] * y_RD[row_N[t*k + j]] over the kept assignments."""

    @staticmethod
    def forward(ctx, y_RD, weight_TK, rows: RowMap):
        num_tokens, top_k = weight_TK.shape
        y_ND = _zero_where_not(rows.kept_N, y_RD.index_select(0, rows.row_N))
        y_TKD = y_ND.view(num_tokens, top_k, -1)
        w_T1K = weight_TK.to(y_RD.dtype).unsqueeze(1)
        ctx.save_for_backward(y_TKD, w_T1K)
        ctx.rows = rows
        ctx.weight_dtype = weight_TK.dtype
        return torch.bmm(w_T1K, y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, grad_TD):
        y_TKD, w_T1K = ctx.saved_tensors
        rows = ctx.rows
        grad_T1D = grad_TD.contiguous().unsqueeze(1)
        grad_weight_TK = None
        if ctx.needs_input_grad[1]:
            # Dropped rows of y_TKD are zero, so dropped weights get no gradient from here.
            grad_weight_TK = torch.bmm(grad_T1D, y_TKD.transpose(1, 2)).squeeze(1).to(ctx.weight_dtype)
        grad_y_RD = None
        if ctx.needs_input_grad[0]:
            grad_y_ND = torch.bmm(w_T1K.transpose(1, 2), grad_T1D).view(-1, grad_TD.shape[-1])
            grad_y_RD = _zero_where_not(rows.filled_R, grad_y_ND.index_select(0, rows.assignment_R))
        return grad_y_RD, grad_weight_TK, None


def gather_tokens(x_TD: torch.Tensor, rows: RowMap, fused: bool = False) -> torch.Tensor:
    """The (R, D) buffer: each row a copy of its assignment's token row, zero where empty. ``fused``:
    as one op forward and one backward (``moe_engine.kernels.gather_rows``)."""
    if fused:
        return kernels.gather_rows(x_TD, rows.assignment_R, rows.row_N, rows.top_k, rows.filled_R, rows.kept_N)
    return _GatherRows.apply(x_TD, rows)


def combine(y_RD: torch.Tensor, weight_TK: torch.Tensor, rows: RowMap, fused: bool = False) -> torch.Tensor:
    """Weighted sum of each token's kept expert outputs: (T, D) in the experts' dtype. ``fused``: as one
    op forward and one backward, keeping no (T, k, D) copy (``moe_engine.kernels.combine_rows``)."""
    if fused:
        return kernels.combine_rows(y_RD, weight_TK, rows.row_N, rows.assignment_R, rows.kept_N, rows.filled_R)
    return _Combine.apply(y_RD, weight_TK, rows)


@dataclass
class SlotPlan:
    """Assignments placed in fixed-capacity slots per destination rank, for no-sync expert parallelism."""

    rows: RowMap
    """Assignments <-> the (ranks * capacity) slots; slot s*C + c is the c-th row sent to rank s."""
    kept_E: torch.Tensor
    """int64 assignments of each (global) expert that got a slot."""
    dropped: torch.Tensor
    """int64 scalar: assignments that got no slot."""


def plan_slots(plan: RoutingPlan, num_ranks: int, capacity: int) -> SlotPlan:
    """Give each destination rank's assignments, in expert-sorted order, the first ``capacity`` slots.

    Experts are split into ``num_ranks`` contiguous blocks, so the expert-sorted order is also
    sorted by destination. Over capacity, a destination keeps its first ``capacity`` assignments in
    the order (expert, then flattened assignment index t*k + j) and drops the rest: the tail is the
    last tokens of its highest-numbered experts.

    ``plan`` may leave assignments to no destination: sorted after every destination's (a key past
    the last expert, not counted in ``plan.groups``), they get no slot and are not counted as dropped.
    """
    counts_SL = plan.groups.counts_E.view(num_ranks, -1)
    before_SL = torch.cumsum(counts_SL, dim=1) - counts_SL
    kept_SL = torch.minimum((capacity - before_SL).clamp(min=0), counts_SL)

    # Sorted position p: destination s, and position within the destination's assignments.
    sent_S = counts_SL.sum(dim=1)
    end_S = torch.cumsum(sent_S, dim=0)
    start_S = end_S - sent_S
    position_P = torch.arange(plan.rows.row_N.numel(), device=sent_S.device)
    # Positions past the last destination's (unrouted assignments) count as the last destination's
    # overflow: in range for every gather, never kept.
    dest_P = torch.searchsorted(end_S, position_P, right=True).clamp(max=num_ranks - 1)
    within_P = position_P - start_S.index_select(0, dest_P)
    slot_P = dest_P * capacity + within_P.clamp(max=capacity - 1)
    row_N = slot_P.index_select(0, plan.rows.row_N)
    kept_P = within_P < sent_S.clamp(max=capacity).index_select(0, dest_P)
    kept_N = kept_P.index_select(0, plan.rows.row_N)

    # Slot s*C + c holds the sorted position start_s + c, if destination s has that many.
    c_1C = torch.arange(capacity, device=sent_S.device).unsqueeze(0)
    filled_SC = c_1C < sent_S.unsqueeze(1)
    source_SC = (start_S.unsqueeze(1) + c_1C).clamp(max=max(position_P.numel() - 1, 0))
    assignment_R = plan.rows.assignment_R.index_select(0, source_SC.flatten())

    rows = RowMap(row_N, assignment_R, plan.rows.top_k, kept_N=kept_N, filled_R=filled_SC.flatten())
    return SlotPlan(rows, kept_SL.flatten(), (counts_SL - kept_SL).sum())


def chunk_bounds(rows: int, chunks: int) -> list[int]:
    """Where each of ``chunks`` nearly equal pieces of ``rows`` rows starts, and the end: piece k is
    rows [k * rows // chunks, (k + 1) * rows // chunks)."""
    return [k * rows // chunks for k in range(chunks + 1)]


def chunk_rows(rows_S: list[int], chunks: int) -> list[list[int]]:
    """[chunk][s]: the rows of each run of ``rows_S`` (one per destination or source) in each chunk."""
    bounds_S = [chunk_bounds(rows, chunks) for rows in rows_S]
    return [[bounds[k + 1] - bounds[k] for bounds in bounds_S] for k in range(chunks)]


def chunk_major_order(rows_S: torch.Tensor, total: int, chunks: int) -> torch.Tensor:
    """int64 order of a buffer's ``total`` rows, runs of ``rows_S`` rows one after the other, that
    puts chunk k (every run's piece k, ``chunk_bounds``) before chunk k + 1, each run's rows in
    order: the new row r holds the old row order[r]. On the device, no host sync."""
    position_R = torch.arange(total, device=rows_S.device)
    run_R = torch.repeat_interleave(torch.arange(rows_S.numel(), device=rows_S.device), rows_S, output_size=total)
    start_S = torch.cumsum(rows_S, dim=0) - rows_S
    within_R = position_R - start_S.index_select(0, run_R)
    size_R = rows_S.index_select(0, run_R)
    # Row w of a run of n rows lies in piece k = the largest k with k n // chunks <= w, i.e. k n < (w + 1) chunks.
    chunk_R = torch.div((within_R + 1) * chunks - 1, size_R, rounding_mode="floor")
    return torch.argsort(chunk_R * total + position_R)


def reorder_rows(rows: RowMap, order_R: torch.Tensor) -> RowMap:
    """The same assignments in a buffer whose new row r is the old row ``order_R[r]``."""
    new_row_R = torch.empty_like(order_R)
    new_row_R.scatter_(0, order_R, torch.arange(order_R.numel(), device=order_R.device))
    return RowMap(
        row_N=new_row_R.index_select(0, rows.row_N),
        assignment_R=rows.assignment_R.index_select(0, order_R),
        top_k=rows.top_k,
        kept_N=rows.kept_N,
        filled_R=None if rows.filled_R is None else rows.filled_R.index_select(0, order_R),
    )
