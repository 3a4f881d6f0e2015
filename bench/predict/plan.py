"""``moe-bench plan``: parameters, FLOPs, per-rank memory, traffic and checkpoint bytes of a layout, by arithmetic.

Nothing is allocated: a plan answers for a 2-trillion-parameter model on 1024 GPUs in milliseconds.
Parameter counts and FLOPs come from ``moe_engine.flops`` (the project's one implementation of those
formulas); this module only splits the counts over ranks and prices them in bytes.

Notation: D = d_model, V = vocab, L = n_layers, E = experts, k = top_k, F = expert_hidden,
F_s = shared_expert_hidden, F_d = dense_hidden, H = n_heads, q = H * head_dim, kv = n_kv_heads * head_dim,
m = microbatches, v = virtual_stages, cf = capacity_factor.

Layout
    world = dp * pp; the ep ranks of an expert group sit inside dp; edp = dp / ep replicas of each expert.
    The L blocks are cut into S = pp * v contiguous chunks (chunk c gets ceil(L/S) blocks when
    c < L mod S, else floor(L/S)); pipeline rank r owns chunks r, r + pp, ..., r + (v-1)*pp. The input
    embedding sits with the first chunk (rank 0), the final norm and LM head with the last (rank pp-1).
    A rank holds E / ep local experts of each MoE block it owns. Ranks of one pipeline stage are alike
    (balanced routing), so the plan evaluates each of the pp stages and reports the most loaded one.

Parameters of a rank (element counts, taken from ``parameter_counts``)
    dense   = its blocks' attention + norms (+ dense FFN, shared expert, router) [+ embedding] [+ head]
    experts = (its MoE blocks) * (E / ep) * 3 * D * F
    Dense parameters are replicated over dp; expert parameters are sharded over ep, replicated over edp.

Bytes per parameter (param / grad / optimizer), by precision and ``parallel.grad_dtype``
    fp32:                           4 / 4 / 8   (Adam m and v; either grad_dtype)
    bf16, mxfp8, grad_dtype fp32:   2 / 4 / 12  (bf16 weights, fp32 gradient buffers: the default;
                                                 fp32 master + m + v)
    bf16, mxfp8, grad_dtype param:  2 / 2 / 12  (bf16 gradient buffers)
    The router is fp32 in every precision: 4 / 4 / 8 (its own master).
    With an fp32 buffer each backward's bf16 gradient is made by autograd and then added into the
    buffer; with a bf16 buffer autograd adds a fresh gradient into it in place. Either way the
    transient is a parameter's whole gradient in its own dtype: the backward workspace (below)
    holds the largest ones.

State memory per rank (P = parameter bytes, G = gradient bytes, O = optimizer bytes)
    ddp:           P_dense + P_exp,  G_dense + G_exp,  O_dense + O_exp
    ddp + zero1:   optimizer becomes ceil(O_dense / dp) + ceil(O_exp / edp); gradients gain the
                   reduce-scatter outputs, at the buffer's dtype, ceil(G_dense / dp) (when dp > 1)
                   + ceil(G_exp / edp) (when edp > 1)
    fsdp:          every tensor sharded: P_dense / dp + P_exp / edp (= the stage's experts / dp), same for
                   G and O, plus one transient gathered unit: the largest FSDP unit of the rank (a block
                   with its E/ep local experts, the embedding, or final norm + LM head) counted once in
                   params and once in grads (no prefetch of a second unit). The engine's FSDP mode keeps
                   the fp32 master as the sharded parameter and reduces fp32 gradients whatever
                   grad_dtype says (it has no DDP buffers), a 4/4/8 split of the same 16 bytes per
                   parameter that the grad_dtype param row's 2/2/12 split prices.

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
    in flight (in chunk-microbatches, divided by v to count whole-rank microbatches), rank r:
        pp = 1:          1 (gradient accumulation frees a microbatch's activations after its backward)
        gpipe:           m * v (every microbatch's forward runs before any backward)
        1f1b:            min(m, pp - r)
        interleaved1f1b: min(m * v, 2 (pp - r - 1) + (v - 1) pp + 1) (Megatron's warm-up count + 1;
                         on rank 0 it is pp*v + pp - 1 chunks, 1F1B's memory times 1 + (pp-1)/(pp v))

Activation recompute (the ``recompute`` section; ``RecomputeConfig.blocks`` over the pp * v chunks
picks the blocks, as the engine does). A recomputed block keeps, instead of the above:
    full:                 a * T * D (its input, which the checkpoint holds), nothing else
    selective attention:  its attention part less attn: norm(D) + a * T * D (the norm's output is
                          the checkpoint's input)
    selective experts:    R * a * D in place of R * e * (D + 2F) (the dispatched rows, the
                          checkpoint's input, in the model dtype: under mxfp8 the bf16 rows, so
                          it saves less there)
    selective norms:      a * T * D (the norm's input) in place of each of its two norm(D)
    Dense blocks have no routed experts: the experts part leaves them as they are. In backward the
    recompute brings back, one block (full) or one part (selective) at a time, what the recomputed
    forward saves beyond the kept input: full, the block's activations above (less a * T * D in
    fp32, where the first norm's saved input is the kept input itself); attention, attn; experts,
    R * e * (D + 2F) (less the kept R * a * D when e = a: the rows are saved again, not copied);
    norms, one norm(D) (less a * T * D in fp32). That transient is in the backward workspace.
    Full recompute runs the dispatch's all-to-alls again (its forward dispatch and combine); no
    selective part holds a collective. Recompute FLOPs per token: moe_engine.flops
    (``recompute_flops_per_token``), reported apart from the model FLOPs, which MFU uses; their sum
    is ``hardware_flops_per_token``.

Communication: bytes one rank sends per optimizer step; c = 4 bytes for fp32, else 2 (mxfp8 dispatches bf16)
    all-to-all per MoE block and microbatch: 4 * T * k * D * c * (ep - 1) / ep * pad
        (dispatch and combine, forward and backward; pad = cf for no-sync dispatch, whose fixed-size
         capacity buffers travel whole, 1 for sync dispatch, which sends exact balanced counts),
        6 * T * k * D * c * (ep - 1) / ep * pad for a fully recomputed block (the forward's again)
    data parallel (reported as comm_grad_reduce_bytes), with ring collectives r(n) = (n - 1) / n;
    G at the gradient buffer's dtype (fsdp: fp32, its reduce dtype), P at the parameters':
        ddp:           2 r(dp) G_dense + 2 r(edp) G_exp          (ring all-reduce once per step)
        ddp + zero1:   r(dp) (G_dense + P_dense) + r(edp) (G_exp + P_exp)
                       (reduce-scatter of grads + all-gather of updated params)
        fsdp:          r(dp) (G_dense + 2 m P_dense) + r(edp) (G_exp + 2 m P_exp)
                       (params all-gathered in forward and backward of every microbatch, grads
                        reduce-scattered once per step)
    pipeline: T * D * a per chunk boundary and microbatch, forward (activations) and backward (grads).

Comm buffers memory: one MoE block's all-to-all send + receive buffers, 2 * T * k * D * c * pad (when
ep > 1), plus one pipeline send and one receive buffer 2 * T * D * a (when pp > 1).

Backward workspace: the most the rank's backward holds on top of the activations. Weight gradients
are made whole (in the parameter's dtype) before they are added into their buffers. The largest of
    one MoE block's expert backward: R * a * 4F (gradient of the SwiGLU product, the recomputed
        product, gradient of the pre-activations) + a * (E / ep) * 3 * D * F (the local experts'
        weight gradients), plus what a recompute of the block brought back when that is alive
        during it (full recompute: the whole block; selective experts: the experts' share);
    what a recomputed block's recompute brings back (selective attention or norms: one part);
        on the last stage both less the LM head's activations of the microbatch (its backward ran
        first and freed them);
    on the last stage, the cross-entropy's backward, 8 * T * V (fp32 gradients of the
        log-probabilities and of the logits), and the LM head's, a * T * V + a * V * D (the logits'
        gradient and the weight gradient);
    on the first stage, the embedding's gradient, a * V * D.

Optimizer step (ddp): the engine updates one gradient bucket at a time. A bucket holds whole
parameters of one family until it reaches bucket_elements (default 2^22), so the largest bucket
share is S = min(family elements, max(bucket_elements, largest tensor)) / (n with zero1, else 1),
n = dp for dense parameters and edp for experts; the step holds (t + 8) * S bytes: the fp32 copy of
the gradients when the buffer is not fp32 (t = 4 for bf16 or mxfp8 with grad_dtype param; 0
otherwise) and two fp32 temporaries of AdamW's per-tensor update.

Checkpoint bytes (what ``moe_engine.checkpoint`` hands torch.distributed.checkpoint, DCP)
    buffers format (every layout but fsdp): each parameter in its own dtype (``model/``), an fp32
        master of each parameter that is not fp32 (``optim/master/``: none in fp32, none for routers)
        and the two fp32 Adam moments (``optim/exp_avg/``, ``optim/exp_avg_sq/``): the param +
        optimizer bytes of the table above, P + O; plus each MoE block's fp32 router expert_bias
        buffer, 4 * E bytes.
    fsdp (``fsdp2`` format): fp32 parameter shards (FSDP's masters are the parameters) and the two
        fp32 moments, no separate master: 4 + 8 bytes per parameter, plus the expert biases.
    The small pickled entries (step, lr, routing stream states, run progress) count as 0.
    DCP writes a replicated tensor once: a stage's ranks hold its dense parameters (replicated over
    dp) and all E of its experts (E / ep on each rank, replicated over edp), so the stage writes
    C_stage = (P + O)(dense + E * experts of its blocks) + 4 * E * (its MoE blocks), and DCP's
    deduplication (each duplicated item to the rank with the fewest planned bytes so far) spreads it
    over the stage's dp ranks: per rank ceil(C_stage / dp), the largest over the stages reported;
    total = the sum of C_stage over the stages, which does not depend on the layout.

memory_total = params + grads + optimizer + max(activations + comm buffers + backward workspace,
optimizer step); activations are freed before the optimizer step runs. It fits when it is at most the
GPU's memory (no allowance for the CUDA context or allocator fragmentation).

Any scenario has a plan: a plan scenario's, a proxy scenario's (the whole layout at the scenario's own
sizes, not the proxy's CPU scale-down) and an execute scenario's. The GPU memory is the ``cluster``
section's; a scenario without one (an execute scenario may leave it out) gets its per-rank memory
without a fraction and ``fits`` None: ``moe-bench run`` compares it with the device it runs on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bench.results import metric
from moe_engine.config import ModelConfig, RecomputeConfig, RecomputeMode, RecomputePart
from moe_engine.flops import parameter_counts, recompute_flops_per_token, training_flops_per_token
from moe_engine.parallel.layout import stage_blocks, stage_layers

__all__ = [
    "BYTES", "PrecisionBytes", "in_flight_microbatches", "kv_bytes_per_token", "plan_scenario", "precision_bytes",
    "stage_layers", "summary_line",
]


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes of one element of each kind of tensor under a precision."""

    param: int
    """A (non-router) parameter."""
    grad: int
    """Its gradient, as the gradient buffer holds it."""
    optimizer: int
    """Its optimizer state (fp32 master copy when the parameter is low precision, Adam m and v)."""
    activation: float
    """A saved activation, a pipeline message element."""
    expert_input: float
    """A saved input of an expert GEMM (gathered tokens, SwiGLU product)."""
    comm: int
    """An all-to-all element."""
    optimizer_step_temp: int
    """fp32 copy of a gradient made for the optimizer step (0 when the gradient buffer is already fp32)."""


