"""Dense SwiGLU feed-forward (leading dense layers and the shared expert)."""

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine import kernels
from moe_engine.modules.linear import Linear


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); with ``fused_kernels`` (``ModelConfig.fused_kernels``, given at construction) the
    activation is one fused op (``moe_engine.kernels.swiglu``) that keeps only gate(x) and up(x)."""

    def __init__(self, d_model: int, hidden: int, fused_kernels: bool = False):
        super().__init__()
        self.gate_proj = Linear(d_model, hidden, bias=False)
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
