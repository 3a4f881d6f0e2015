"""Activation memory of a plan: what one microbatch keeps for backward, block by block
(``bench.predict.plan``'s notation).
More: docs/memory-plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.predict.plan.bytes import PrecisionBytes
from moe_engine.config import DispatchKind, ModelConfig, ParallelConfig, RecomputeConfig, RecomputeMode, RecomputePart


def _norm_activation_bytes(width: int, tokens: int, b: PrecisionBytes, fused: bool = False) -> float:
    """An RMSNorm saves its input in fp32 (a copy; in fp32 the input itself) and the normalised values;
    fused, its input as it is (and one fp32 statistic per row, left out). Its output is counted where
    a consumer saves it."""
    return tokens * width * (b.activation if fused else 4 + b.activation)


def _mla_attention_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """What multi-head latent attention saves (docs/memory-plan.md's MLA ``attn``)."""
    mla, a, heads, fused = model.mla, b.activation, model.n_heads, model.fused_kernels
    assert mla is not None  # _attention_bytes calls it only for a model with mla
    qk, v = mla.qk_head_dim, mla.v_head_dim
    width = max(qk, v)
    saved = 0.0
    if mla.q_lora_rank is not None:
        saved += _norm_activation_bytes(mla.q_lora_rank, tokens, b, fused) + a * tokens * mla.q_lora_rank
    saved += _norm_activation_bytes(mla.kv_lora_rank, tokens, b, fused) + a * tokens * mla.kv_lora_rank
    if a == 4 or fused:
        # The latent's norm saves its input as is (in fp32, or fused): a view of kv_a's output, RoPE
        # key included.
        saved += a * tokens * mla.qk_rope_head_dim
    value = width if v < width else mla.qk_nope_head_dim + v
    saved += a * tokens * heads * (2 * width + value + width) + 4 * tokens * heads
    if v < width:
        saved += a * tokens * heads * v
    return saved


def gqa_head_dim(model: ModelConfig) -> int:
    """The head width of grouped-query attention (a model without mla)."""
    if model.head_dim is None:
        raise ValueError("model.head_dim: unresolved for grouped-query attention (ModelConfig sets it without mla)")
    return model.head_dim


def kv_bytes_per_token(model: ModelConfig, b: PrecisionBytes) -> dict[str, float]:
    """Key and value bytes per token and block: what attention materialises for its kernel, and what
    an inference cache would hold (MLA: the latent and the shared RoPE key; GQA: the k and v heads)."""
    a = b.activation
    if model.mla is None:
        kv = 2 * model.n_kv_heads * gqa_head_dim(model) * a
        return {"attention": kv, "cache": kv}
    mla = model.mla
    width = max(mla.qk_head_dim, mla.v_head_dim)
    return {"attention": 2 * model.n_heads * width * a, "cache": (mla.kv_lora_rank + mla.qk_rope_head_dim) * a}


def _attention_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """What the attention module saves (``attn``): what selective attention recompute drops."""
    if model.mla is not None:
        return _mla_attention_bytes(model, tokens, b)
    head_dim = gqa_head_dim(model)
    q = model.n_heads * head_dim
    kv = model.n_kv_heads * head_dim
    # q_norm and k_norm: their outputs feed RoPE, which saves only its cos/sin tables.
    qk_norm = _norm_activation_bytes(q + kv, tokens, b, model.fused_kernels) if model.qk_norm else 0
    if model.qk_norm_per_head:
        # Normalised per head, the norms' fp32 statistics are one value per head and token: as many as
        # the log-sum-exp, too many to leave out.
        qk_norm += 4 * tokens * (model.n_heads + model.n_kv_heads)
    # q and k after RoPE, v, and the attention output (saved by the kernel); o_proj's input is a view
    # of the output, which the kernel lays out (B, S, H, d); the fp32 log-sum-exp.
    return qk_norm + b.activation * tokens * (2 * q + 2 * kv) + 4 * tokens * model.n_heads


def _swiglu_activation_bytes(hidden: int, tokens: int, b: PrecisionBytes, fused: bool = False) -> float:
    """gate, up, silu(gate) and the product (the down projection's input); fused, no silu(gate)."""
    return b.activation * tokens * (3 if fused else 4) * hidden


def expert_rows(tokens: int, model: ModelConfig, par: ParallelConfig) -> float:
    """Rows the local experts process per microbatch: the capacity buffers under no-sync dispatch."""
    assignments = tokens * model.moe.top_k
    return assignments * (dispatch_pad(par) if par.ep > 1 else 1.0)


@dataclass(frozen=True)
class BlockActivations:
    """What one block holds for backward per microbatch, and what its recompute brings back."""

    kept: float
    """Bytes it keeps from its forward to its backward."""
    recompute_peak: float = 0.0
    """The most bytes its recompute brings back at once in backward (0 when it is not recomputed)."""
    during_expert_backward: float = 0.0
    """Of those, the bytes alive while its experts' backward runs (full recompute, selective experts)."""


def block_activations(
    model: ModelConfig,
    dense: bool,
    tokens: int,
    b: PrecisionBytes,
    par: ParallelConfig,
    recompute: RecomputeConfig | None,
) -> BlockActivations:
    """A dense or MoE block's activations (docs/memory-plan.md's formulas); ``recompute`` None when
    the block is not recomputed."""
    a, d, moe, fused = b.activation, model.d_model, model.moe, model.fused_kernels
    norm = _norm_activation_bytes(d, tokens, b, fused)
    # One (T, D) tensor in the model dtype: a norm's output, or the input a checkpoint of a block or
    # of a norm keeps.
    td = a * tokens * d
    attention = _attention_bytes(model, tokens, b)
    experts = rows = 0.0
    if dense:
        # The FFN's input (the norm's output, which gate and up save) and its SwiGLU.
        ffn = td + _swiglu_activation_bytes(model.dense_hidden, tokens, b, fused)
    else:
        rows = expert_rows(tokens, model, par)
        experts = rows * b.expert_input * (d + 2 * moe.expert_hidden)
        # The router computes in fp32 and saves its fp32 input (a copy of the norm's output, or the
        # output itself in fp32), its logits and scores; the combine saves the expert outputs (fused:
        # the buffer it reads them from, capacity rows included).
        combine = a * (rows if fused else tokens * moe.top_k) * d
        # Fused, the router's chain keeps its logits only (the scores are recomputed in its backward).
        router = (1 if fused else 2) * 4 * tokens * moe.num_experts
        ffn = 4 * tokens * d + router + combine
        if moe.shared_expert_hidden:
            # Its projections save the norm's output: in bf16 nothing else does (the router copies it).
            ffn += (td if a < 4 else 0) + _swiglu_activation_bytes(moe.shared_expert_hidden, tokens, b, fused)
    # The attention part: its norm, the norm's output (q, k and v's input) and the attention itself.
    whole = 2 * norm + td + attention + ffn + experts
    if recompute is None:
        return BlockActivations(whole)
    # In fp32 (or fused) the first norm saves the block's input itself, the tensor a checkpoint keeps anyway.
    input_is_saved = a == 4 or fused
    if recompute.mode is RecomputeMode.FULL:
        back = whole - (td if input_is_saved else 0)
        return BlockActivations(td, back, 0.0 if dense else back)
    kept, peak, during_experts = whole, 0.0, 0.0
    if RecomputePart.ATTENTION in recompute.parts:
        kept -= attention
        peak = max(peak, attention)
    if RecomputePart.EXPERTS in recompute.parts and not dense:
        # The checkpoint keeps what the experts gather from, in the model dtype: the received rows, or
        # the token rows, which the router (fp32) or a shared expert already keeps.
        if par.ep > 1:
            kept += rows * a * d
        elif not (a == 4 or moe.shared_expert_hidden):
            kept += td
        kept -= experts
        # The recomputed forward gathers its rows anew and saves them (or their MXFP8 codes).
        during_experts = experts
        peak = max(peak, during_experts)
    if RecomputePart.NORMS in recompute.parts:
        kept -= 2 * (norm - td)
        peak = max(peak, norm - (td if input_is_saved else 0))
    return BlockActivations(kept, peak, during_experts)


def head_activation_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """The final norm, its output (the LM head's input) and the fp32 log-probabilities the cross-entropy
    saves; fused, the loss keeps no logits (one fp32 log-sum-exp per row, left out)."""
    logits = 0 if model.fused_kernels else 4 * tokens * model.vocab_size
    return (
        _norm_activation_bytes(model.d_model, tokens, b, model.fused_kernels)
        + b.activation * tokens * model.d_model
        + logits
    )


def dispatch_pad(par: ParallelConfig) -> float:
    return par.capacity_factor if par.dispatch is DispatchKind.NO_SYNC else 1.0
