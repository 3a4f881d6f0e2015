"""Parameter counts and training FLOPs per token, computed from a ``ModelConfig`` alone.

This is pure integer arithmetic on the config: it builds no tensors, so it answers for configs far
too large to instantiate (a trillion-parameter model costs microseconds here). It is the project's
one implementation of the FLOPs formula; MFU, throughput reports and benchmarks call
``training_flops_per_token`` rather than restating it.

Notation: D = d_model, V = vocab_size, L = n_layers, L_moe = the MoE blocks (``is_moe_layer``: after
the n_dense_layers leading dense blocks, every moe_every-th), L_dense = L - L_moe (every dense block,
leading or interleaved), H = n_heads, q_dim = H * head_dim, kv_dim = n_kv_heads * head_dim,
F_dense = dense_hidden, E = moe.num_experts, k = moe.top_k, F = moe.expert_hidden,
F_shared = moe.shared_expert_hidden, S = seq_len. With multi-head latent attention (``mla``):
Q = q_lora_rank, C = kv_lora_rank, n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim.

Training FLOPs per token follow Megatron-LM's ``num_floating_point_operations`` convention (model
FLOPs: activation recomputation is not counted, so MFU stays comparable across recompute
settings)::

    N_matmul = L * N_attn                                 # attention projections (below)
             + L_dense * 3 * D * F_dense                  # dense SwiGLU (gate, up, down)
             + L_moe * k * 3 * D * F                      # the k routed experts a token visits
             + L_moe * 3 * D * F_shared                   # shared expert (0 when absent)
             + D * V                                      # LM head (tied or not: the matmul runs)

    training_flops_per_token = 6 * N_matmul + L * 6 * S * A_core / 2

    grouped-query attention:
        N_attn = 2 * D * q_dim + 2 * D * kv_dim           # q, o and k, v projections
        A_core = 2 * q_dim                                # QK^T and AV over q_dim each
    multi-head latent attention (the MLA branch of Megatron's formula):
        N_attn = Q * (D + H * (n + r) + 1)                # q_a, q_b, and the query latent's norm
                 (D * H * (n + r) without a query latent) # q_proj
               + C * (D + H * (n + v) + 1)                # kv_a's latent part, kv_b, the latent's norm
               + D * r                                    # kv_a's shared RoPE key
               + H * v * D                                # o_proj
        A_core = H * (n + r) + H * v                      # QK^T over n + r, AV over v

The "+ 1" terms are Megatron's: each latent's RMSNorm counted as one multiply-add per element (the
only norms this convention counts). The engine runs MLA's AV over the query/key width n + r, to which
it pads the values for the fused attention kernels (``moe_engine.modules.mla``); the formula keeps
Megatron's v, so that work is outside it.

The factor 6 is 2 FLOPs per multiply-add times 3 for forward plus backward (the backward pass
computes gradients for both inputs and weights, twice the forward). The attention term counts the
two sequence-mixing matmuls, QK^T and AV: together 2 * S * A_core FLOPs per token in the forward
pass (every query head meets S keys; grouped-query attention shares k/v but not this work), the
causal mask halves it on average (0.5), and x3 again for forward plus backward.

Excluded, as in Megatron-LM: the router (2 * D * E per token and MoE layer, small next to the
experts), RMSNorm (but MLA's latent norms, above), RoPE, softmax, SwiGLU activations and other
elementwise work, and the embedding lookup (a gather, no matmul).

Recompute FLOPs per token (``recompute_flops_per_token``): what activation recompute
(``RecomputeConfig``, ``moe_engine.recompute``) runs again in backward, by the same convention
(router, norms and elementwise work left out). A recomputed piece runs its forward again, a third
of its training FLOPs::

    attention forward (one block)  = 2 * N_attn + S * A_core
    routed experts forward (MoE)   = 2 * k * 3 * D * F
    block forward, dense           = attention forward + 2 * 3 * D * F_dense
    block forward, MoE             = attention forward + 2 * (k * 3 * D * F + 3 * D * F_shared)

less the last GEMM of the piece where that GEMM is a plain projection: ``torch.utils.checkpoint``
(non-reentrant, with torch's default early stop) ends a recompute as soon as every tensor backward
needs is saved again, and a linear layer's input is saved before it multiplies, so the projection
that ends a piece does not run again (tests/test_flops.py counts the ops a recompute runs). So, per
recomputed block::

    full, dense block:    block forward - 2 * D * F_dense     (the FFN's down projection)
    full, MoE block:      block forward - 2 * D * F_shared    (the shared expert's down projection;
                                                               without one the block ends with the
                                                               combine, an autograd Function that
                                                               saves after it runs: nothing is left out)
    selective attention:  attention forward - 2 * D * o_dim   (the output projection; o_dim = q_dim,
                                                               or H * v with mla)
    selective experts:    routed experts forward, MoE blocks only (their autograd Function saves
                          after both GEMMs)
    selective norms:      0 (elementwise)

The recomputed blocks are ``RecomputeConfig.blocks(stages)``. Model FLOPs (``training_flops_per_token``,
what MFU is measured with) never include them; ``hardware_flops_per_token`` = model + recompute
FLOPs, what the GPUs execute by this convention. Every block's forward plus the LM head's forward
(2 * D * V) is the whole forward, a third of the training FLOPs.
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
    """N_attn of the module docstring: the projections plus, with MLA, Megatron's one multiply-add per
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
    """A_core of the module docstring: the widths QK^T and AV contract over, summed over the heads."""
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
    since the attention term grows with it. The formula, with the notation of the module docstring::

        6 * (  L * N_attn
             + L_dense * 3 * D * F_dense
             + L_moe * (k * 3 * D * F + 3 * D * F_shared)
             + D * V )
        + L * 6 * S * A_core / 2

    The router, norms, embedding lookup and elementwise ops are left out (see the module docstring).
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
    """FLOPs per token that activation recompute adds in backward (see the module docstring).

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
