"""``moe-bench plan``: parameters, FLOPs, per-rank memory and per-rank traffic of a layout, by arithmetic.

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

Bytes per parameter (param / grad / optimizer)
    fp32:          4 / 4 / 8  (Adam m and v)
    bf16, mxfp8:   2 / 2 / 12 (bf16 weights and gradients; fp32 master + m + v)
    The router is fp32 in every precision (the engine keeps it so): 4 / 4 / 8 (its own master).

State memory per rank (P = parameter bytes, G = gradient bytes, O = optimizer bytes)
    ddp:           P_dense + P_exp,  G_dense + G_exp,  O_dense + O_exp
    ddp + zero1:   optimizer becomes ceil(O_dense / dp) + ceil(O_exp / edp); gradients gain the
                   reduce-scatter outputs, ceil(G_dense / dp) (when dp > 1) + ceil(G_exp / edp) (when edp > 1)
    fsdp:          every tensor sharded: P_dense / dp + P_exp / edp (= the stage's experts / dp), same for
                   G and O, plus one transient gathered unit: the largest FSDP unit of the rank (a block
                   with its E/ep local experts, the embedding, or final norm + LM head) counted once in
                   params and once in grads (no prefetch of a second unit). The engine's FSDP mode keeps
                   the fp32 master as the sharded parameter and reduces fp32 gradients, a 4/4/8 split of
                   the same 16 bytes per parameter that this 2/2/12 split prices.

Activation memory per rank: A_mb (one microbatch over all the rank's blocks) * in-flight / v
    T = tokens_per_step / dp / m tokens per microbatch per rank; a = activation bytes (4 fp32, 2 otherwise);
    e = bytes of a saved expert-GEMM input element (a; mxfp8: 1 + 1/32, an fp8 value plus one shared
    8-bit scale per 32 elements). The tensors the engine saves for backward (no recomputation but the
    experts' SwiGLU product, flash attention); checked against the saved tensors of a real block:
    RMSNorm over width w:       T * w * (4 + 2a)   (fp32 input, normalised values, output)
    attention part of a block:  norm(D) [+ norm(q + kv) with qk_norm] + a * T * (3q + 2kv) + 4 * T * H
        (q k v after RoPE and the attention output, kept by the kernel; the output's contiguous copy
         that o_proj saves; fp32 log-sum-exp)
    SwiGLU of hidden F:         4 * a * T * F      (gate, up, silu(gate), product)
    dense FFN:                  norm(D) + SwiGLU(F_d)
    MoE FFN:                    norm(D) + [4 * T * D when a < 4: the router's fp32 copy of its input]
                              + 8 * T * E                                 (fp32 logits and scores)
                              + R * e * (D + 2F)                          (expert-GEMM input, gate/up
                                 pre-activations; the SwiGLU product is recomputed in backward)
                              + a * T * k * D                             (expert outputs for combine)
                              + SwiGLU(F_s)                               (shared expert, if any)
        R = T * k rows, or cf * T * k under no-sync dispatch with ep > 1 (the capacity buffers)
    last stage:                 norm(D) + 4 * T * V   (fp32 log-probabilities of the cross-entropy)
    in flight (in chunk-microbatches, divided by v to count whole-rank microbatches), rank r:
        pp = 1:          1 (gradient accumulation frees a microbatch's activations after its backward)
        gpipe:           m * v (every microbatch's forward runs before any backward)
        1f1b:            min(m, pp - r)
        interleaved1f1b: min(m * v, 2 (pp - r - 1) + (v - 1) pp + 1) (Megatron's warm-up count + 1;
                         on rank 0 it is pp*v + pp - 1 chunks, 1F1B's memory times 1 + (pp-1)/(pp v))

Communication: bytes one rank sends per optimizer step; c = 4 bytes for fp32, else 2 (mxfp8 dispatches bf16)
    all-to-all per MoE block and microbatch: 4 * T * k * D * c * (ep - 1) / ep * pad
        (dispatch and combine, forward and backward; pad = cf for no-sync dispatch, whose fixed-size
         capacity buffers travel whole, 1 for sync dispatch, which sends exact balanced counts)
    data parallel (reported as comm_grad_reduce_bytes), with ring collectives r(n) = (n - 1) / n:
        ddp:           2 r(dp) G_dense + 2 r(edp) G_exp          (ring all-reduce once per step)
        ddp + zero1:   r(dp) (G_dense + P_dense) + r(edp) (G_exp + P_exp)
                       (reduce-scatter of grads + all-gather of updated params: an all-reduce's bytes)
        fsdp:          r(dp) (G_dense + 2 m P_dense) + r(edp) (G_exp + 2 m P_exp)
                       (params all-gathered in forward and backward of every microbatch, grads
                        reduce-scattered once per step)
    pipeline: T * D * a per chunk boundary and microbatch, forward (activations) and backward (grads).

Comm buffers memory: one MoE block's all-to-all send + receive buffers, 2 * T * k * D * c * pad (when
ep > 1), plus one pipeline send and one receive buffer 2 * T * D * a (when pp > 1).

Backward workspace: the largest temporary of the rank's backward, as weight gradients are made
whole before they are added into their buffers: one MoE block's expert backward,
R * a * 4F (gradient of the SwiGLU product, the recomputed product, gradient of the pre-activations)
+ a * (E / ep) * 3 * D * F (the local experts' weight gradients), or the embedding's or LM head's
gradient, a * V * D, on the ranks holding them.

Optimizer step (ddp): the engine updates one gradient bucket at a time. A bucket holds whole
parameters of one family until it reaches bucket_elements (default 2^22), so the largest bucket
share is S = min(family elements, max(bucket_elements, largest tensor)) / (n with zero1, else 1),
n = dp for dense parameters and edp for experts; the step holds (t + 8) * S bytes: the fp32 copy of
low-precision gradients (t = 4; 0 for fp32) and two fp32 temporaries of AdamW's per-tensor update.

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
from moe_engine.config import ModelConfig
from moe_engine.flops import parameter_counts, training_flops_per_token
from moe_engine.parallel.layout import stage_layers

__all__ = ["BYTES", "PrecisionBytes", "in_flight_microbatches", "plan_scenario", "stage_layers", "summary_line"]


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes of one element of each kind of tensor under a precision."""

    param: int
    """A (non-router) parameter."""
    grad: int
    """Its gradient."""
    optimizer: int
    """Its optimizer state (fp32 master copy when the parameter is low precision, Adam m and v)."""
    activation: float
    """A saved activation, a pipeline message element."""
    expert_input: float
    """A saved input of an expert GEMM (gathered tokens, SwiGLU product)."""
    comm: int
    """An all-to-all element."""
    optimizer_step_temp: int
    """fp32 copy of a gradient made for the optimizer step (0 when the gradient is already fp32)."""


