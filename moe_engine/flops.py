"""Parameter counts and training FLOPs per token, computed from a ``ModelConfig`` alone: pure integer
arithmetic, no tensors, the project's one implementation of the FLOPs formula (Megatron-LM's
convention). The formulas: docs/flops.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_engine.config import ModelConfig, MoEConfig, RecomputeConfig, RecomputeMode, RecomputePart

__all__ = [
    "ParameterCounts",
    "attention_forward_flops_per_token",
    "block_forward_flops_per_token",
    "dense_ffn_training_flops_per_token",
    "forward_flops_per_token",
    "hardware_flops_per_token",
    "moe_ffn_training_flops_per_token",
    "parameter_counts",
    "recompute_flops_per_token",
    "routed_experts_forward_flops_per_token",
    "training_flops_per_token",
]

# 2 FLOPs per multiply-add, x3 for forward plus backward.
_TRAINING_FLOPS_PER_MATMUL_PARAM = 6
# 2 FLOPs per multiply-add, forward only (what a recompute runs again).
_FORWARD_FLOPS_PER_MATMUL_PARAM = 2


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of ``moe_engine.model.Transformer`` for a config, by component, summed over layers.

    The component fields partition ``total``: embedding + lm_head + attention + norms + dense_ffn
    + router + shared_expert + experts == total.
    """

    total: int
    """Every parameter the built model holds (what ``sum(p.numel() for p in model.parameters())`` gives)."""
    active: int
    """Parameters one token uses: total minus the E - top_k routed experts it skips in each MoE layer."""
    embedding: int
    """Input embedding V * D (counted in total and active, though its lookup costs no FLOPs)."""
    lm_head: int
    """Output projection D * V; 0 with tied embeddings (the one matrix is counted under embedding)."""
    attention: int
    """Attention projections of all layers: q, k, v, o (GQA shrinks k and v to kv_dim), or MLA's."""
    norms: int
    """Every RMSNorm weight: two per block, q_norm and k_norm when qk_norm (head_dim each per head), MLA's latent norms, the final norm."""
    dense_ffn: int
    """SwiGLU weights of every dense block (the leading ones and those between MoE blocks)."""
    router: int
    """Router weights E * D of all MoE layers (kept in fp32 whatever the model's precision)."""
    shared_expert: int
    """Always-on shared expert SwiGLU weights of all MoE layers (0 without one)."""
    experts: int
    """All routed expert weights (gate_up and down) of all MoE layers; most of an MoE model's size."""


def _seq_len(config: ModelConfig, seq_len: int | None) -> int:
    s = config.seq_len if seq_len is None else seq_len
    if s < 1:
        raise ValueError(f"seq_len: must be >= 1, got {s}")
    return s


def _swiglu_params(d_model: int, hidden: int) -> int:
    # gate, up and down projections, no biases.
    return 3 * d_model * hidden


def _gqa_head_dim(config: ModelConfig) -> int:
    """The head width of grouped-query attention (a config without mla)."""
    assert config.head_dim is not None  # ModelConfig resolves it whenever there is no mla
    return config.head_dim


def _attention_projection_params(config: ModelConfig) -> int:
    """Per-layer attention weights (q, k, v, o, or MLA's projections); the matmul parameters of attention."""
    d, heads, mla = config.d_model, config.n_heads, config.mla
    if mla is None:
        q_dim = heads * _gqa_head_dim(config)
        kv_dim = config.n_kv_heads * _gqa_head_dim(config)
        return 2 * d * q_dim + 2 * d * kv_dim
    q_out = heads * mla.qk_head_dim
    q = d * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (d + q_out)
    kv = d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * heads * (
        mla.qk_nope_head_dim + mla.v_head_dim
    )
    return q + kv + heads * mla.v_head_dim * d


def _attention_flop_params(config: ModelConfig) -> int:
    """N_attn of docs/flops.md: the projections plus, with MLA, Megatron's one multiply-add per
    element of each latent norm."""
    mla = config.mla
    latent_norms = 0 if mla is None else mla.kv_lora_rank + (mla.q_lora_rank or 0)
    return _attention_projection_params(config) + latent_norms


