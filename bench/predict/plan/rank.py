"""One pipeline rank of a plan: what it holds, its state memory, its traffic and its checkpoint bytes
(``bench.predict.plan``'s notation).

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

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.predict.plan.activations import (
    BlockActivations,
    block_activations,
    dispatch_pad,
    expert_rows,
    gqa_head_dim,
    head_activation_bytes,
    kv_bytes_per_token,
)
from bench.predict.plan.bytes import BYTES, FP32_GRAD_BYTES, ROUTER_BYTES, Params, Pieces, PrecisionBytes
from moe_engine.config import (
    DataParallelMode,
    ModelConfig,
    OptimizerSharding,
    ParallelConfig,
    RecomputeConfig,
    RecomputeMode,
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
    elif schedule == "dualpipev":
        chunks = min(m * v, 2 * pp + 1)
    else:
        chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return chunks / v


def _ring(n: int) -> float:
    return (n - 1) / n


def ceil_div(a: int, n: int) -> int:
    return -(-a // n)


def _backward_workspace_bytes(
    model: ModelConfig,
    h: _Rank,
    tokens: int,
    b: PrecisionBytes,
    par: ParallelConfig,
    blocks: list[BlockActivations],
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
        rows = expert_rows(tokens, model, par) * a * 4 * moe.expert_hidden
        experts = rows + a * (moe.num_experts // par.ep) * 3 * d * moe.expert_hidden
        in_blocks.append(experts + max(block.during_expert_backward for block in blocks))
    freed = head_activation_bytes(model, tokens, b) if h.head else 0.0
    candidates = [0.0] + [max(0.0, c - freed) for c in in_blocks]
    if h.head:
        candidates += [2 * 4 * tokens * v, a * tokens * v + a * v * d]
    if h.embedding:
        candidates.append(a * v * d)
    return max(candidates)


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


def rank_holdings(model: ModelConfig, pieces: Pieces, layers: list[int], rank: int, pp: int, ep: int) -> _Rank:
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
        rank=rank,
        layers=layers,
        n_dense=n_dense,
        n_moe=n_moe,
        embedding=rank == 0,
        head=rank == pp - 1,
        dense=dense,
        experts=local_experts * n_moe,
        units=tuple(units),
    )


def _state_memory(h: _Rank, b: PrecisionBytes, par: ParallelConfig) -> dict[str, int]:
    dp, edp = par.dp, par.edp
    sharded = par.dp_mode is DataParallelMode.FSDP or par.optimizer_sharding is OptimizerSharding.ZERO1
    out = {
        "optimizer_dense": ceil_div(h.dense.nbytes(b, "optimizer"), dp if sharded else 1),
        "optimizer_experts": ceil_div(h.experts.nbytes(b, "optimizer"), edp if sharded else 1),
    }
    out["optimizer"] = out["optimizer_dense"] + out["optimizer_experts"]
    for kind, key in (("param", "params"), ("grad", "grads")):
        dense, experts = h.dense.nbytes(b, kind), h.experts.nbytes(b, kind)
        if par.dp_mode is DataParallelMode.FSDP:
            gathered = h.largest_unit_bytes(b, kind)
            out[f"gathered_unit_{key}"] = gathered
            out[key] = ceil_div(dense, dp) + ceil_div(experts, edp) + gathered
        else:
            out[key] = dense + experts
    if par.dp_mode is DataParallelMode.DDP and par.optimizer_sharding is OptimizerSharding.ZERO1:
        # The reduce-scatter writes this rank's share of each bucket into a buffer of its own.
        shards = sum(ceil_div(p.nbytes(b, "grad"), n) for p, n in ((h.dense, dp), (h.experts, edp)) if n > 1)
        out["grad_shards"] = shards
        out["grads"] += shards
    return out


def checkpoint_bytes(model: ModelConfig, h: _Rank, precision: str, par: ParallelConfig) -> int:
    """Bytes a DCP checkpoint holds for pipeline stage ``h``, each replicated tensor once (module docstring).

    The buffers format stores each parameter in its dtype plus its optimizer state (fp32 master when
    it is not fp32, Adam m and v): the param + optimizer bytes of ``BYTES[precision]`` (the router's
    ``ROUTER_BYTES``). FSDP stores fp32 parameter shards and the moments: ``BYTES["fp32"]``'s.
    """
    b = BYTES["fp32"] if par.dp_mode is DataParallelMode.FSDP else BYTES[precision]
    # The stage's ranks hold all of its blocks' experts: E / ep each, over the ep ranks.
    stage = h.dense + h.experts * par.ep
    expert_bias = ROUTER_BYTES.param * model.moe.num_experts * h.n_moe
    return stage.nbytes(b, "param") + stage.nbytes(b, "optimizer") + expert_bias


def checkpoint_counted(par: ParallelConfig) -> str:
    if par.dp_mode is DataParallelMode.FSDP:
        what = "fsdp2 format: fp32 parameter shards (FSDP's masters) and fp32 Adam m and v, no separate master"
    else:
        what = (
            "buffers format: parameters in their dtype (routers fp32), an fp32 master of each non-fp32 "
            "parameter, fp32 Adam m and v"
        )
    return (
        what + ", plus the routers' fp32 expert_bias buffers; each replicated tensor written once, a stage's "
        "bytes spread evenly over its dp ranks (DCP's dedup); step, lr, routing and run-progress entries "
        "counted as 0"
    )


def _optimizer_step_bytes(model: ModelConfig, h: _Rank, b: PrecisionBytes, par: ParallelConfig) -> int:
    """Transient bytes of the DDP optimizer step, which updates one gradient bucket at a time."""
    if par.dp_mode is DataParallelMode.FSDP:
        return 0
    dp, edp = par.dp, par.edp
    sharded = par.optimizer_sharding is OptimizerSharding.ZERO1
    d, cap = model.d_model, par.bucket_elements
    dense_tensors = [*_attention_matrices(model), d * model.moe.shared_expert_hidden, d * model.dense_hidden]
    if h.embedding or h.head:
        dense_tensors.append(model.vocab_size * d)
    expert_tensor = (model.moe.num_experts // par.ep) * 2 * model.moe.expert_hidden * d
    share = 0.0
    for total, largest, n in ((h.dense.count, max(dense_tensors), dp), (h.experts.count, expert_tensor, edp)):
        if total:
            share = max(share, min(total, max(cap, largest)) / (n if sharded else 1))
    return int((b.optimizer_step_temp + 8) * share)


def _attention_matrices(model: ModelConfig) -> list[int]:
    """Elements of each of a block's attention weight matrices."""
    d, heads, mla = model.d_model, model.n_heads, model.mla
    if mla is None:
        head_dim = gqa_head_dim(model)
        q_dim, kv_dim = heads * head_dim, model.n_kv_heads * head_dim
        return [d * q_dim, d * kv_dim, d * kv_dim, q_dim * d]
    q_out = heads * mla.qk_head_dim
    q = [d * q_out] if mla.q_lora_rank is None else [d * mla.q_lora_rank, mla.q_lora_rank * q_out]
    kv = [
        d * (mla.kv_lora_rank + mla.qk_rope_head_dim),
        mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim),
    ]
    return q + kv + [heads * mla.v_head_dim * d]


