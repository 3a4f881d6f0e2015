"""Causal self-attention with grouped-query heads, optional QK-norm and RoPE, through SDPA.

QK-norm normalises the whole query and key projections (OLMoE), or each head's query and key with
one weight of head_dim shared by the heads (``qk_norm_per_head``, Qwen3).
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine.config import ModelConfig
from moe_engine.modules.linear import Linear
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        head_dim = config.head_dim
        assert head_dim is not None  # ModelConfig resolves it for grouped-query attention
        self.head_dim = head_dim
        q_dim, kv_dim = config.n_heads * head_dim, config.n_kv_heads * head_dim
        self.q_proj = Linear(config.d_model, q_dim, bias=False)
        self.k_proj = Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = Linear(config.d_model, kv_dim, bias=False)
        self.o_proj = Linear(q_dim, config.d_model, bias=False)
        self.per_head_norm = config.qk_norm_per_head
        q_norm_dim, k_norm_dim = (head_dim, head_dim) if self.per_head_norm else (q_dim, kv_dim)
        self.q_norm = RMSNorm(q_norm_dim, config.norm_eps, config.fused_kernels) if config.qk_norm else None
        self.k_norm = RMSNorm(k_norm_dim, config.norm_eps, config.fused_kernels) if config.qk_norm else None

    def forward(self, x_BSD: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        batch, seq_len, _ = x_BSD.shape
        q, k, v = self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)
        # q_norm and k_norm exist together (qk_norm).
        if self.q_norm is not None and self.k_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BSHd = q.view(batch, seq_len, self.n_heads, self.head_dim)
        k_BSGd = k.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.per_head_norm:
            q_BSHd, k_BSGd = self.q_norm(q_BSHd), self.k_norm(k_BSGd)
        q_BHSd, k_BGSd = q_BSHd.transpose(1, 2), k_BSGd.transpose(1, 2)
        v_BGSd = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q_BHSd, k_BGSd = rope(q_BHSd, k_BGSd)
        o_BHSd = F.scaled_dot_product_attention(
            q_BHSd, k_BGSd, v_BGSd, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(batch, seq_len, -1))