def _attention_norm_params(config: ModelConfig) -> int:
    """Per-layer norm weights inside attention: q_norm and k_norm (qk_norm), or MLA's latent norms."""
    mla = config.mla
    if mla is not None:
        return mla.kv_lora_rank + (mla.q_lora_rank or 0)
    if config.qk_norm:
        head_dim = _gqa_head_dim(config)
        return 2 * head_dim if config.qk_norm_per_head else (config.n_heads + config.n_kv_heads) * head_dim
    return 0


def _attention_core_width(config: ModelConfig) -> int:
    """A_core of docs/flops.md: the widths QK^T and AV contract over, summed over the heads."""
    mla = config.mla
    if mla is None:
        return 2 * config.n_heads * _gqa_head_dim(config)
    return config.n_heads * (mla.qk_head_dim + mla.v_head_dim)


def _output_projection_params(config: ModelConfig) -> int:
    """o_proj's weights: the attention's last GEMM."""
    v_dim = _gqa_head_dim(config) if config.mla is None else config.mla.v_head_dim
    return config.d_model * config.n_heads * v_dim


def _moe_matmul_params_per_token(d_model: int, moe: MoEConfig) -> int:
    """The k routed experts a token visits plus the shared expert, in one MoE layer."""
    return moe.top_k * _swiglu_params(d_model, moe.expert_hidden) + _swiglu_params(d_model, moe.shared_expert_hidden)


def moe_ffn_training_flops_per_token(d_model: int, moe: MoEConfig) -> int:
    """Training FLOPs per token of one MoE feed-forward layer (router excluded): 6 * (k*3*D*F + 3*D*F_shared)."""
    return _TRAINING_FLOPS_PER_MATMUL_PARAM * _moe_matmul_params_per_token(d_model, moe)


def dense_ffn_training_flops_per_token(d_model: int, hidden: int) -> int:
    """Training FLOPs per token of one dense SwiGLU feed-forward layer: 6 * 3 * D * hidden."""
    return _TRAINING_FLOPS_PER_MATMUL_PARAM * _swiglu_params(d_model, hidden)


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """Count the parameters ``build_model(config)`` would hold, without building it.

    Exact Python ints, so totals past 2**53 (which a float would round) stay exact.
    """
    d = config.d_model
    moe = config.moe
    n_moe = config.n_moe_layers

    embedding = config.vocab_size * d
    lm_head = 0 if config.tie_embeddings else d * config.vocab_size
    attention = config.n_layers * _attention_projection_params(config)
    per_block_norms = 2 * d + _attention_norm_params(config)
    norms = config.n_layers * per_block_norms + d
    dense_ffn = config.n_dense_ffn_layers * _swiglu_params(d, config.dense_hidden)
    router = n_moe * moe.num_experts * d
    shared_expert = n_moe * _swiglu_params(d, moe.shared_expert_hidden)
    per_expert = _swiglu_params(d, moe.expert_hidden)
    experts = n_moe * moe.num_experts * per_expert

    total = embedding + lm_head + attention + norms + dense_ffn + router + shared_expert + experts
    active = total - n_moe * (moe.num_experts - moe.top_k) * per_expert
    return ParameterCounts(
        total=total,
        active=active,
        embedding=embedding,
        lm_head=lm_head,
        attention=attention,
        norms=norms,
        dense_ffn=dense_ffn,
        router=router,
        shared_expert=shared_expert,
        experts=experts,
    )


def training_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs of one training step (forward + backward) per token, Megatron-LM convention.

    ``seq_len`` defaults to ``config.seq_len``; pass the length actually trained on when it differs,
    since the attention term grows with it. The formula, with the notation of docs/flops.md::

        6 * (  L * N_attn
             + L_dense * 3 * D * F_dense
             + L_moe * (k * 3 * D * F + 3 * D * F_shared)
             + D * V )
        + L * 6 * S * A_core / 2

    The router, norms, embedding lookup and elementwise ops are left out (see docs/flops.md).
    """
    s = _seq_len(config, seq_len)
    d = config.d_model
    moe = config.moe

    matmul_params_per_token = (
        config.n_layers * _attention_flop_params(config)
        + config.n_dense_ffn_layers * _swiglu_params(d, config.dense_hidden)
        + config.n_moe_layers * _moe_matmul_params_per_token(d, moe)
        + d * config.vocab_size
    )
    # QK^T and AV: 2 FLOPs per multiply-add x S keys x A_core, halved by the causal mask, x3 for
    # forward + backward. Kept as 3 * S * A_core (exact integer) before the float conversion.
    attention_scores = config.n_layers * 3 * s * _attention_core_width(config)
    return float(_TRAINING_FLOPS_PER_MATMUL_PARAM * matmul_params_per_token + attention_scores)


def forward_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Forward-only FLOPs per token (evaluation, inference prefill): a third of the training count."""
    return training_flops_per_token(config, seq_len) / 3