BYTES = {
    "fp32": PrecisionBytes(param=4, grad=4, optimizer=8, activation=4, expert_input=4, comm=4, optimizer_step_temp=0),
    "bf16": PrecisionBytes(param=2, grad=2, optimizer=12, activation=2, expert_input=2, comm=2, optimizer_step_temp=4),
    "mxfp8": PrecisionBytes(
        param=2, grad=2, optimizer=12, activation=2, expert_input=1 + 1 / 32, comm=2, optimizer_step_temp=4
    ),
}
ROUTER_BYTES = PrecisionBytes(param=4, grad=4, optimizer=8, activation=4, expert_input=4, comm=4, optimizer_step_temp=0)
"""The router is fp32 whatever the precision, and is its own optimizer master."""


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
    n_moe, n_dense = model.n_moe_layers, model.n_dense_layers
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
    """An RMSNorm saves its input in fp32, the normalised values and its output (model dtype)."""
    return tokens * width * (4 + 2 * b.activation)


def _attention_activation_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    q = model.n_heads * model.head_dim
    kv = model.n_kv_heads * model.head_dim
    qk_norm = _norm_activation_bytes(q + kv, tokens, b) if model.qk_norm else 0
    # q, k, v after RoPE and the attention output (saved by the attention kernel), the output's
    # contiguous copy (o_proj's input), the fp32 log-sum-exp.
    saved = b.activation * tokens * (2 * q + 2 * kv + q) + 4 * tokens * model.n_heads
    return _norm_activation_bytes(model.d_model, tokens, b) + qk_norm + saved


def _swiglu_activation_bytes(hidden: int, tokens: int, b: PrecisionBytes) -> float:
    """gate, up, silu(gate) and the product (the down projection's input)."""
    return b.activation * tokens * 4 * hidden


def _dense_ffn_activation_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    return _norm_activation_bytes(model.d_model, tokens, b) + _swiglu_activation_bytes(model.dense_hidden, tokens, b)


def _expert_rows(tokens: int, model: ModelConfig, par: dict[str, Any]) -> float:
    """Rows the local experts process per microbatch: the capacity buffers under no-sync dispatch."""
    assignments = tokens * model.moe.top_k
    return assignments * (_dispatch_pad(par) if par["ep"] > 1 else 1.0)


def _moe_activation_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes, par: dict[str, Any]) -> float:
    d, moe = model.d_model, model.moe
    # The router computes in fp32: a low-precision input is saved as an fp32 copy; logits and scores.
    router = (4 * tokens * d if b.activation < 4 else 0) + 2 * 4 * tokens * moe.num_experts
    experts = _expert_rows(tokens, model, par) * b.expert_input * (d + 2 * moe.expert_hidden)
    combine = b.activation * tokens * moe.top_k * d
    shared = _swiglu_activation_bytes(moe.shared_expert_hidden, tokens, b)
    return _norm_activation_bytes(d, tokens, b) + router + experts + combine + shared


