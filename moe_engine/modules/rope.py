"""Rotary position embedding in the rotate-half convention (GPT-NeoX, Llama, OLMoE)."""

import torch
from torch import nn

from moe_engine import kernels


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_len), built in fp32 and cast at use. With ``fused_kernels``
    (``ModelConfig.fused_kernels``, given at construction) each of q and k is rotated by one fused op
    (``moe_engine.kernels.rope``) that reads the fp32 tables directly."""

    cos_SH: torch.Tensor
    sin_SH: torch.Tensor

    def __init__(self, head_dim: int, max_len: int, theta: float, fused_kernels: bool = False):
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        self.register_buffer("cos_SH", torch.empty(max_len, head_dim), persistent=False)
        self.register_buffer("sin_SH", torch.empty(max_len, head_dim), persistent=False)
        self.reset_tables()
        self.fused_kernels = fused_kernels

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)compute the tables in place, on whatever device the buffers live (after ``to_empty``)."""
        device = self.cos_SH.device
        if device.type == "meta":
            return
        exponent_d = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inv_freq_d = 1.0 / self.theta**exponent_d
        angles_Sd = torch.outer(torch.arange(self.max_len, dtype=torch.float32, device=device), inv_freq_d)
        angles_SH = torch.cat([angles_Sd, angles_Sd], dim=-1)
        self.cos_SH.copy_(angles_SH.cos())
        self.sin_SH.copy_(angles_SH.sin())

    def forward(self, q_BHSd: torch.Tensor, k_BHSd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kernels:
            return kernels.rope(q_BHSd, self.cos_SH, self.sin_SH), kernels.rope(k_BHSd, self.cos_SH, self.sin_SH)
        seq_len = q_BHSd.shape[-2]
        cos = self.cos_SH[:seq_len].to(q_BHSd.dtype)
        sin = self.sin_SH[:seq_len].to(q_BHSd.dtype)
        return q_BHSd * cos + _rotate_half(q_BHSd) * sin, k_BHSd * cos + _rotate_half(k_BHSd) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