def attention_forward_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> int:
    """Forward FLOPs per token of one block's attention: 2 * N_attn + S * A_core.

    The projections, and QK^T plus AV over the causal half of the S keys (2 FLOPs x S * A_core x
    0.5): a third of the attention's share of ``training_flops_per_token``.
    """
    s = _seq_len(config, seq_len)
    return _FORWARD_FLOPS_PER_MATMUL_PARAM * _attention_flop_params(config) + s * _attention_core_width(config)


def routed_experts_forward_flops_per_token(config: ModelConfig) -> int:
    """Forward FLOPs per token of one MoE block's routed experts: 2 * k * 3 * D * F (no shared expert)."""
    moe = config.moe
    return _FORWARD_FLOPS_PER_MATMUL_PARAM * moe.top_k * _swiglu_params(config.d_model, moe.expert_hidden)


def block_forward_flops_per_token(config: ModelConfig, layer_idx: int, seq_len: int | None = None) -> int:
    """Forward FLOPs per token of block ``layer_idx``: its attention plus its dense or MoE feed-forward
    (routed experts and shared expert; the router left out, as in ``training_flops_per_token``)."""
    if not 0 <= layer_idx < config.n_layers:
        raise ValueError(f"layer_idx: {layer_idx} is outside the model's {config.n_layers} blocks")
    d = config.d_model
    if config.is_moe_layer(layer_idx):
        ffn = _moe_matmul_params_per_token(d, config.moe)
    else:
        ffn = _swiglu_params(d, config.dense_hidden)
    return attention_forward_flops_per_token(config, seq_len) + _FORWARD_FLOPS_PER_MATMUL_PARAM * ffn


def recompute_flops_per_token(
    config: ModelConfig, recompute: RecomputeConfig, stages: Sequence[range], seq_len: int | None = None
) -> float:
    """FLOPs per token that activation recompute adds in backward (see docs/flops.md).

    ``stages``: every pipeline stage's block indices, the pp * virtual_stages chunks
    (``moe_engine.parallel.layout.stage_blocks``; ``[range(n_layers)]`` without pipelining), which
    ``first_per_stage`` counts in, as the engine does. Reported apart from the model FLOPs: MFU never
    counts them.
    """
    d = config.d_model
    # The projection that ends a recomputed piece is not run again (checkpoint's early stop).
    last_down = {True: 2 * d * config.dense_hidden, False: 2 * d * config.moe.shared_expert_hidden}
    total = 0
    for i in recompute.blocks(list(stages)):
        dense = not config.is_moe_layer(i)
        if recompute.mode is RecomputeMode.FULL:
            total += block_forward_flops_per_token(config, i, seq_len) - last_down[dense]
            continue
        for part in recompute.parts:
            if part is RecomputePart.ATTENTION:
                total += attention_forward_flops_per_token(config, seq_len) - 2 * _output_projection_params(config)
            elif part is RecomputePart.EXPERTS and not dense:
                # Dense blocks have no routed experts (``moe_engine.recompute`` recomputes nothing there).
                total += routed_experts_forward_flops_per_token(config)
            # NORMS: elementwise work, outside the convention.
    return float(total)


def hardware_flops_per_token(
    config: ModelConfig, recompute: RecomputeConfig, stages: Sequence[range], seq_len: int | None = None
) -> float:
    """Model FLOPs plus recompute FLOPs per token: what the GPUs execute (by the module's convention)."""
    return training_flops_per_token(config, seq_len) + recompute_flops_per_token(config, recompute, stages, seq_len)
