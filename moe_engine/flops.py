"""Parameter counts and training FLOPs per token, computed from a ``ModelConfig`` alone.

This is pure integer arithmetic on the config: it builds no tensors, so it answers for configs far
too large to instantiate (a trillion-parameter model costs microseconds here). It is the project's
one implementation of the FLOPs formula; MFU, throughput reports and benchmarks call
``training_flops_per_token`` rather than restating it.

Notation: D = d_model, V = vocab_size, L = n_layers, L_dense = n_dense_layers,
L_moe = L - L_dense, q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim,
F_dense = dense_hidden, E = moe.num_experts, k = moe.top_k, F = moe.expert_hidden,
F_shared = moe.shared_expert_hidden, S = seq_len.

Training FLOPs per token follow Megatron-LM's ``num_floating_point_operations`` convention (model
FLOPs: activation recomputation is not counted, so MFU stays comparable across recompute
settings)::

    N_matmul = L * (2 * D * q_dim + 2 * D * kv_dim)      # q, o and k, v projections
             + L_dense * 3 * D * F_dense                  # dense SwiGLU (gate, up, down)
             + L_moe * k * 3 * D * F                      # the k routed experts a token visits
             + L_moe * 3 * D * F_shared                   # shared expert (0 when absent)
             + D * V                                      # LM head (untied)

    training_flops_per_token = 6 * N_matmul
                             + L * 6 * 2 * S * q_dim * 0.5

The factor 6 is 2 FLOPs per multiply-add times 3 for forward plus backward (the backward pass
computes gradients for both inputs and weights, twice the forward). The attention term counts the
two sequence-mixing matmuls, QK^T and AV: each costs 2 * S * q_dim FLOPs per token in the forward
pass (every query head meets S keys; grouped-query attention shares k/v but not this work), the
causal mask halves it on average (0.5), and x3 again for forward plus backward.

Excluded, as in Megatron-LM: the router (2 * D * E per token and MoE layer, small next to the
experts), RMSNorm, RoPE, softmax, SwiGLU activations and other elementwise work, and the embedding
lookup (a gather, no matmul).

Recompute FLOPs per token (``recompute_flops_per_token``): what activation recompute
(``RecomputeConfig``, ``moe_engine.recompute``) runs again in backward, by the same convention
(router, norms and elementwise work left out). A recomputed piece runs its forward again, a third
of its training FLOPs::

    attention forward (one block)  = 2 * (2 * D * q_dim + 2 * D * kv_dim) + 2 * S * q_dim
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
    selective attention:  attention forward - 2 * D * q_dim   (the output projection)
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
    """Untied output projection D * V."""
    attention: int
    """q, k, v and o projections of all layers (GQA shrinks k and v to kv_dim)."""
    norms: int
    """Every RMSNorm weight: two per block, q_norm and k_norm when qk_norm, and the final norm."""
    dense_ffn: int
    """SwiGLU weights of the leading dense layers."""
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


def _attention_projection_params(config: ModelConfig) -> int:
    """Per-layer q, k, v, o weights; the matmul parameters of attention."""
    q_dim = config.n_heads * config.head_dim
    kv_dim = config.n_kv_heads * config.head_dim
    return 2 * config.d_model * q_dim + 2 * config.d_model * kv_dim


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
    q_dim = config.n_heads * config.head_dim
    kv_dim = config.n_kv_heads * config.head_dim
    n_moe = config.n_moe_layers

    embedding = config.vocab_size * d
    lm_head = d * config.vocab_size
    attention = config.n_layers * _attention_projection_params(config)
    per_block_norms = 2 * d + ((q_dim + kv_dim) if config.qk_norm else 0)
    norms = config.n_layers * per_block_norms + d
    dense_ffn = config.n_dense_layers * _swiglu_params(d, config.dense_hidden)
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

        6 * (  L * (2 * D * q_dim + 2 * D * kv_dim)
             + L_dense * 3 * D * F_dense
             + L_moe * (k * 3 * D * F + 3 * D * F_shared)
             + D * V )
        + L * 6 * 2 * S * q_dim * 0.5

    The router, norms, embedding lookup and elementwise ops are left out (see the module docstring).
    """
    s = _seq_len(config, seq_len)
    d = config.d_model
    moe = config.moe
    q_dim = config.n_heads * config.head_dim

    matmul_params_per_token = (
        config.n_layers * _attention_projection_params(config)
        + config.n_dense_layers * _swiglu_params(d, config.dense_hidden)
        + config.n_moe_layers * _moe_matmul_params_per_token(d, moe)
        + d * config.vocab_size
    )
    # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add x S keys x q_dim, halved by the causal mask,
    # x3 for forward + backward. Kept as 6 * S * q_dim (exact integer) before the float conversion.
    attention_scores = config.n_layers * 6 * s * q_dim
    return float(_TRAINING_FLOPS_PER_MATMUL_PARAM * matmul_params_per_token + attention_scores)


def forward_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Forward-only FLOPs per token (evaluation, inference prefill): a third of the training count."""
    return training_flops_per_token(config, seq_len) / 3


def attention_forward_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> int:
    """Forward FLOPs per token of one block's attention: 2 * (2*D*q_dim + 2*D*kv_dim) + 2 * S * q_dim.

    The projections, and QK^T plus AV over the causal half of the S keys (2 matmuls x 2 FLOPs x
    S * q_dim x 0.5): a third of the attention's share of ``training_flops_per_token``.
    """
    s = _seq_len(config, seq_len)
    q_dim = config.n_heads * config.head_dim
    return _FORWARD_FLOPS_PER_MATMUL_PARAM * _attention_projection_params(config) + 2 * s * q_dim


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
    if layer_idx < config.n_dense_layers:
        ffn = _swiglu_params(d, config.dense_hidden)
    else:
        ffn = _moe_matmul_params_per_token(d, config.moe)
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
    d, q_dim = config.d_model, config.n_heads * config.head_dim
    # The projection that ends a recomputed piece is not run again (checkpoint's early stop).
    last_down = {True: 2 * d * config.dense_hidden, False: 2 * d * config.moe.shared_expert_hidden}
    total = 0
    for i in recompute.blocks(list(stages)):
        dense = i < config.n_dense_layers
        if recompute.mode is RecomputeMode.FULL:
            total += block_forward_flops_per_token(config, i, seq_len) - last_down[dense]
            continue
        for part in recompute.parts:
            if part is RecomputePart.ATTENTION:
                total += attention_forward_flops_per_token(config, seq_len) - 2 * d * q_dim
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
