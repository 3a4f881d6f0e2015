"""Multi-head latent attention (DeepSeek-V2/V3), causal, through SDPA.
More: docs/architectures.md.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine.config import ModelConfig
from moe_engine.modules.linear import Linear
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        mla = config.mla
        assert mla is not None  # the model builds this attention only for an mla config
        d, heads = config.d_model, config.n_heads
        self.n_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        qk_dim = mla.qk_head_dim
        # Either the direct query projection or the three of the query latent.
        self.q_proj: Linear | None
        self.q_a_proj: Linear | None
        self.q_a_norm: RMSNorm | None
        self.q_b_proj: Linear | None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(d, heads * qk_dim, bias=False)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d, mla.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, config.norm_eps, config.fused_kernels)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj = Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, config.norm_eps, config.fused_kernels)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(heads * mla.v_head_dim, d, bias=False)
        self.softmax_scale = qk_dim**-0.5

    def forward(self, x_BSD: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        batch, seq_len, _ = x_BSD.shape
        heads, nope, rope_dim, v_dim = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        qk_dim = nope + rope_dim
        if self.q_proj is not None:
            q = self.q_proj(x_BSD)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BSD)))
        q_BSHq = q.view(batch, seq_len, heads, qk_dim)

        latent_BSC, k_rope_BSr = self.kv_a_proj(x_BSD).split([self.kv_lora_rank, rope_dim], dim=-1)
        kv_BSH = self.kv_b_proj(self.kv_a_norm(latent_BSC)).view(batch, seq_len, heads, nope + v_dim)
        k_nope_BSHn, v_BSHv = kv_BSH.split([nope, v_dim], dim=-1)

        # RoPE works on (..., S, r) views; elementwise ops keep the (B, S, H) memory order. One RoPE key
        # per token: rotated once, broadcast over the heads.
        q_rope_BHSr, k_rope_B1Sr = rope(q_BSHq[..., nope:].transpose(1, 2), k_rope_BSr.unsqueeze(1))
        # Queries, keys and values laid out (B, S, H, width), as grouped-query attention's are: the
        # kernel's output then follows, and o_proj reads it without a copy when no slice is needed.
        q_BSHq = torch.cat([q_BSHq[..., :nope], q_rope_BHSr.transpose(1, 2)], dim=-1)
        k_BSHq = torch.cat([k_nope_BSHn, k_rope_B1Sr.transpose(1, 2).expand(batch, seq_len, heads, rope_dim)], dim=-1)
        if v_dim < qk_dim:
            v_BSHv = F.pad(v_BSHv, (0, qk_dim - v_dim))
        elif qk_dim < v_dim:
            q_BSHq, k_BSHq = (F.pad(t, (0, v_dim - qk_dim)) for t in (q_BSHq, k_BSHq))
        o_BHSw = F.scaled_dot_product_attention(
            q_BSHq.transpose(1, 2),
            k_BSHq.transpose(1, 2),
            v_BSHv.transpose(1, 2),
            is_causal=True,
            scale=self.softmax_scale,
        )
        o_BSHv = o_BHSw.transpose(1, 2)[..., :v_dim]
        return self.o_proj(o_BSHv.reshape(batch, seq_len, heads * v_dim))
