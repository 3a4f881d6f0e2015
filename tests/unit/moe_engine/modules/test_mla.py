"""Multi-head latent attention against a plain per-head reference (fp32, outputs and gradients).

The reference writes every step out by hand: RMSNorms from their definition, RoPE as the rotation of
the pairs (i, i + r/2) by position * theta^(-2i/r), each head's scores and output by einsum with an
explicit causal mask and softmax. Nothing is shared with the module but its weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_close_to_scale, tolerance

from moe_engine.config import ModelConfig
from moe_engine.modules.mla import MultiHeadLatentAttention
from moe_engine.modules.rope import RotaryEmbedding

EPS = 1e-5
THETA = 10000.0


def _rms(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _rope(x_BSr):
    seq, dim = x_BSr.shape[-2], x_BSr.shape[-1]
    half = dim // 2
    freq = torch.tensor([THETA ** (-2 * i / dim) for i in range(half)], dtype=torch.float64)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = angle.cos().to(x_BSr.dtype), angle.sin().to(x_BSr.dtype)
    x1, x2 = x_BSr[..., :half], x_BSr[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference(x_BSD, w: dict[str, torch.Tensor], heads, nope, rope_dim, v_dim, kv_rank, q_rank):
    _batch, seq, _ = x_BSD.shape
    qk = nope + rope_dim
    if q_rank is None:
        q_all = x_BSD @ w["q_proj"].T
    else:
        q_all = _rms(x_BSD @ w["q_a_proj"].T, w["q_a_norm"]) @ w["q_b_proj"].T
    compressed = x_BSD @ w["kv_a_proj"].T
    latent, k_rope = compressed[..., :kv_rank], compressed[..., kv_rank:]
    kv_all = _rms(latent, w["kv_a_norm"]) @ w["kv_b_proj"].T
    k_rope = _rope(k_rope)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    outputs = []
    for h in range(heads):
        q_h = q_all[..., h * qk : (h + 1) * qk]
        q_h = torch.cat([q_h[..., :nope], _rope(q_h[..., nope:])], dim=-1)
        kv_h = kv_all[..., h * (nope + v_dim) : (h + 1) * (nope + v_dim)]
        k_h = torch.cat([kv_h[..., :nope], k_rope], dim=-1)
        v_h = kv_h[..., nope:]
        scores = torch.einsum("bsd,btd->bst", q_h, k_h) / math.sqrt(qk)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        outputs.append(torch.einsum("bst,btd->bsd", probs, v_h))
    return torch.cat(outputs, dim=-1) @ w["o_proj"].T


@pytest.mark.parametrize(
    "q_rank, nope, rope_dim, v_dim",
    [(24, 8, 4, 6), (None, 8, 4, 6), (24, 6, 4, 12), (None, 8, 8, 16)],
    ids=["q-latent-v-narrower", "no-q-latent", "v-wider", "no-q-latent-v-equal"],
)
def test_mla_matches_a_per_head_reference(q_rank, nope, rope_dim, v_dim):
    heads, d_model, kv_rank, seq = 4, 32, 16, 12
    config = ModelConfig(
        vocab_size=16,
        d_model=d_model,
        n_layers=1,
        n_heads=heads,
        n_kv_heads=heads,
        seq_len=seq,
        dtype="fp32",
        norm_eps=EPS,
        rope_theta=THETA,
        mla=dict(
            q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim
        ),
    )
    torch.manual_seed(0)
    module = MultiHeadLatentAttention(config)
    with torch.no_grad():
        for param in module.parameters():
            # Norm weights away from 1, so that a norm left out or misplaced shows.
            param.copy_(torch.randn_like(param) * (0.3 if param.ndim == 2 else 0.2) + (0 if param.ndim == 2 else 1))
    rope = RotaryEmbedding(rope_dim, seq, THETA)
    x_BSD = torch.randn(2, seq, d_model, requires_grad=True)
    out = module(x_BSD, rope)

    weights = {
        name.removesuffix(".weight"): p.detach().clone().requires_grad_() for name, p in module.named_parameters()
    }
    x_ref = x_BSD.detach().clone().requires_grad_()
    expected = reference(x_ref, weights, heads, nope, rope_dim, v_dim, kv_rank, q_rank)
    # Seven reductions from input to output (query latent, its norm, query, scores, softmax, values,
    # output projection), the longest over the 64 of all heads' queries; gradients run them back too.
    k = max(d_model, heads * (nope + rope_dim), heads * v_dim, 2 * seq)
    assert_close_to_scale(out, expected, tolerance(torch.float32, k, depth=7))

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    grad_tol = tolerance(torch.float32, k, depth=14)
    assert_close_to_scale(x_BSD.grad, x_ref.grad, grad_tol, msg="input")
    for name, param in module.named_parameters():
        assert_close_to_scale(param.grad, weights[name.removesuffix(".weight")].grad, grad_tol, msg=name)


def test_mla_is_causal_and_uses_the_shared_rope_key():
    """A later token never changes an earlier output; the RoPE key is one per token, shared by heads."""
    config = ModelConfig(
        vocab_size=16,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=4,
        seq_len=8,
        dtype="fp32",
        mla=dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    )
    torch.manual_seed(1)
    module = MultiHeadLatentAttention(config)
    assert module.kv_a_proj.weight.shape == (16 + 4, 32)  # latent plus one RoPE key, not one per head
    rope = RotaryEmbedding(4, 8, config.rope_theta)
    x = torch.randn(1, 8, 32)
    changed = x.clone()
    changed[:, 5:] += 1.0
    assert_close_to_scale(module(changed, rope)[:, :5], module(x, rope)[:, :5], tolerance(torch.float32, 48, depth=5))
    assert not torch.allclose(module(x, rope)[:, 5:], module(changed, rope)[:, 5:])
