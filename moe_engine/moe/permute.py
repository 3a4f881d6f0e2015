"""Routing metadata and the dispatch/combine permutations of one device, without host syncs.

The T*k assignments of a step are flattened (assignment n = t*k + j) and stably sorted by expert.
``order_N[i]`` is the assignment at expert-sorted position i and ``inverse_N`` its inverse, so
every movement of rows in forward and backward is a gather: no scatter with duplicates, no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_engine.moe.router import expert_counts


@dataclass
class RoutingPlan:
    """Where each assignment sits in expert order. Every tensor stays on the device."""

    order_N: torch.Tensor
    """int64 flattened assignment index at each expert-sorted position."""
    inverse_N: torch.Tensor
    """int64 expert-sorted position of each flattened assignment."""
    counts_E: torch.Tensor
    """int64 rows each expert receives."""
    offsets_E: torch.Tensor
    """int32 cumulative row counts (end of each expert's rows), as grouped GEMMs take them."""
    top_k: int
    """Assignments per token."""


def plan_routing(expert_TK: torch.Tensor, num_experts: int) -> RoutingPlan:
    flat_N = expert_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    inverse_N = torch.empty_like(order_N)
    inverse_N.scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
    counts_E = expert_counts(flat_N, num_experts)
    offsets_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
    return RoutingPlan(order_N, inverse_N, counts_E, offsets_E, expert_TK.shape[1])


class _GatherTokens(torch.autograd.Function):
    """x_ND[i] = x_TD[order_N[i] // k]; backward gathers back and sums a token's k copies."""

    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_N, top_k):
        ctx.save_for_backward(inverse_N)
        ctx.top_k = top_k
        return x_TD.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_ND):
        (inverse_N,) = ctx.saved_tensors
        grad_NkD = grad_ND.index_select(0, inverse_N)
        grad_TD = grad_NkD.view(-1, ctx.top_k, grad_ND.shape[-1]).sum(dim=1)
        return grad_TD, None, None, None


class _Combine(torch.autograd.Function):
    """y_TD[t] = sum_j w_TK[t, j] * y_ND[inverse_N[t*k + j]]."""

    @staticmethod
    def forward(ctx, y_ND, weight_TK, order_N, inverse_N):
        num_tokens, top_k = weight_TK.shape
        y_TKD = y_ND.index_select(0, inverse_N).view(num_tokens, top_k, -1)
        w_T1K = weight_TK.to(y_ND.dtype).unsqueeze(1)
        ctx.save_for_backward(y_TKD, w_T1K, order_N)
        ctx.weight_dtype = weight_TK.dtype
        return torch.bmm(w_T1K, y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, grad_TD):
        y_TKD, w_T1K, order_N = ctx.saved_tensors
        grad_T1D = grad_TD.contiguous().unsqueeze(1)
        grad_weight_TK = None
        if ctx.needs_input_grad[1]:
            grad_weight_TK = torch.bmm(grad_T1D, y_TKD.transpose(1, 2)).squeeze(1).to(ctx.weight_dtype)
        grad_y_ND = None
        if ctx.needs_input_grad[0]:
            grad_y_TKD = torch.bmm(w_T1K.transpose(1, 2), grad_T1D)
            grad_y_ND = grad_y_TKD.view(-1, grad_TD.shape[-1]).index_select(0, order_N)
        return grad_y_ND, grad_weight_TK, None, None


def gather_tokens(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Token rows in expert order, one row per assignment: (T*k, D)."""
    return _GatherTokens.apply(x_TD, plan.order_N, plan.inverse_N, plan.top_k)


def combine(y_ND: torch.Tensor, weight_TK: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs: (T, D) in the experts' dtype."""
    return _Combine.apply(y_ND, weight_TK, plan.order_N, plan.inverse_N)
