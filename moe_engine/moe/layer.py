"""The MoE feed-forward layer: route, dispatch, experts, combine (plus an optional shared expert).

Where the experts live is the dispatcher's business (``layer.dispatcher``): all on this device by
default, or a block of them per rank under expert parallelism, both chosen at construction by a
``DispatchSpec`` (``moe_engine.moe.dispatch_spec``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from moe_engine.config import MoEConfig
from moe_engine.modules.mlp import SwiGLU
from moe_engine.moe.dispatch import Dispatcher
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.router import Router


class _AttachLoss(torch.autograd.Function):
    """Returns x unchanged; in backward, feeds a gradient of 1 into ``loss`` (already scaled by the layer's
    ``loss_scale``).

    This adds the router's weighted loss to the training objective without threading it through
    every return value (pipeline stages pass only activations).
    """

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape = loss.shape
        ctx.loss_meta = (loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        dtype, device = ctx.loss_meta
        return grad_x, torch.ones(ctx.loss_shape, dtype=dtype, device=device)


class MoELayer(nn.Module):
    """Router, experts and dispatcher (plus an optional shared expert), each built with
    ``fused_kernels``; ``dispatch`` says which experts live here and which dispatcher reaches them
    (default: all of them, ``LocalDispatcher``)."""

    tokens_per_expert: torch.Tensor

    def __init__(
        self,
        d_model: int,
        config: MoEConfig,
        layer_idx: int = 0,
        fused_kernels: bool = False,
        dispatch: DispatchSpec | None = None,
    ):
        super().__init__()
        dispatch = DispatchSpec() if dispatch is None else dispatch
        self.config = config
        self.d_model = d_model
        self.fused_kernels = fused_kernels
        self.router = Router(d_model, config, layer_idx, fused_kernels)
        self.experts = GroupedExperts(
            d_model,
            config.expert_hidden,
            config.num_experts,
            config.backend,
            fused_kernels,
            held=dispatch.local_experts(config.num_experts),
            mxfp8_wgrad=config.mxfp8_wgrad,
        )
        self.shared_expert = (
            SwiGLU(d_model, config.shared_expert_hidden, fused_kernels) if config.shared_expert_hidden > 0 else None
        )
        # Assignments per expert since the last expert-bias update (device tensor, no sync).
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
        self.dispatcher: Dispatcher = dispatch.build(config, d_model, layer_idx, fused_kernels)
        # Statistics of the last forward, for logging (detached, on the device).
        self.last_router_loss: torch.Tensor | None = None
        # The router's per-expert counts of this rank's tokens (all E experts, wherever they live).
        self.last_counts_E: torch.Tensor | None = None
        # int64 scalar: assignments dropped for lack of capacity (always 0 on dropless paths).
        self.last_dropped: torch.Tensor | None = None
        # Weight of this forward's router loss in the objective: 1/m when the trainer averages m
        # microbatches by scaling each loss in backward (so gradients are final when a bucket fills).
        self.loss_scale = 1.0

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        route = self.router(x_TD)
        y_TD, dropped = self.dispatcher(x_TD, route, self.experts)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)

        with torch.no_grad():
            self.tokens_per_expert += route.counts_E
        self.last_router_loss = route.loss.detach()
        self.last_counts_E = route.counts_E
        self.last_dropped = dropped
        if torch.is_grad_enabled() and route.loss.requires_grad:
            loss = route.loss if self.loss_scale == 1.0 else route.loss * self.loss_scale
            y_TD = _AttachLoss.apply(y_TD, loss)
        return y_TD.view_as(x_BSD)

    def update_expert_bias(self) -> None:
        """Apply the aux-loss-free bias rule to the loads seen since the last call, then reset them."""
        self.router.update_expert_bias(self.tokens_per_expert)
        self.tokens_per_expert.zero_()


# What a forward of an MoE layer advances beyond its outputs, besides the routing streams.
_LAYER_STATS = ("last_router_loss", "last_counts_E", "last_dropped")


def routing_streams(layers: Sequence[MoELayer]) -> list[Router]:
    """Every router whose random stream a forward of ``layers`` draws from: their own, and those its
    dispatcher replays besides (a proxy rank's simulated peers)."""
    return [r for layer in layers for r in (layer.router, *layer.dispatcher.routing_streams())]


@contextlib.contextmanager
def forward_leaves_no_trace(layers: Sequence[MoELayer]) -> Iterator[None]:
    """Forwards of ``layers`` inside the block draw no routes and count no load, as far as anything
    after it can tell: the routing streams, the load counts (for the expert bias) and the last
    forward's statistics are put back on exit."""
    streams = routing_streams(layers)
    states = [router.routing_state() for router in streams]
    stats = [(layer.tokens_per_expert.clone(), [getattr(layer, a) for a in _LAYER_STATS]) for layer in layers]
    try:
        yield
    finally:
        for router, state in zip(streams, states):
            router.set_routing_state(state)
        with torch.no_grad():
            for layer, (counts, values) in zip(layers, stats):
                layer.tokens_per_expert.copy_(counts)
                for name, value in zip(_LAYER_STATS, values):
                    setattr(layer, name, value)
