"""The dense projections' linear layer: ``nn.Linear`` without bias whose weight gradient its GEMM adds into
the data-parallel gradient buffer (``main_grad``) in a plain backward, as the experts' do.

While the weight has no ``main_grad`` (no data-parallel optimizer with ``accumulate_in_gemm``, a bf16
buffer, FSDP) or under ``torch.compile`` (whose graphs could not ask at run time where a gradient goes),
it is ``F.linear`` with ordinary autograd: the reference path. With one, the layer is torch's own GEMM,
``F.linear(x, W.detach())``, whose backward computes dX, and two nodes and a hook around it:

- before it, ``_KeepInput`` saves x and takes the weight node's token (``moe_engine.weight_grad_split``);
- a hook on its output keeps dY for the weight node;
- the weight node adds dY^T x into ``main_grad`` through ``moe_engine::wgrad_accumulate`` (on CUDA cuBLAS
  sums in fp32 and adds once; on the CPU the product in the weight's dtype, then the add: the two passes
  the ``.grad`` path makes), or, under ``autograd.grad`` (a zero-bubble weight phase), hands dW back.

x is saved before the GEMM runs, as torch's own linear saves it: a checkpointed region's recompute stops
there (its early stop) instead of running the GEMM again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine import kernels
from moe_engine.kernels import wgrad
from moe_engine.weight_grad_split import WeightGradStash, main_grad_to_add_into, split_token_grad


class _LinearStash(WeightGradStash):
    """The weight-gradient stash, and dY between the output's hook and ``_KeepInput``."""

    __slots__ = ("grad_y",)

    def __init__(self, wanted: bool):
        super().__init__(wanted)
        self.grad_y: torch.Tensor | None = None

    def keep_grad_y(self, grad_y: torch.Tensor) -> None:
        """The GEMM output's gradient hook."""
        self.grad_y = grad_y


class _LinearWeightGrad(torch.autograd.Function):
    """The weight node: input the weight, output an empty token ``_KeepInput`` takes."""

    @staticmethod
    def forward(ctx, stash, weight_OI):
        ctx.stash = stash
        ctx.weight = weight_OI
        return weight_OI.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):
        grad_y, x = ctx.stash.take()
        # The weight is the node's one edge (the stash has none).
        main_grad_OI = main_grad_to_add_into(ctx.weight, ctx.next_functions[0][0])
        if main_grad_OI is None:
            return None, wgrad.weight_grad(grad_y, x)
        kernels.wgrad_accumulate(grad_y, x, main_grad_OI)
        return None, None


class _KeepInput(torch.autograd.Function):
    """x unchanged; saves x for the weight node and, in backward, hands it dY and x when this pass runs it."""

    @staticmethod
    def forward(ctx, x, stash, token):
        ctx.save_for_backward(x)
        ctx.stash = stash
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        stash = ctx.stash
        token_grad = split_token_grad(ctx, grad_x, 2)
        # The token's producer (the weight node) is an edge of its own: the pass runs it or not (a
        # zero-bubble input phase does not; its weight phase comes back here for it).
        weight_node = ctx.next_functions[1][0]
        if token_grad is not None and torch._C._will_engine_execute_node(weight_node):
            (x,) = ctx.saved_tensors
            grad_y = stash.grad_y
            assert grad_y is not None  # the output's hook ran first: this node's output is the GEMM's input
            # (..., O) and (..., I): the op flattens the leading dims itself.
            stash.compute = lambda: (grad_y, x)
            stash.grad_y = None
        return grad_x, None, token_grad


def linear_split(x: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight_OI)`` with its weight gradient in a node of its own (see the module's docstring)."""
    if not (torch.is_grad_enabled() and weight_OI.requires_grad):
        return F.linear(x, weight_OI)
    stash = _LinearStash(True)
    token = _LinearWeightGrad.apply(stash, weight_OI)
    y = F.linear(_KeepInput.apply(x, stash, token), weight_OI.detach())
    # A hook, not a node after the GEMM: y stays torch's own output (a pipeline stage detaches its
    # outputs in place, which a custom node's output, a view, would refuse).
    y.register_hook(stash.keep_grad_y)
    return y


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
