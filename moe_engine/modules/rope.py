"""Rotary position embedding in the rotate-half convention (GPT-NeoX, Llama, OLMoE)."""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_len), built in fp32 and cast at use."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq_d = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles_Sd = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq_d)
        angles_SH = torch.cat([angles_Sd, angles_Sd], dim=-1)
        self.register_buffer("cos_SH", angles_SH.cos(), persistent=False)
        self.register_buffer("sin_SH", angles_SH.sin(), persistent=False)

    def forward(self, q_BHSd: torch.Tensor, k_BHSd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = q_BHSd.shape[-2]
        cos = self.cos_SH[:seq_len].to(q_BHSd.dtype)
        sin = self.sin_SH[:seq_len].to(q_BHSd.dtype)
        return q_BHSd * cos + _rotate_half(q_BHSd) * sin, k_BHSd * cos + _rotate_half(k_BHSd) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