BYTES = {
    "fp32": PrecisionBytes(param=4, grad=4, optimizer=8, activation=4, expert_input=4, comm=4, optimizer_step_temp=0),
    "bf16": PrecisionBytes(param=2, grad=2, optimizer=12, activation=2, expert_input=2, comm=2, optimizer_step_temp=4),
    "mxfp8": PrecisionBytes(
        param=2, grad=2, optimizer=12, activation=2, expert_input=1 + 1 / 32, comm=2, optimizer_step_temp=4
    ),
}
"""Bytes by precision with gradient buffers in the parameters' dtype (``grad_dtype: param``)."""
ROUTER_BYTES = PrecisionBytes(param=4, grad=4, optimizer=8, activation=4, expert_input=4, comm=4, optimizer_step_temp=0)
"""The router is fp32 whatever the precision, and is its own optimizer master."""
FP32_GRAD_BYTES = 4
"""An element of an fp32 gradient buffer (``grad_dtype: fp32``), or of what FSDP reduces."""


def precision_bytes(precision: str, grad_dtype: str = "fp32", dp_mode: str = "ddp") -> PrecisionBytes:
    """``BYTES[precision]`` with the gradients in the buffers ``grad_dtype`` asks for.

    fp32 buffers hold 4 bytes per gradient and need no fp32 copy for the optimizer step. FSDP has no
    DDP buffers: it keeps the same 16 bytes per parameter whatever grad_dtype (see the module docstring).
    """
    b = BYTES[precision]
    if grad_dtype == "fp32" and dp_mode != "fsdp":
        return dataclasses.replace(b, grad=FP32_GRAD_BYTES, optimizer_step_temp=0)
    return b


