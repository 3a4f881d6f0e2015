"""Single-process training step: AdamW over fp32 master weights."""

from __future__ import annotations

import torch

from moe_engine.config import OptimizerConfig
from moe_engine.model import Transformer


def adamw_param_groups(params: list[torch.Tensor], config: OptimizerConfig) -> list[dict]:
    """AdamW parameter groups: weight decay on matrices only, never on norms or vectors."""
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_adamw(param_groups: list[dict], config: OptimizerConfig) -> torch.optim.AdamW:
    """torch's AdamW over ``param_groups`` in its foreach implementation (a few multi-tensor kernels per
    step) instead of the per-parameter loop torch picks by default on a CPU (on CUDA it picks foreach
    already). The foreach update is the loop's bit for bit; torch's fused one is not (on a CPU it
    differed from the loop in the last bit of some fp32 masters), so it is not used: the masters stay
    exactly today's (``tests/unit/moe_engine/parallel/test_adamw.py``)."""
    return torch.optim.AdamW(param_groups, lr=config.lr, betas=config.betas, eps=config.eps, foreach=True)


class MasterWeightAdamW:
    """AdamW that keeps an fp32 master copy of every low-precision parameter.

    fp32 parameters are their own master. After each step the masters are copied (rounded) into
    the model's parameters, so the model computes in its own dtype while updates accumulate in fp32.
    """

    def __init__(self, params, config: OptimizerConfig):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.params]
        self.inner = build_adamw(adamw_param_groups(self.masters, config), config)
        self._low_precision = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]

    @torch.no_grad()
    def step(self) -> None:
        for param, master in self._low_precision:
            master.grad = None if param.grad is None else param.grad.float()
        self.inner.step()
        if self._low_precision:
            params, masters = zip(*self._low_precision)
            torch._foreach_copy_(list(params), list(masters))

    def zero_grad(self) -> None:
        for param, master in zip(self.params, self.masters):
            param.grad = None
            master.grad = None

    def state_bytes(self) -> int:
        """Bytes held by the optimizer: fp32 masters of low-precision parameters and Adam moments."""
        masters = sum(m.numel() * m.element_size() for m, p in zip(self.masters, self.params) if m is not p)
        moments = sum(
            t.numel() * t.element_size()
            for state in self.inner.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.ndim > 0
        )
        return masters + moments


class Trainer:
    """Forward, backward, optimizer step and expert-bias update for one batch."""

    def __init__(self, model: Transformer, config: OptimizerConfig | None = None):
        self.model = model
        self.config = config or OptimizerConfig()
        self.optimizer = MasterWeightAdamW(model.parameters(), self.config)
        self.last_grad_norm: torch.Tensor | None = None

    def step(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """One training step; returns the (detached, on-device) cross-entropy loss."""
        self.optimizer.zero_grad()
        loss = self.model.loss(tokens_BS, labels_BS)
        loss.backward()
        if self.config.max_grad_norm > 0:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        for layer in self.model.moe_layers():
            layer.update_expert_bias()
        return loss.detach()
