"""Activation memory of a plan: what one microbatch keeps for backward, block by block
(``bench.predict.plan``'s notation).

Activation memory per rank: A_mb (one microbatch over all the rank's blocks) * in-flight / v
    T = tokens_per_step / dp / m tokens per microbatch per rank; a = activation bytes (4 fp32, 2 otherwise);
    e = bytes of a saved expert-GEMM input element (a; mxfp8: 1 + 1/32, an fp8 value plus one shared
    8-bit scale per 32 elements). The tensors the engine keeps for backward (flash attention; the
    experts recompute their SwiGLU product), as measured on a real block in every recompute mode by
    tests/bench/predict/test_plan_saved_tensors.py:
    RMSNorm over width w:       norm(w) = T * w * (4 + a)   (its input in fp32: a copy, or in fp32 the
                                input itself; the normalised values). Its output is counted where a
                                consumer saves it.
    attention part of a block:  norm(D) + a * T * D (the norm's output, which q, k and v save)
                              + attn, attn = [norm(q) + norm(kv) with qk_norm] + a * T * (2q + 2kv) + 4 * T * H
                                             [+ 4 * T * (H + n_kv_heads) with qk_norm_per_head: the
                                              norms' statistics, one fp32 value per head and token]
        (q and k after RoPE, v and the attention output, kept by the kernel; o_proj's input is a view
         of that output, which the kernel lays out (B, S, H, d); fp32 log-sum-exp. RoPE keeps only
         its cos/sin tables)
        with multi-head latent attention (Q = q_lora_rank, C = kv_lora_rank, n, r, v the head widths,
        W = max(n + r, v) the width the kernel runs at, ``moe_engine.modules.mla``):
        attn = [norm(Q) + a * T * Q with a query latent]   (its norm, and the norm's output q_b saves)
             + norm(C) + a * T * C                          (the key-value latent's norm and output)
             + [4 * T * r in fp32]                          (the norm saves its input itself: a view of
                                                             kv_a's output, which holds the RoPE key too)
             + 3 * a * T * H * W                            (q and k at width n + r, padded to W; v)
             + a * T * H * W + 4 * T * H                    (the kernel's output and log-sum-exp)
             + [a * T * H * v when v < W]                   (o_proj's input, a copy of the sliced output)
        v counts at W when padded; unpadded (v = W) it is a view that keeps kv_b's whole output,
        T * H * (n + v), alive: a * T * H * (n + v) in place of a * T * H * W.
    SwiGLU of hidden F:         4 * a * T * F      (gate, up, silu(gate), product)
    dense FFN:                  norm(D) + a * T * D (its input) + SwiGLU(F_d)   (every dense block: the
                                leading ones and, with moe_every > 1, those between MoE blocks)
    MoE FFN:                    norm(D) + 4 * T * D   (the router's fp32 input: a copy of the norm's
                                                        output, or in fp32 the output itself)
                              + 8 * T * E                                 (fp32 logits and scores)
                              + R * e * (D + 2F)                          (expert-GEMM input, gate/up
                                 pre-activations; the SwiGLU product is recomputed in backward)
                              + a * T * k * D                             (expert outputs for combine)
                              + [a * T * D when a < 4] + SwiGLU(F_s)      (shared expert, if any: its
                                 input, the norm's output, which nothing else saves in bf16)
        R = T * k rows, or cf * T * k under no-sync dispatch with ep > 1 (the capacity buffers)
    last stage:                 norm(D) + a * T * D (the LM head's input) + 4 * T * V (fp32
                                log-probabilities of the cross-entropy)
    with fused kernels (``model.fused_kernels``): norm(w) = a * T * w (the input as it is), SwiGLU
                                3 * a * T * F (no silu(gate)), the router 4 * T * E (its logits,
                                no scores), the combine a * R * D (the buffer
                                it reads, capacity rows included, in place of a * T * k * D), the
                                last stage's cross-entropy no logits (4 * T * V drops out)
    in flight (in chunk-microbatches, divided by v to count whole-rank microbatches), rank r:
        pp = 1:          1 (gradient accumulation frees a microbatch's activations after its backward)
        gpipe:           m * v (every microbatch's forward runs before any backward)
        1f1b:            min(m, pp - r)
        interleaved1f1b: min(m * v, 2 (pp - r - 1) + (v - 1) pp + 1) (Megatron's warm-up count + 1;
                         on rank 0 it is pp*v + pp - 1 chunks, 1F1B's memory times 1 + (pp-1)/(pp v));
                         interleaved-zb and zbv by the same rule
        dualpipev:       min(2m, 2 pp + 1) (v = 2; every rank: the peak of torch's ScheduleDualPipeV plan,
                         a stage's activations held from its F until its full backward or its W)

Activation recompute (the ``recompute`` section; ``RecomputeConfig.blocks`` over the pp * v chunks
picks the blocks, as the engine does). A recomputed block keeps, instead of the above:
    full:                 a * T * D (its input, which the checkpoint holds), nothing else
    selective attention:  its attention part less attn: norm(D) + a * T * D (the norm's output is
                          the checkpoint's input)
    selective experts:    the checkpoint's input in place of R * e * (D + 2F). The experts gather
                          their own rows (the MXFP8 ones straight into their quantized operand),
                          so that input is what they gather from: under expert parallelism the
                          received rows, R * a * D; otherwise the token rows, a * T * D, which
                          are kept anyway (0) in fp32 (the router's input) or beside a shared
                          expert (its projections' input)
    selective norms:      a * T * D (the norm's input) in place of each of its two norm(D)
    Dense blocks have no routed experts: the experts part leaves them as they are. In backward the
    recompute brings back, one block (full) or one part (selective) at a time, what the recomputed
    forward saves beyond the kept input: full, the block's activations above (less a * T * D in
    fp32, where the first norm's saved input is the kept input itself); attention, attn; experts,
    R * e * (D + 2F) (the recomputed forward gathers its rows anew); norms, one norm(D) (less
    a * T * D in fp32). That transient is in the backward workspace.
    Full recompute runs the dispatch's all-to-alls again (its forward dispatch and combine); no
    selective part holds a collective. Recompute FLOPs per token: moe_engine.flops
    (``recompute_flops_per_token``), reported apart from the model FLOPs, which MFU uses; their sum
    is ``hardware_flops_per_token``.
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
    """What multi-head latent attention saves (the module docstring's MLA ``attn``)."""
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
    """A dense or MoE block's activations (the module docstring's formulas); ``recompute`` None when
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