@dataclass(frozen=True)
class Params:
    """A parameter count split by storage: low-precision (model dtype) and fp32 (router)."""

    lowp: int = 0
    fp32: int = 0

    def __add__(self, other: "Params") -> "Params":
        return Params(self.lowp + other.lowp, self.fp32 + other.fp32)

    def __mul__(self, n: int) -> "Params":
        return Params(self.lowp * n, self.fp32 * n)

    @property
    def count(self) -> int:
        return self.lowp + self.fp32

    def nbytes(self, b: PrecisionBytes, kind: str) -> int:
        """Bytes of ``kind`` ("param", "grad" or "optimizer") for these parameters."""
        return self.lowp * getattr(b, kind) + self.fp32 * getattr(ROUTER_BYTES, kind)


@dataclass(frozen=True)
class _Pieces:
    """Parameters of each repeated piece of the model, derived from ``parameter_counts``."""

    embedding: Params
    head: Params
    """Final norm + LM head."""
    block: Params
    """Attention projections and the block's norms (every block)."""
    dense_ffn: Params
    moe_dense: Params
    """Router (fp32) and shared expert of an MoE block."""
    expert: Params
    """One routed expert."""


def _pieces(model: ModelConfig) -> _Pieces:
    counts = parameter_counts(model)
    grown = parameter_counts(dataclasses.replace(model, n_layers=model.n_layers + 1))
    block_norms = grown.norms - counts.norms
    final_norm = counts.norms - model.n_layers * block_norms
    n_moe, n_dense = model.n_moe_layers, model.n_dense_ffn_layers
    return _Pieces(
        embedding=Params(counts.embedding),
        head=Params(counts.lm_head + final_norm),
        block=Params(counts.attention // model.n_layers + block_norms),
        dense_ffn=Params(counts.dense_ffn // n_dense if n_dense else 0),
        moe_dense=Params(counts.shared_expert // n_moe, counts.router // n_moe) if n_moe else Params(),
        expert=Params(counts.experts // (n_moe * model.moe.num_experts) if n_moe else 0),
    )


def in_flight_microbatches(schedule: str, pp: int, virtual_stages: int, microbatches: int, rank: int) -> float:
    """Whole-rank microbatches whose activations rank ``rank`` holds at its peak (see the module docstring)."""
    v, m = virtual_stages, microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        chunks = m * v
    elif schedule == "1f1b":
        chunks = min(m, pp - rank) * v
    else:
        chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return chunks / v


def _ring(n: int) -> float:
    return (n - 1) / n


def _ceil_div(a: int, n: int) -> int:
    return -(-a // n)


# ---- activations ------------------------------------------------------------------------------


def _norm_activation_bytes(width: int, tokens: int, b: PrecisionBytes) -> float:
    """An RMSNorm saves its input in fp32 (a copy; in fp32 the input itself) and the normalised values.
    Its output is counted where a consumer saves it."""
    return tokens * width * (4 + b.activation)


def _mla_attention_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """What multi-head latent attention saves (the module docstring's MLA ``attn``)."""
    mla, a, heads = model.mla, b.activation, model.n_heads
    qk, v = mla.qk_head_dim, mla.v_head_dim
    width = max(qk, v)
    saved = 0.0
    if mla.q_lora_rank is not None:
        saved += _norm_activation_bytes(mla.q_lora_rank, tokens, b) + a * tokens * mla.q_lora_rank
    saved += _norm_activation_bytes(mla.kv_lora_rank, tokens, b) + a * tokens * mla.kv_lora_rank
    if a == 4:
        # The latent's norm saves its fp32 input as is: a view of kv_a's output, RoPE key included.
        saved += 4 * tokens * mla.qk_rope_head_dim
    value = width if v < width else mla.qk_nope_head_dim + v
    saved += a * tokens * heads * (2 * width + value + width) + 4 * tokens * heads
    if v < width:
        saved += a * tokens * heads * v
    return saved


def kv_bytes_per_token(model: ModelConfig, b: PrecisionBytes) -> dict[str, float]:
    """Key and value bytes per token and block: what attention materialises for its kernel, and what
    an inference cache would hold (MLA: the latent and the shared RoPE key; GQA: the k and v heads)."""
    a = b.activation
    if model.mla is None:
        kv = 2 * model.n_kv_heads * model.head_dim * a
        return {"attention": kv, "cache": kv}
    mla = model.mla
    width = max(mla.qk_head_dim, mla.v_head_dim)
    return {"attention": 2 * model.n_heads * width * a, "cache": (mla.kv_lora_rank + mla.qk_rope_head_dim) * a}


def _attention_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """What the attention module saves (``attn``): what selective attention recompute drops."""
    if model.mla is not None:
        return _mla_attention_bytes(model, tokens, b)
    q = model.n_heads * model.head_dim
    kv = model.n_kv_heads * model.head_dim
    # q_norm and k_norm: their outputs feed RoPE, which saves only its cos/sin tables.
    qk_norm = _norm_activation_bytes(q + kv, tokens, b) if model.qk_norm else 0
    if model.qk_norm_per_head:
        # Normalised per head, the norms' fp32 statistics are one value per head and token: as many as
        # the log-sum-exp, too many to leave out.
        qk_norm += 4 * tokens * (model.n_heads + model.n_kv_heads)
    # q and k after RoPE, v, and the attention output (saved by the kernel); o_proj's input is a view
    # of the output, which the kernel lays out (B, S, H, d); the fp32 log-sum-exp.
    return qk_norm + b.activation * tokens * (2 * q + 2 * kv) + 4 * tokens * model.n_heads


def _swiglu_activation_bytes(hidden: int, tokens: int, b: PrecisionBytes) -> float:
    """gate, up, silu(gate) and the product (the down projection's input)."""
    return b.activation * tokens * 4 * hidden


def _expert_rows(tokens: int, model: ModelConfig, par: dict[str, Any]) -> float:
    """Rows the local experts process per microbatch: the capacity buffers under no-sync dispatch."""
    assignments = tokens * model.moe.top_k
    return assignments * (_dispatch_pad(par) if par["ep"] > 1 else 1.0)


@dataclass(frozen=True)
class _BlockActivations:
    """What one block holds for backward per microbatch, and what its recompute brings back."""

    kept: float
    """Bytes it keeps from its forward to its backward."""
    recompute_peak: float = 0.0
    """The most bytes its recompute brings back at once in backward (0 when it is not recomputed)."""
    during_expert_backward: float = 0.0
    """Of those, the bytes alive while its experts' backward runs (full recompute, selective experts)."""


def _block_activations(
    model: ModelConfig, dense: bool, tokens: int, b: PrecisionBytes, par: dict[str, Any],
    recompute: RecomputeConfig | None,
) -> _BlockActivations:
    """A dense or MoE block's activations (the module docstring's formulas); ``recompute`` None when
    the block is not recomputed."""
    a, d, moe = b.activation, model.d_model, model.moe
    norm = _norm_activation_bytes(d, tokens, b)
    # One (T, D) tensor in the model dtype: a norm's output, or the input a checkpoint of a block or
    # of a norm keeps.
    td = a * tokens * d
    attention = _attention_bytes(model, tokens, b)
    experts = rows = 0.0
    if dense:
        # The FFN's input (the norm's output, which gate and up save) and its SwiGLU.
        ffn = td + _swiglu_activation_bytes(model.dense_hidden, tokens, b)
    else:
        rows = _expert_rows(tokens, model, par)
        experts = rows * b.expert_input * (d + 2 * moe.expert_hidden)
        # The router computes in fp32 and saves its fp32 input (a copy of the norm's output, or the
        # output itself in fp32), its logits and scores; the combine saves the expert outputs.
        ffn = 4 * tokens * d + 2 * 4 * tokens * moe.num_experts + a * tokens * moe.top_k * d
        if moe.shared_expert_hidden:
            # Its projections save the norm's output: in bf16 nothing else does (the router copies it).
            ffn += (td if a < 4 else 0) + _swiglu_activation_bytes(moe.shared_expert_hidden, tokens, b)
    # The attention part: its norm, the norm's output (q, k and v's input) and the attention itself.
    whole = 2 * norm + td + attention + ffn + experts
    if recompute is None:
        return _BlockActivations(whole)
    # In fp32 the first norm saves the block's input itself, the tensor a checkpoint keeps anyway.
    input_is_saved = a == 4
    if recompute.mode is RecomputeMode.FULL:
        back = whole - (td if input_is_saved else 0)
        return _BlockActivations(td, back, 0.0 if dense else back)
    kept, peak, during_experts = whole, 0.0, 0.0
    if RecomputePart.ATTENTION in recompute.parts:
        kept -= attention
        peak = max(peak, attention)
    if RecomputePart.EXPERTS in recompute.parts and not dense:
        # The checkpoint keeps the dispatched rows in the model dtype (bf16 under mxfp8, not fp8).
        kept_rows = rows * a * d
        kept += kept_rows - experts
        # The recomputed forward saves the kept rows again when it saves its input as is (e == a).
        during_experts = experts - (kept_rows if b.expert_input == a else 0)
        peak = max(peak, during_experts)
    if RecomputePart.NORMS in recompute.parts:
        kept -= 2 * (norm - td)
        peak = max(peak, norm - (td if input_is_saved else 0))
    return _BlockActivations(kept, peak, during_experts)


def _backward_workspace_bytes(
    model: ModelConfig, h: _Rank, tokens: int, b: PrecisionBytes, par: dict[str, Any],
    blocks: list[_BlockActivations],
) -> float:
    """The most the rank's backward holds on top of the activations (the module docstring's candidates).

    One MoE block's expert backward holds per row the gradient of the SwiGLU product, the recomputed
    product and the gradient of the pre-activations (4F) next to the local experts' weight gradients
    (made whole before they are added into their buffer), plus what the block's recompute brought
    back if that is still alive; a recomputed block's recompute on its own. A block's backward runs
    after the LM head's, whose saved tensors of that microbatch are freed by then. The head's own
    backward: the cross-entropy's fp32 gradients of the log-probabilities and of the logits, then the
    logits' gradient next to the LM head's weight gradient; the embedding's gradient, V x D.
    """
    moe, a, v, d = model.moe, b.activation, model.vocab_size, model.d_model
    in_blocks = [block.recompute_peak for block in blocks]
    if h.n_moe:
        rows = _expert_rows(tokens, model, par) * a * 4 * moe.expert_hidden
        experts = rows + a * (moe.num_experts // par["ep"]) * 3 * d * moe.expert_hidden
        in_blocks.append(experts + max(block.during_expert_backward for block in blocks))
    freed = _head_activation_bytes(model, tokens, b) if h.head else 0.0
    candidates = [0.0] + [max(0.0, c - freed) for c in in_blocks]
    if h.head:
        candidates += [2 * 4 * tokens * v, a * tokens * v + a * v * d]
    if h.embedding:
        candidates.append(a * v * d)
    return max(candidates)


def _head_activation_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """The final norm, its output (the LM head's input) and the fp32 log-probabilities the cross-entropy saves."""
    return (_norm_activation_bytes(model.d_model, tokens, b) + b.activation * tokens * model.d_model
            + 4 * tokens * model.vocab_size)


# ---- one pipeline rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rank:
    """What pipeline rank ``rank`` holds: its blocks, parameters and FSDP units."""

    rank: int
    layers: list[int]
    n_dense: int
    n_moe: int
    embedding: bool
    head: bool
    dense: Params
    experts: Params
    """Unsharded parameters of its E/ep local experts, over all its MoE blocks."""
    units: tuple[Params, ...]
    """Its distinct FSDP units: a dense block, an MoE block with its local experts, embedding, head."""

    def largest_unit_bytes(self, b: PrecisionBytes, kind: str) -> int:
        return max((u.nbytes(b, kind) for u in self.units), default=0)


def _rank_holdings(model: ModelConfig, pieces: _Pieces, layers: list[int], rank: int, pp: int, ep: int) -> _Rank:
    n_dense = sum(1 for i in layers if not model.is_moe_layer(i))
    n_moe = len(layers) - n_dense
    local_experts = pieces.expert * (model.moe.num_experts // ep)
    dense = pieces.block * len(layers) + pieces.dense_ffn * n_dense + pieces.moe_dense * n_moe
    units = [pieces.block + pieces.dense_ffn] * min(n_dense, 1)
    units += [pieces.block + pieces.moe_dense + local_experts] * min(n_moe, 1)
    if rank == 0:
        dense, units = dense + pieces.embedding, units + [pieces.embedding]
    if rank == pp - 1:
        dense, units = dense + pieces.head, units + [pieces.head]
    return _Rank(
        rank=rank, layers=layers, n_dense=n_dense, n_moe=n_moe, embedding=rank == 0, head=rank == pp - 1,
        dense=dense, experts=local_experts * n_moe, units=tuple(units),
    )


def _state_memory(h: _Rank, b: PrecisionBytes, par: dict[str, Any]) -> dict[str, int]:
    dp, edp = par["dp"], par["dp"] // par["ep"]
    sharded = par["dp_mode"] == "fsdp" or par["optimizer_sharding"] == "zero1"
    out = {
        "optimizer_dense": _ceil_div(h.dense.nbytes(b, "optimizer"), dp if sharded else 1),
        "optimizer_experts": _ceil_div(h.experts.nbytes(b, "optimizer"), edp if sharded else 1),
    }
    out["optimizer"] = out["optimizer_dense"] + out["optimizer_experts"]
    for kind, key in (("param", "params"), ("grad", "grads")):
        dense, experts = h.dense.nbytes(b, kind), h.experts.nbytes(b, kind)
        if par["dp_mode"] == "fsdp":
            gathered = h.largest_unit_bytes(b, kind)
            out[f"gathered_unit_{key}"] = gathered
            out[key] = _ceil_div(dense, dp) + _ceil_div(experts, edp) + gathered
        else:
            out[key] = dense + experts
    if par["dp_mode"] == "ddp" and par["optimizer_sharding"] == "zero1":
        # The reduce-scatter writes this rank's share of each bucket into a buffer of its own.
        shards = sum(_ceil_div(p.nbytes(b, "grad"), n) for p, n in ((h.dense, dp), (h.experts, edp)) if n > 1)
        out["grad_shards"] = shards
        out["grads"] += shards
    return out


def _checkpoint_bytes(model: ModelConfig, h: _Rank, precision: str, par: dict[str, Any]) -> int:
    """Bytes a DCP checkpoint holds for pipeline stage ``h``, each replicated tensor once (module docstring).

    The buffers format stores each parameter in its dtype plus its optimizer state (fp32 master when
    it is not fp32, Adam m and v): the param + optimizer bytes of ``BYTES[precision]`` (the router's
    ``ROUTER_BYTES``). FSDP stores fp32 parameter shards and the moments: ``BYTES["fp32"]``'s.
    """
    b = BYTES["fp32"] if par["dp_mode"] == "fsdp" else BYTES[precision]
    # The stage's ranks hold all of its blocks' experts: E / ep each, over the ep ranks.
    stage = h.dense + h.experts * par["ep"]
    expert_bias = ROUTER_BYTES.param * model.moe.num_experts * h.n_moe
    return stage.nbytes(b, "param") + stage.nbytes(b, "optimizer") + expert_bias


def _checkpoint_counted(par: dict[str, Any]) -> str:
    if par["dp_mode"] == "fsdp":
        what = ("fsdp2 format: fp32 parameter shards (FSDP's masters) and fp32 Adam m and v, no separate "
                "master")
    else:
        what = ("buffers format: parameters in their dtype (routers fp32), an fp32 master of each non-fp32 "
                "parameter, fp32 Adam m and v")
    return (what + ", plus the routers' fp32 expert_bias buffers; each replicated tensor written once, a stage's "
            "bytes spread evenly over its dp ranks (DCP's dedup); step, lr, routing and run-progress entries "
            "counted as 0")


def _optimizer_step_bytes(model: ModelConfig, h: _Rank, b: PrecisionBytes, par: dict[str, Any]) -> int:
    """Transient bytes of the DDP optimizer step, which updates one gradient bucket at a time."""
    if par["dp_mode"] == "fsdp":
        return 0
    dp, edp = par["dp"], par["dp"] // par["ep"]
    sharded = par["optimizer_sharding"] == "zero1"
    d, cap = model.d_model, par.get("bucket_elements", 2**22)
    dense_tensors = [*_attention_matrices(model), d * model.moe.shared_expert_hidden, d * model.dense_hidden]
    if h.embedding or h.head:
        dense_tensors.append(model.vocab_size * d)
    expert_tensor = (model.moe.num_experts // par["ep"]) * 2 * model.moe.expert_hidden * d
    share = 0.0
    for total, largest, n in ((h.dense.count, max(dense_tensors), dp), (h.experts.count, expert_tensor, edp)):
        if total:
            share = max(share, min(total, max(cap, largest)) / (n if sharded else 1))
    return int((b.optimizer_step_temp + 8) * share)


def _attention_matrices(model: ModelConfig) -> list[int]:
    """Elements of each of a block's attention weight matrices."""
    d, heads, mla = model.d_model, model.n_heads, model.mla
    if mla is None:
        q, kv = heads * model.head_dim, model.n_kv_heads * model.head_dim
        return [d * q, d * kv, d * kv, q * d]
    q_out = heads * mla.qk_head_dim
    q = [d * q_out] if mla.q_lora_rank is None else [d * mla.q_lora_rank, mla.q_lora_rank * q_out]
    kv = [d * (mla.kv_lora_rank + mla.qk_rope_head_dim), mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)]
    return q + kv + [heads * mla.v_head_dim * d]


def _dispatch_pad(par: dict[str, Any]) -> float:
    return par["capacity_factor"] if par["dispatch"] == "no-sync" else 1.0


def _all_to_all_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes, par: dict[str, Any], full: bool) -> float:
    """Bytes one rank sends for one MoE block and one microbatch (dispatch + combine, fwd + bwd; the
    forward's pair again when the block is recomputed in ``full``)."""
    ep = par["ep"]
    messages = 6 if full else 4
    return messages * tokens * model.moe.top_k * model.d_model * b.comm * _ring(ep) * _dispatch_pad(par)


def _grad_reduce_bytes(h: _Rank, b: PrecisionBytes, par: dict[str, Any]) -> float:
    dp, edp, m = par["dp"], par["dp"] // par["ep"], par["microbatches"]
    total = 0.0
    for params, n in ((h.dense, dp), (h.experts, edp)):
        g, p = params.nbytes(b, "grad"), params.nbytes(b, "param")
        if par["dp_mode"] == "fsdp":
            # FSDP reduce-scatters in fp32 (its reduce dtype), whatever grad_dtype says.
            g = FP32_GRAD_BYTES * params.count
            total += _ring(n) * (g + 2 * m * p)
        elif par["optimizer_sharding"] == "zero1":
            total += _ring(n) * (g + p)
        else:
            total += 2 * _ring(n) * g
    return total


def _pipeline_sends(rank: int, pp: int, v: int) -> int:
    """Messages one microbatch makes rank ``rank`` send: forward out of non-last chunks, grads out of non-first."""
    chunks = range(rank, pp * v, pp)
    return sum(1 for c in chunks if c < pp * v - 1) + sum(1 for c in chunks if c > 0)


def _plan_rank(
    model: ModelConfig, h: _Rank, b: PrecisionBytes, par: dict[str, Any], tokens: int,
    recompute: RecomputeConfig, recomputed: set[int],
) -> dict[str, Any]:
    pp, v, m, ep = par["pp"], par["virtual_stages"], par["microbatches"], par["ep"]
    blocks = [
        _block_activations(model, not model.is_moe_layer(i), tokens, b, par, recompute if i in recomputed else None)
        for i in h.layers
    ]
    per_mb = sum(block.kept for block in blocks) + (_head_activation_bytes(model, tokens, b) if h.head else 0)
    full = recompute.mode is RecomputeMode.FULL
    n_moe_full = sum(1 for i in h.layers if i in recomputed and model.is_moe_layer(i)) if full else 0
    in_flight = in_flight_microbatches(par["schedule"], pp, v, m, h.rank)
    a2a_buffer = 2 * tokens * model.moe.top_k * model.d_model * b.comm * _dispatch_pad(par) if ep > 1 else 0
    pipe_buffer = 2 * tokens * model.d_model * b.activation if pp > 1 else 0
    memory = _state_memory(h, b, par)
    memory.update(
        activations=per_mb * in_flight,
        comm_buffers=a2a_buffer + pipe_buffer,
        backward_workspace=_backward_workspace_bytes(model, h, tokens, b, par, blocks),
        optimizer_step=_optimizer_step_bytes(model, h, b, par),
        # The most one recompute brings back at once (one of the backward workspace's candidates).
        recompute_peak=max((block.recompute_peak for block in blocks), default=0.0),
    )
    # Activations and communication buffers are freed before the optimizer step runs.
    transient = max(
        memory["activations"] + memory["comm_buffers"] + memory["backward_workspace"], memory["optimizer_step"]
    )
    memory["total"] = sum(memory[k] for k in ("params", "grads", "optimizer")) + transient
    comm = {
        "all_to_all": m * ((h.n_moe - n_moe_full) * _all_to_all_bytes(model, tokens, b, par, full=False)
                           + n_moe_full * _all_to_all_bytes(model, tokens, b, par, full=True)),
        "grad_reduce": _grad_reduce_bytes(h, b, par),
        "pipeline": _pipeline_sends(h.rank, pp, v) * m * tokens * model.d_model * b.activation,
    }
    comm["total"] = comm["all_to_all"] + comm["grad_reduce"] + comm["pipeline"]
    return {
        "pipeline_rank": h.rank,
        "layers": h.layers,
        "n_dense_layers": h.n_dense,
        "n_moe_layers": h.n_moe,
        "recomputed_layers": [i for i in h.layers if i in recomputed],
        "embedding": h.embedding,
        "lm_head": h.head,
        "dense_params": h.dense.count,
        "router_params": h.dense.fp32,
        "local_expert_params": h.experts.count,
        "activations_per_microbatch_bytes": per_mb,
        # Keys and values of the rank's blocks per microbatch: as attention materialises them, and as
        # an inference cache would hold them (the MLA latent).
        "attention_kv_bytes_per_microbatch": len(h.layers) * tokens * kv_bytes_per_token(model, b)["attention"],
        "kv_cache_bytes_per_token": len(h.layers) * kv_bytes_per_token(model, b)["cache"],
        "in_flight_microbatches": in_flight,
        "all_to_all_buffer_bytes": a2a_buffer,
        "pipeline_buffer_bytes": pipe_buffer,
        "memory_bytes": memory,
        "comm_bytes": comm,
    }


# ---- the scenario -----------------------------------------------------------------------------


def _layout(scenario, layers_per_rank: int, tokens: int) -> dict[str, Any]:
    par = scenario.parallel
    return {
        "world_size": scenario.world_size,
        "dp": par["dp"],
        "ep": par["ep"],
        "pp": par["pp"],
        "edp": par["dp"] // par["ep"],
        "virtual_stages": par["virtual_stages"],
        "schedule": par["schedule"],
        "microbatches": par["microbatches"],
        "dp_mode": par["dp_mode"],
        "optimizer_sharding": par["optimizer_sharding"],
        "dispatch": par["dispatch"],
        "capacity_factor": par["capacity_factor"],
        "grad_dtype": par["grad_dtype"],
        "layers_per_rank": layers_per_rank,
        "local_experts": scenario.model.moe.num_experts // par["ep"],
        "tokens_per_microbatch_per_rank": tokens,
    }


def _gradients(scenario) -> str:
    par = scenario.parallel
    if par["dp_mode"] == "fsdp":
        return ("fsdp keeps its own gradients whatever grad_dtype (sharded, reduce-scattered in fp32), priced "
                "with the parameters' bytes as the same 16 bytes per parameter")
    if par["grad_dtype"] == "fp32":
        return ("gradient buffers in fp32 (grad_dtype fp32): each backward's gradient is added into them, and the "
                "data-parallel reduction sends fp32")
    return "gradient buffers in the parameters' dtype (grad_dtype param), reduced in it"


def _recompute_assumption(scenario) -> str:
    recompute = scenario.recompute
    if not recompute.enabled:
        return ("activations: tensors saved for backward with flash attention and no recomputation "
                "(see bench/predict/plan.py); routing indices, norms' statistics and other small tensors are ignored")
    subset = (f"the first {recompute.first_per_stage} blocks of each pipeline chunk" if recompute.first_per_stage
              else "every block" if recompute.every == 1 else f"every block whose index is a multiple of {recompute.every}")
    what = ("each block keeps only its input; its forward (all-to-alls included) runs again in backward"
            if recompute.mode is RecomputeMode.FULL else
            "the named parts (" + ", ".join(p.value for p in recompute.parts) + ") keep only their inputs and run "
            "again in backward")
    return (f"activations: recompute {recompute.mode.value} on {subset}: {what}; one block's (or part's) "
            "recomputed activations are counted in the backward workspace; recompute FLOPs are reported apart "
            "(recompute_flops_per_token), model FLOPs leave them out; routing indices, norms' statistics and "
            "other small tensors are ignored")


def _assumptions(scenario) -> list[str]:
    precision, par = scenario.precision, scenario.parallel
    b = precision_bytes(precision, par["grad_dtype"], par["dp_mode"])
    out = [
        f"precision {precision}: {b.param} bytes per parameter, {b.grad} per gradient, {b.optimizer} of optimizer "
        + ("state (Adam m, v)" if precision == "fp32" else "state (fp32 master, Adam m, v)"),
        _gradients(scenario),
        "the router is fp32 in every precision: 4 bytes per parameter, 4 per gradient, 8 of optimizer state "
        "(it is its own master)",
        "pipeline chunks split the blocks contiguously, earlier chunks taking the remainder; the embedding sits on "
        "the first stage, the final norm and LM head on the last; the most loaded stage is reported",
        "routing is balanced: every rank receives tokens * top_k expert assignments per microbatch",
        "dense parameters are replicated over dp, expert parameters sharded over ep and replicated over edp = dp/ep",
        _recompute_assumption(scenario),
        "the LM head keeps fp32 logits (4 bytes x tokens x vocab) for the cross-entropy backward",
        "in-flight microbatches: 1 without pipelining, all of them for GPipe, pp - rank for 1F1B, Megatron's "
        "warm-up count + 1 for interleaved 1F1B",
        "all-to-all: dispatch + combine, forward + backward, only the (ep-1)/ep share that leaves the rank; "
        f"elements of {b.comm} bytes" + (" (mxfp8 still dispatches bf16)" if precision == "mxfp8" else ""),
        "ring collectives: each rank sends (n-1)/n of the buffer per reduce-scatter or all-gather, twice that per "
        "all-reduce; gradients are reduced once per step (no overlap, no compression)",
        "pipeline: one activation tensor forward and one gradient backward of tokens x d_model per chunk boundary",
        "fits compares the total with the GPU's memory, leaving nothing for the CUDA context or fragmentation"
        if scenario.cluster else
        "no cluster section: the per-rank memory is not compared with a GPU's (moe-bench run compares it with "
        "the device it runs on before starting)",
    ]
    if precision == "mxfp8":
        out.append("mxfp8: saved expert-GEMM inputs (gathered tokens, SwiGLU product) take 1 byte + 1/32 scale "
                   "byte per element; weights, gradients and other activations stay bf16; quantised weight "
                   "copies are transient and not counted")
    if par["dispatch"] == "no-sync":
        out.append(f"no-sync dispatch: send and receive buffers are capacity_factor ({par['capacity_factor']}) x the "
                   "balanced load and travel whole; comm buffers count one MoE block's send + receive buffers")
    else:
        out.append("sync dispatch: exact (balanced) counts are sent; comm buffers count one MoE block's send + "
                   "receive buffers")
    if par["dp_mode"] == "fsdp":
        out.append("fsdp: params, grads and optimizer state sharded over dp (experts over edp inside their ep "
                   "group, i.e. the stage's experts over dp); one gathered unit (largest block with its local "
                   "experts, embedding or head) counted in params and grads; params all-gathered in forward and "
                   "backward of every microbatch, grads reduce-scattered once per step")
    elif par["optimizer_sharding"] == "zero1":
        out.append("zero1: optimizer state sharded over dp (dense) and edp (experts); gradients reduce-scattered "
                   "and updated parameters all-gathered, the same bytes as an all-reduce when params and grads "
                   "share a dtype")
    return out


_MEMORY = ("params", "grads", "optimizer", "activations", "comm_buffers", "backward_workspace", "optimizer_step", "total")
_COMM = ("all_to_all", "grad_reduce", "pipeline", "total")


def plan_scenario(scenario) -> tuple[dict[str, dict], dict]:
    """Metrics (single-sample ``bench.results.metric`` entries) and details of any scenario's layout.

    ``memory_fraction_of_gpu`` and a boolean ``fits`` need the scenario's ``cluster`` section; without
    one the plan has neither (``details["fits"]`` is None).
    """
    model, par, cluster, recompute = scenario.model, scenario.parallel, scenario.cluster, scenario.recompute
    b = precision_bytes(scenario.precision, par["grad_dtype"], par["dp_mode"])
    tokens = scenario.run["tokens_per_step"] // par["dp"] // par["microbatches"]
    pieces = _pieces(model)
    split = stage_layers(model.n_layers, par["pp"], par["virtual_stages"])
    # The engine picks the recomputed blocks over the pp * v chunks (``prepare_blocks``).
    chunks = stage_blocks(model.n_layers, par["pp"] * par["virtual_stages"])
    recomputed = set(recompute.blocks(chunks))
    holdings = [_rank_holdings(model, pieces, layers, r, par["pp"], par["ep"]) for r, layers in enumerate(split)]
    ranks = [_plan_rank(model, h, b, par, tokens, recompute, recomputed) for h in holdings]
    checkpoint_stages = [_checkpoint_bytes(model, h, scenario.precision, par) for h in holdings]
    by_memory = max(ranks, key=lambda r: r["memory_bytes"]["total"])
    by_comm = max(ranks, key=lambda r: r["comm_bytes"]["total"])
    counts = parameter_counts(model)
    gpu_bytes = cluster["gpu_memory_gib"] * 2**30 if cluster else None
    total = by_memory["memory_bytes"]["total"]

    model_flops = training_flops_per_token(model)
    recompute_flops = recompute_flops_per_token(model, recompute, chunks)
    metrics = {
        "total_params": metric([counts.total], "params", None),
        "active_params": metric([counts.active], "params", None),
        # Model FLOPs (what MFU counts), the recompute's apart, and their sum (what the GPUs run).
        "flops_per_token": metric([model_flops], "FLOP", None),
        "recompute_flops_per_token": metric([recompute_flops], "FLOP", None),
        "hardware_flops_per_token": metric([model_flops + recompute_flops], "FLOP", None),
    }
    for key in _MEMORY:
        metrics[f"memory_{key}_bytes"] = metric([by_memory["memory_bytes"][key]], "bytes", "lower")
    for key in _COMM:
        metrics[f"comm_{key}_bytes"] = metric([by_comm["comm_bytes"][key]], "bytes", "lower")
    if gpu_bytes:
        metrics["memory_fraction_of_gpu"] = metric([total / gpu_bytes], "ratio", "lower")
    metrics["checkpoint_bytes_per_rank"] = metric(
        [max(_ceil_div(c, par["dp"]) for c in checkpoint_stages)], "bytes", "lower")
    metrics["checkpoint_bytes_total"] = metric([sum(checkpoint_stages)], "bytes", "lower")

    details = {
        "layout": _layout(scenario, len(by_memory["layers"]), tokens),
        "recompute": {**recompute.to_dict(), "blocks": len(recomputed),
                      "flops_fraction_of_model": recompute_flops / model_flops},
        "per_rank": by_memory,
        "most_loaded": {"memory": by_memory["pipeline_rank"], "comm": by_comm["pipeline_rank"]},
        "stages": [
            {"pipeline_rank": r["pipeline_rank"], "layers": len(r["layers"]), "dense_params": r["dense_params"],
             "local_expert_params": r["local_expert_params"], "memory_total_bytes": r["memory_bytes"]["total"],
             "memory_bytes": r["memory_bytes"],
             "comm_total_bytes": r["comm_bytes"]["total"]}
            for r in ranks
        ],
        "checkpoint": {"counted": _checkpoint_counted(par), "stage_bytes": checkpoint_stages},
        "assumptions": _assumptions(scenario),
        "fits": total <= gpu_bytes if gpu_bytes else None,
        "memory_total_gib": total / 2**30,
        "cluster": dict(cluster) if cluster else None,
        "scenario_mode": scenario.mode,
        "engine_runs_layout": _engine_runs(scenario),
    }
    return metrics, details


def _engine_runs(scenario) -> dict[str, Any]:
    """Whether the engine can execute this layout for real (a plan prices layouts it does not run)."""
    try:
        scenario.parallel_config.validate_executable()
    except ValueError as err:
        return {"ok": False, "reason": str(err)}
    return {"ok": True, "reason": None}


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def summary_line(name: str, metrics: dict[str, dict], details: dict[str, Any]) -> str:
    """One line per plan: the counts, the most loaded rank's memory against the GPU's, the traffic, the checkpoint."""
    med = {k: v["median"] for k, v in metrics.items()}
    what = {"plan": name, "execute": f"{name} (of an execute scenario)",
            "proxy": f"{name} (of a proxy scenario: the whole layout at its own sizes)"}[details["scenario_mode"]]
    memory = f"{_bytes(med['memory_total_bytes'])} per rank"
    if details["layout"]["pp"] > 1:
        memory += f" (pipeline rank {details['most_loaded']['memory']})"
    if details["fits"] is None:
        against = "no cluster section: not compared with a GPU's memory (moe-bench run checks the device it runs on)"
    else:
        cluster = details["cluster"]
        against = (f"{med['memory_fraction_of_gpu']:.0%} of {cluster['gpu_memory_gib']:g} GiB per GPU: "
                   + ("fits" if details["fits"] else "DOES NOT FIT"))
    line = (f"{what}: {_count(med['total_params'])} parameters ({_count(med['active_params'])} active), "
            f"{memory}, {against}; sends {_bytes(med['comm_total_bytes'])} per step; checkpoint "
            f"{_bytes(med['checkpoint_bytes_total'])} ({_bytes(med['checkpoint_bytes_per_rank'])} per rank)")
    recompute = details["recompute"]
    if recompute["mode"] != "none":
        mode = recompute["mode"] + (f" ({', '.join(recompute['parts'])})" if recompute["parts"] else "")
        line += (f"; recompute {mode} of {recompute['blocks']} blocks: "
                 f"+{recompute['flops_fraction_of_model']:.1%} FLOPs over the model's")
    runs = details["engine_runs_layout"]
    if not runs["ok"]:
        line += f"; the engine does not execute this layout ({runs['reason']})"
    return line


def _main(argv: list[str] | None = None) -> int:
    """``python -m bench.predict.plan FILE...``: print each plan's headline numbers."""
    import sys

    from bench.scenario import load_scenario

    for path in (sys.argv[1:] if argv is None else argv):
        s = load_scenario(path)
        print(summary_line(s.name, *plan_scenario(s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
