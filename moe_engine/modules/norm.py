"""RMSNorm."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the weight (as OLMoE does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
