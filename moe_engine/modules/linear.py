"""The dense projections' linear layer: ``nn.Linear`` without bias whose weight gradient its GEMM adds into
the data-parallel gradient buffer (``main_grad``) in a plain backward, as the experts' do.

While the weight has no ``main_grad`` (no data-parallel optimizer with ``accumulate_in_gemm``, a bf16
buffer, FSDP) or under ``torch.compile`` (whose graphs could not ask at run time where a gradient goes),
it is ``F.linear`` with ordinary autograd: the reference path. With one, the backward splits in two
nodes (``moe_engine.weight_grad_split``): the main node computes dX, the weight node adds dW into
``main_grad`` through ``moe_engine::wgrad_accumulate`` (on CUDA cuBLAS sums in fp32 and adds once; on
the CPU it is the product in the weight's dtype, then the add, the two passes the ``.grad`` path makes),
or, under ``autograd.grad`` (a zero-bubble weight phase), hands dW back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine import kernels
from moe_engine.kernels import wgrad
from moe_engine.weight_grad_split import (
    WeightGradStash,
    input_grad_wanted,
    main_grad_to_add_into,
    split_token_grad,
)


class _LinearWeightGrad(torch.autograd.Function):
    """The weight node: input the weight, output an empty token the main node takes."""

    @staticmethod
    def forward(ctx, stash, weight_OI):
        ctx.stash = stash
        ctx.weight = weight_OI
        return weight_OI.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):
        grad_y_NO, x_NI = ctx.stash.take()
        # The weight is the node's one edge (the stash has none).
        main_grad_OI = main_grad_to_add_into(ctx.weight, ctx.next_functions[0][0])
        if main_grad_OI is None:
            return None, wgrad.weight_grad(grad_y_NO, x_NI)
        kernels.wgrad_accumulate(grad_y_NO, x_NI, main_grad_OI)
        return None, None


class _LinearInputGrad(torch.autograd.Function):
    """The main node: ``y = x W^T``; its backward computes dX and leaves dW's operands in the stash.
    The weight comes in detached: its gradient flows through the weight node's token."""

    @staticmethod
    def forward(ctx, x, weight_OI, stash, token):
        ctx.save_for_backward(x, weight_OI)
        ctx.stash = stash
        return F.linear(x, weight_OI)

    @staticmethod
    def backward(ctx, grad_y):
        # A weights-only pass re-entering this node (torch's zero-bubble weight phase) wants no dX and
        # sets the same operands again: nothing else here is worth skipping.
        stash = ctx.stash
        x, weight_OI = ctx.saved_tensors
        grad_y_NO = grad_y.reshape(-1, grad_y.shape[-1])
        if stash.wanted:
            x_NI = x.reshape(-1, x.shape[-1])
            stash.compute = lambda: (grad_y_NO, x_NI)
        grad_x = None
        if input_grad_wanted(ctx, 0):
            grad_x = grad_y_NO.mm(weight_OI).view(*grad_y.shape[:-1], weight_OI.shape[1])
        return grad_x, None, None, split_token_grad(ctx, grad_y, 3)


def linear_split(x: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight_OI)`` with its backward split in an input-gradient and a weight-gradient node."""
    stash = WeightGradStash(torch.is_grad_enabled() and weight_OI.requires_grad)
    token = _LinearWeightGrad.apply(stash, weight_OI) if stash.wanted else None
    return _LinearInputGrad.apply(x, weight_OI.detach(), stash, token)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose weight gradient goes into ``weight.main_grad`` inside its GEMM
    where the weight has one (see the module's docstring); same parameters and state dict."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kwargs):
        if bias:
            raise ValueError("moe_engine.modules.linear.Linear has no bias (none of the engine's projections do)")
        super().__init__(in_features, out_features, bias=False, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.weight, "main_grad", None) is None or torch.compiler.is_compiling():
            return F.linear(x, self.weight)
        return linear_split(x, self.weight)