def _backward_workspace_bytes(model: ModelConfig, h: _Rank, tokens: int, b: PrecisionBytes, par: dict[str, Any]) -> float:
    """The largest temporary of the rank's backward: a weight gradient is made whole before it is
    added into its buffer. One MoE block's expert backward holds per row the gradient of the SwiGLU
    product, the recomputed product and the gradient of the pre-activations (4F) next to the local
    experts' weight gradients; the embedding's and LM head's gradients are V x D each."""
    moe = model.moe
    candidates = [0.0]
    if h.n_moe:
        rows = _expert_rows(tokens, model, par) * b.activation * 4 * moe.expert_hidden
        candidates.append(rows + b.activation * (moe.num_experts // par["ep"]) * 3 * model.d_model * moe.expert_hidden)
    if h.embedding or h.head:
        candidates.append(b.activation * model.vocab_size * model.d_model)
    return max(candidates)


def _head_activation_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes) -> float:
    """The final norm, and the fp32 log-probabilities the cross-entropy saves."""
    return _norm_activation_bytes(model.d_model, tokens, b) + 4 * tokens * model.vocab_size


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
    n_dense = sum(1 for i in layers if i < model.n_dense_layers)
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


def _optimizer_step_bytes(model: ModelConfig, h: _Rank, b: PrecisionBytes, par: dict[str, Any]) -> int:
    """Transient bytes of the DDP optimizer step, which updates one gradient bucket at a time."""
    if par["dp_mode"] == "fsdp":
        return 0
    dp, edp = par["dp"], par["dp"] // par["ep"]
    sharded = par["optimizer_sharding"] == "zero1"
    d, cap = model.d_model, par.get("bucket_elements", 2**22)
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    dense_tensors = [d * q, d * kv, d * model.moe.shared_expert_hidden, d * model.dense_hidden]
    if h.embedding or h.head:
        dense_tensors.append(model.vocab_size * d)
    expert_tensor = (model.moe.num_experts // par["ep"]) * 2 * model.moe.expert_hidden * d
    share = 0.0
    for total, largest, n in ((h.dense.count, max(dense_tensors), dp), (h.experts.count, expert_tensor, edp)):
        if total:
            share = max(share, min(total, max(cap, largest)) / (n if sharded else 1))
    return int((b.optimizer_step_temp + 8) * share)


def _dispatch_pad(par: dict[str, Any]) -> float:
    return par["capacity_factor"] if par["dispatch"] == "no-sync" else 1.0


def _all_to_all_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes, par: dict[str, Any]) -> float:
    """Bytes one rank sends for one MoE block and one microbatch (dispatch + combine, fwd + bwd)."""
    ep = par["ep"]
    return 4 * tokens * model.moe.top_k * model.d_model * b.comm * _ring(ep) * _dispatch_pad(par)


def _grad_reduce_bytes(h: _Rank, b: PrecisionBytes, par: dict[str, Any]) -> float:
    dp, edp, m = par["dp"], par["dp"] // par["ep"], par["microbatches"]
    total = 0.0
    for params, n in ((h.dense, dp), (h.experts, edp)):
        g, p = params.nbytes(b, "grad"), params.nbytes(b, "param")
        if par["dp_mode"] == "fsdp":
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


def _plan_rank(model: ModelConfig, h: _Rank, b: PrecisionBytes, par: dict[str, Any], tokens: int) -> dict[str, Any]:
    pp, v, m, ep = par["pp"], par["virtual_stages"], par["microbatches"], par["ep"]
    per_mb = (len(h.layers) * _attention_activation_bytes(model, tokens, b)
              + h.n_dense * _dense_ffn_activation_bytes(model, tokens, b)
              + h.n_moe * _moe_activation_bytes(model, tokens, b, par)
              + (_head_activation_bytes(model, tokens, b) if h.head else 0))
    in_flight = in_flight_microbatches(par["schedule"], pp, v, m, h.rank)
    a2a_buffer = 2 * tokens * model.moe.top_k * model.d_model * b.comm * _dispatch_pad(par) if ep > 1 else 0
    pipe_buffer = 2 * tokens * model.d_model * b.activation if pp > 1 else 0
    memory = _state_memory(h, b, par)
    memory.update(
        activations=per_mb * in_flight,
        comm_buffers=a2a_buffer + pipe_buffer,
        backward_workspace=_backward_workspace_bytes(model, h, tokens, b, par),
        optimizer_step=_optimizer_step_bytes(model, h, b, par),
    )
    # Activations and communication buffers are freed before the optimizer step runs.
    transient = max(
        memory["activations"] + memory["comm_buffers"] + memory["backward_workspace"], memory["optimizer_step"]
    )
    memory["total"] = sum(memory[k] for k in ("params", "grads", "optimizer")) + transient
    comm = {
        "all_to_all": h.n_moe * m * _all_to_all_bytes(model, tokens, b, par),
        "grad_reduce": _grad_reduce_bytes(h, b, par),
        "pipeline": _pipeline_sends(h.rank, pp, v) * m * tokens * model.d_model * b.activation,
    }
    comm["total"] = comm["all_to_all"] + comm["grad_reduce"] + comm["pipeline"]
    return {
        "pipeline_rank": h.rank,
        "layers": h.layers,
        "n_dense_layers": h.n_dense,
        "n_moe_layers": h.n_moe,
        "embedding": h.embedding,
        "lm_head": h.head,
        "dense_params": h.dense.count,
        "router_params": h.dense.fp32,
        "local_expert_params": h.experts.count,
        "activations_per_microbatch_bytes": per_mb,
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
        "layers_per_rank": layers_per_rank,
        "local_experts": scenario.model.moe.num_experts // par["ep"],
        "tokens_per_microbatch_per_rank": tokens,
    }


def _assumptions(scenario) -> list[str]:
    precision, par = scenario.precision, scenario.parallel
    b = BYTES[precision]
    out = [
        f"precision {precision}: {b.param} bytes per parameter, {b.grad} per gradient, {b.optimizer} of optimizer "
        + ("state (Adam m, v)" if precision == "fp32" else "state (fp32 master, Adam m, v); gradients kept in bf16, "
           "not accumulated in fp32"),
        "the router is fp32 in every precision: 4 bytes per parameter, 4 per gradient, 8 of optimizer state "
        "(it is its own master)",
        "pipeline chunks split the blocks contiguously, earlier chunks taking the remainder; the embedding sits on "
        "the first stage, the final norm and LM head on the last; the most loaded stage is reported",
        "routing is balanced: every rank receives tokens * top_k expert assignments per microbatch",
        "dense parameters are replicated over dp, expert parameters sharded over ep and replicated over edp = dp/ep",
        "activations: tensors saved for backward with flash attention and no recomputation "
        "(see bench/predict/plan.py); routing indices, norms' statistics and other small tensors are ignored",
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
    model, par, cluster = scenario.model, scenario.parallel, scenario.cluster
    b = BYTES[scenario.precision]
    tokens = scenario.run["tokens_per_step"] // par["dp"] // par["microbatches"]
    pieces = _pieces(model)
    split = stage_layers(model.n_layers, par["pp"], par["virtual_stages"])
    ranks = [
        _plan_rank(model, _rank_holdings(model, pieces, layers, r, par["pp"], par["ep"]), b, par, tokens)
        for r, layers in enumerate(split)
    ]
    by_memory = max(ranks, key=lambda r: r["memory_bytes"]["total"])
    by_comm = max(ranks, key=lambda r: r["comm_bytes"]["total"])
    counts = parameter_counts(model)
    gpu_bytes = cluster["gpu_memory_gib"] * 2**30 if cluster else None
    total = by_memory["memory_bytes"]["total"]

    metrics = {
        "total_params": metric([counts.total], "params", None),
        "active_params": metric([counts.active], "params", None),
        "flops_per_token": metric([training_flops_per_token(model)], "FLOP", None),
    }
    for key in _MEMORY:
        metrics[f"memory_{key}_bytes"] = metric([by_memory["memory_bytes"][key]], "bytes", "lower")
    for key in _COMM:
        metrics[f"comm_{key}_bytes"] = metric([by_comm["comm_bytes"][key]], "bytes", "lower")
    if gpu_bytes:
        metrics["memory_fraction_of_gpu"] = metric([total / gpu_bytes], "ratio", "lower")

    details = {
        "layout": _layout(scenario, len(by_memory["layers"]), tokens),
        "per_rank": by_memory,
        "most_loaded": {"memory": by_memory["pipeline_rank"], "comm": by_comm["pipeline_rank"]},
        "stages": [
            {"pipeline_rank": r["pipeline_rank"], "layers": len(r["layers"]), "dense_params": r["dense_params"],
             "local_expert_params": r["local_expert_params"], "memory_total_bytes": r["memory_bytes"]["total"],
             "memory_bytes": r["memory_bytes"],
             "comm_total_bytes": r["comm_bytes"]["total"]}
            for r in ranks
        ],
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
    """One line per plan: the counts, the most loaded rank's memory against the GPU's, the traffic."""
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
            f"{memory}, {against}; sends {_bytes(med['comm_total_bytes'])} per step")
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
