"""RMSNorm."""

import torch
from torch import nn

from moe_engine import kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the weight (as OLMoE does).

    With ``residual`` the norm follows a residual add: it returns (h, norm(h)) for h = residual + x.
    With ``fused_kernels`` (``ModelConfig.fused_kernels``, given at construction) both forms run as one fused op
    (``moe_engine.kernels.rms_norm``) forward and one backward.
    """

    def __init__(self, dim: int, eps: float, fused_kernels: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused_kernels:
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        h = residual + x
        return h, self._norm(h)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
