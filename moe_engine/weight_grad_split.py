"""A layer's backward as two autograd nodes, input gradients (dX) and weight gradients (dW), and where
the weight gradient goes: handed back, or added by its GEMM into the data-parallel gradient buffer.

The layer's main node computes dX and leaves dW's operands in a ``WeightGradStash``; a weight node, whose
inputs are the weights and whose output is an empty token the main node takes as an input, computes dW
from them. A zero-bubble schedule's input phase (``stage_backward_input``) does not run the weight node;
its weight phase (``stage_backward_weight``) starts again at the nodes the input phase saved gradients
for (the main node, whose backward then hands over dW's operands) and runs it; a plain backward runs
both at once. The experts (``moe_engine.moe.experts``) and the dense projections
(``moe_engine.modules.linear``, whose node before torch's GEMM takes the token) split this way.

A weight that has a ``main_grad`` (its fp32 view in a data-parallel gradient buffer,
``moe_engine.parallel.data_parallel``; Megatron's name) gets its gradient added there by the GEMM when
the pass runs the weight's accumulator (a plain backward): the product is never written in the
weight's dtype, and no pass adds it to the buffer afterwards. Under ``autograd.grad`` the gradient is
handed back as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class WeightGradStash:
    """One call's weight-gradient operands, between its two backward nodes.

    The main node's backward (dX) leaves ``compute``, a closure that returns dW's operands (it may
    build one, as the MXFP8 experts dequantize x there); the weight node's backward runs it once and
    drops it.
    """

    __slots__ = ("compute", "wanted")

    def __init__(self, wanted: bool):
        self.wanted = wanted
        """Whether a weight gradient is wanted (some weight requires grad under grad mode)."""
        self.compute: Callable[[], Any] | None = None

    def take(self) -> Any:
        """The operands, computed once; raises when the main node has not run (or they were taken)."""
        compute, self.compute = self.compute, None
        if compute is None:
            raise RuntimeError("the weight gradients ran without their input-gradient pass, or twice")
        return compute()


def engine_accumulates(accumulator) -> bool:
    """Whether this backward pass runs ``accumulator`` (a leaf's): true in a plain backward; false
    under ``autograd.grad`` (the engine then hands the gradient back instead, and does not answer for
    a leaf), e.g. in torch's zero-bubble weight phase."""
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:
        return False


def main_grad_to_add_into(weight: torch.Tensor, accumulator) -> torch.Tensor | None:
    """``weight.main_grad`` where this pass's GEMM should add the weight's gradient into it (the
    weight has one, and the pass runs its ``accumulator``), else None: hand the gradient back.

    Returning no gradient, the weight node gives autograd no producer to order the weight's hook (the
    bucket's reduction) after: the order holds because the GEMM runs on the caller's stream."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and engine_accumulates(accumulator):
        return main_grad
    return None


def input_grad_wanted(ctx, index: int) -> bool:
    """Whether this backward pass wants the gradient of input ``index`` (``ctx.needs_input_grad`` says
    only whether it requires grad). ``stage_backward_weight`` re-enters the main node for the weights
    alone; the engine then does not execute x's producer. The engine does not answer for a leaf under
    ``autograd.grad``: wanted, to be safe."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    try:
        return node is None or bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


def weights_only_reentry(ctx, stash: WeightGradStash) -> bool:
    """True when ``stage_backward_weight`` re-enters the main node: dX ran in the input pass, the
    closure waits in the stash, and x's gradient is not wanted now."""
    return stash.compute is not None and not input_grad_wanted(ctx, 0)


def split_token_grad(ctx, like: torch.Tensor, index: int) -> torch.Tensor | None:
    """The gradient the main node hands its token input ``index``: an empty tensor that carries the
    backward on to the weight node."""
    return like.new_empty(0) if ctx.needs_input_grad[index] else None
