"""The MoE feed-forward layer: route, dispatch, experts, combine (plus an optional shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.config import MoEConfig
from moe_engine.modules.mlp import SwiGLU
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import combine, gather_tokens, plan_routing
from moe_engine.moe.router import Router


class _AttachLoss(torch.autograd.Function):
    """Returns x unchanged; in backward, feeds a gradient of 1 into ``loss``.

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
    def __init__(self, d_model: int, config: MoEConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.router = Router(d_model, config, layer_idx)
        self.experts = GroupedExperts(d_model, config.expert_hidden, config.num_experts, config.backend)
        self.shared_expert = (
            SwiGLU(d_model, config.shared_expert_hidden) if config.shared_expert_hidden > 0 else None
        )
        # Assignments per expert since the last expert-bias update (device tensor, no sync).
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
        # Statistics of the last forward, for logging (detached, on the device).
        self.last_router_loss: torch.Tensor | None = None
        self.last_counts_E: torch.Tensor | None = None

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        route = self.router(x_TD)
        plan = plan_routing(route.expert_TK, self.config.num_experts)
        y_ND = self.experts(gather_tokens(x_TD, plan), plan)
        y_TD = combine(y_ND, route.weight_TK, plan)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)

        with torch.no_grad():
            self.tokens_per_expert += route.counts_E
        self.last_router_loss = route.loss.detach()
        self.last_counts_E = route.counts_E
        if torch.is_grad_enabled() and route.loss.requires_grad:
            y_TD = _AttachLoss.apply(y_TD, route.loss)
        return y_TD.view_as(x_BSD)

    def update_expert_bias(self) -> None:
        """Apply the aux-loss-free bias rule to the loads seen since the last call, then reset them."""
        self.router.update_expert_bias(self.tokens_per_expert)
        self.tokens_per_expert.zero_()
