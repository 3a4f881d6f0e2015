"""What every expert backend builds on: the seam (``ExpertBackend``), the per-expert loop that is the
reference, SwiGLU and its backward, and the experts' weight gradients (bf16, or MXFP8 operands) with the
weight-gradient node of the split backward (``moe_engine.weight_grad_split`` explains the split; ``docs/engine.md`` how
the zero-bubble schedules use it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_engine import kernels
from moe_engine.moe.grouped_gemm import check_operand, grouped_mm, zero_empty_experts_
from moe_engine.moe.permute import ExpertGroups, RowMap, gather_tokens
from moe_engine.precision.mxfp8 import wgrad as mx_wgrad
from moe_engine.precision.mxfp8.token_blocks import quantize_token_blocks
from moe_engine.weight_grad_split import WeightGradStash, main_grad_to_add_into


class ExpertBackend(ABC):
    """The seam: compute the experts' SwiGLU for rows already sorted by expert."""

    def __init__(self, fused_swiglu: bool = False):
        self.fused_swiglu = fused_swiglu
        """Run the activation as the fused op (backends built on ``swiglu``/``swiglu_backward`` honour it)."""

    @abstractmethod
    def forward(
        self,
        x_ND: torch.Tensor,
        groups: ExpertGroups,
        gate_up_EHD: torch.Tensor,
        down_EDF: torch.Tensor,
    ) -> torch.Tensor:
        """(N, D) expert outputs for the (N, D) rows, row i by the expert that owns it."""

    def forward_gathered(
        self,
        x_TD: torch.Tensor,
        rows: RowMap,
        groups: ExpertGroups,
        gate_up_EHD: torch.Tensor,
        down_EDF: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` of the rows ``gather_tokens(x_TD, rows)`` places in expert order. A backend that
        can read its first operand straight from the token rows overrides it."""
        return self.forward(gather_tokens(x_TD, rows, self.fused_swiglu), groups, gate_up_EHD, down_EDF)


class LoopBackend(ExpertBackend):
    """Per-expert matmuls with ordinary autograd: the reference. Reads counts on the host; padding
    rows after the last expert's get zero outputs."""

    def forward(self, x_ND, groups, gate_up_EHD, down_EDF):
        counts = groups.counts_E.tolist()
        *per_expert, padding = torch.split(x_ND, counts + [x_ND.shape[0] - sum(counts)])
        outputs = []
        for e, x_expert in enumerate(per_expert):
            gate, up = F.linear(x_expert, gate_up_EHD[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down_EDF[e]))
        outputs.append(padding.new_zeros(padding.shape[0], down_EDF.shape[1]))
        return torch.cat(outputs)


def swiglu(h_NH: torch.Tensor, fused: bool = False) -> torch.Tensor:
    if fused:
        return kernels.swiglu_packed(h_NH)
    gate_NF, up_NF = h_NH.chunk(2, dim=-1)
    return F.silu(gate_NF) * up_NF


def swiglu_backward(
    h_NH: torch.Tensor, grad_a_NF: torch.Tensor, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recomputes a = silu(gate) * up and returns (a, d/dh), each written once, no concatenation."""
    if fused:
        return kernels.swiglu_packed_backward(h_NH, grad_a_NF)
    gate_NF, up_NF = h_NH.chunk(2, dim=-1)
    silu_NF = F.silu(gate_NF)
    grad_h_NH = torch.empty_like(h_NH)
    grad_gate_NF, grad_up_NF = grad_h_NH.chunk(2, dim=-1)
    torch.mul(grad_a_NF, silu_NF, out=grad_up_NF)
    grad_gate_NF.copy_(torch.ops.aten.silu_backward(grad_a_NF * up_NF, gate_NF))
    return silu_NF.mul_(up_NF), grad_h_NH


class WeightGradOperands(NamedTuple):
    """What one expert call's weight gradients are products of: per expert e and weight,
    ``dW[e] = grad_out[rows of e].T @ inputs[rows of e]``."""

    offsets_E: torch.Tensor
    """Cumulative row ends of the experts (int32, on the device)."""
    gate_up: tuple[torch.Tensor, torch.Tensor]
    """(grad_h_NH, x_ND): gate_up's gradient is grad_h^T x per expert."""
    down: tuple[torch.Tensor, torch.Tensor]
    """(grad_y_ND, a_NF): down's gradient is grad_y^T a per expert."""
    mxfp8: bool = False
    """The products in MXFP8: each weight's two operands quantized along each expert's tokens first."""


def expert_weight_grad(
    weight: torch.Tensor,
    accumulator,
    operands: tuple[torch.Tensor, torch.Tensor],
    offsets_E: torch.Tensor,
    mxfp8: bool = False,
) -> torch.Tensor | None:
    """The gradient of ``weight`` (E, X, Y) from its operands (grad_out_NX, inputs_NY), or None where
    it was added inside the GEMM: when the weight has a ``main_grad`` (its view in a data-parallel
    gradient buffer, ``moe_engine.parallel.data_parallel``) and this pass runs the weight's
    ``accumulator`` (a plain backward), the product is added straight into it and the pass between a
    bf16 gradient and the fp32 buffer disappears. Under ``autograd.grad`` the gradient is returned.
    ``mxfp8``: the operands are quantized in blocks of 32 of each expert's tokens and multiplied in
    MXFP8 (``moe_engine.precision.mxfp8.wgrad``), one weight's at a time."""
    grad_out_NX, inputs_NY = operands
    main_grad = main_grad_to_add_into(weight, accumulator)
    if mxfp8:
        blocked_NX, blocked_NY = (quantize_token_blocks(t, offsets_E) for t in operands)
        return mx_wgrad.grouped_wgrad(blocked_NX, blocked_NY, main_grad, out_dtype=weight.dtype)
    if main_grad is not None:
        # The operands torch's grouped GEMM would get, checked on every device as ``grouped_mm`` does
        # (the op falls back to it where its kernel cannot run).
        check_operand("a", grad_out_NX.t())
        check_operand("b", inputs_NY)
        kernels.grouped_wgrad_accumulate(grad_out_NX, inputs_NY, offsets_E, main_grad)
        return None
    return zero_empty_experts_(grouped_mm(grad_out_NX.t(), inputs_NY, offsets_E), offsets_E)


class _ExpertWeightGrads(torch.autograd.Function):
    """The weight node: its inputs are the experts' weights, its output an empty token that the main
    node takes as an input, so autograd's graph carries dW as a node of its own. A backward that only
    wants the inputs' gradients (``stage_backward_input`` of the zero-bubble schedules) never reaches
    it; ``stage_backward_weight`` and a plain backward do."""

    @staticmethod
    def forward(ctx, stash, gate_up_EHD, down_EDF):
        ctx.stash = stash
        ctx.weights = (gate_up_EHD, down_EDF)
        return gate_up_EHD.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):
        operands = ctx.stash.take()
        # Inputs 1 and 2 are the weights, the first two of the node's edges (the stash has none).
        edges = ctx.next_functions
        grads = [
            expert_weight_grad(weight, edges[i][0], pair, operands.offsets_E, operands.mxfp8)
            if ctx.needs_input_grad[i + 1]
            else None
            for i, (weight, pair) in enumerate(zip(ctx.weights, (operands.gate_up, operands.down)))
        ]
        return None, *grads


class DeferredWeightGrads:
    """The experts' weight gradients of the calls made inside ``defer_weight_grads()``: backward
    computes their input gradients only, ``run_all()`` their weight gradients."""

    def __init__(self) -> None:
        self._calls: list[tuple[WeightGradStash, torch.Tensor]] = []

    @property
    def pending(self) -> int:
        """Expert calls whose weight gradients have not run yet."""
        return len(self._calls)

    def add(self, stash: WeightGradStash, token: torch.Tensor) -> None:
        self._calls.append((stash, token))

    def run_all(self) -> None:
        """Compute every queued weight gradient once, in queue order, and accumulate it into the
        weights' ``.grad`` through autograd (post-accumulate-grad hooks fire as in a backward).
        Raises if a queued call's backward has not run yet."""
        calls, self._calls = self._calls, []
        if any(stash.compute is None for stash, _ in calls):
            self._calls = calls
            raise RuntimeError("run_all() before the backward of every deferred experts call")
        with torch.enable_grad():
            for _, token in calls:
                torch.autograd.backward(token, token.new_empty(0))


_deferrals: list[DeferredWeightGrads] = []


@contextmanager
def defer_weight_grads() -> Iterator[DeferredWeightGrads]:
    """Defer the experts' weight gradients of the forwards run inside: their backward (inside or
    after) computes dX only; ``run_all()`` computes dW. Only the grouped backends split; the loop
    backend (the reference) and every other parameter get their gradients during backward."""
    deferred = DeferredWeightGrads()
    _deferrals.append(deferred)
    try:
        yield deferred
    finally:
        _deferrals.remove(deferred)


def split_weights(
    x: torch.Tensor, gate_up_EHD: torch.Tensor, down_EDF: torch.Tensor
) -> tuple[WeightGradStash, torch.Tensor | None]:
    """The stash and the weight node's token for one expert call (no token where no weight gradient
    is wanted). Under ``defer_weight_grads()`` the token is queued there instead of given to the main
    node, unless x does not require grad (the output would then carry no graph)."""
    stash = WeightGradStash(torch.is_grad_enabled() and (gate_up_EHD.requires_grad or down_EDF.requires_grad))
    if not stash.wanted:
        return stash, None
    token = _ExpertWeightGrads.apply(stash, gate_up_EHD, down_EDF)
    if _deferrals and x.requires_grad:
        _deferrals[-1].add(stash, token)
        return stash, None
    return stash, token