def _all_to_all_bytes(model: ModelConfig, tokens: int, b: PrecisionBytes, par: ParallelConfig, full: bool) -> float:
    """Bytes one rank sends for one MoE block and one microbatch (dispatch + combine, fwd + bwd; the
    forward's pair again when the block is recomputed in ``full``)."""
    ep = par.ep
    messages = 6 if full else 4
    return messages * tokens * model.moe.top_k * model.d_model * b.comm * _ring(ep) * dispatch_pad(par)


def _grad_reduce_bytes(h: _Rank, b: PrecisionBytes, par: ParallelConfig) -> float:
    dp, edp, m = par.dp, par.edp, par.microbatches
    assert m is not None  # ParallelConfig.__post_init__ resolves None to pp
    total = 0.0
    for params, n in ((h.dense, dp), (h.experts, edp)):
        g, p = params.nbytes(b, "grad"), params.nbytes(b, "param")
        if par.dp_mode is DataParallelMode.FSDP:
            # FSDP reduce-scatters in fp32 (its reduce dtype), whatever grad_dtype says.
            g = FP32_GRAD_BYTES * params.count
            total += _ring(n) * (g + 2 * m * p)
        elif par.optimizer_sharding is OptimizerSharding.ZERO1:
            total += _ring(n) * (g + p)
        else:
            total += 2 * _ring(n) * g
    return total


def _pipeline_sends(rank: int, pp: int, v: int) -> int:
    """Messages one microbatch makes rank ``rank`` send: forward out of non-last chunks, grads out of non-first."""
    chunks = range(rank, pp * v, pp)
    return sum(1 for c in chunks if c < pp * v - 1) + sum(1 for c in chunks if c > 0)


def plan_rank(
    model: ModelConfig,
    h: _Rank,
    b: PrecisionBytes,
    par: ParallelConfig,
    tokens: int,
    recompute: RecomputeConfig,
    recomputed: set[int],
) -> dict[str, Any]:
    pp, v, m, ep = par.pp, par.virtual_stages, par.microbatches, par.ep
    assert m is not None  # ParallelConfig.__post_init__ resolves None to pp
    blocks = [
        block_activations(model, not model.is_moe_layer(i), tokens, b, par, recompute if i in recomputed else None)
        for i in h.layers
    ]
    per_mb = sum(block.kept for block in blocks) + (head_activation_bytes(model, tokens, b) if h.head else 0)
    full = recompute.mode is RecomputeMode.FULL
    n_moe_full = sum(1 for i in h.layers if i in recomputed and model.is_moe_layer(i)) if full else 0
    in_flight = in_flight_microbatches(par.schedule.value, pp, v, m, h.rank)
    a2a_buffer = 2 * tokens * model.moe.top_k * model.d_model * b.comm * dispatch_pad(par) if ep > 1 else 0
    pipe_buffer = 2 * tokens * model.d_model * b.activation if pp > 1 else 0
    memory: dict[str, float] = dict(_state_memory(h, b, par))
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
        "all_to_all": m
        * (
            (h.n_moe - n_moe_full) * _all_to_all_bytes(model, tokens, b, par, full=False)
            + n_moe_full * _all_to_all_bytes(model, tokens, b, par, full=True)
        ),
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
