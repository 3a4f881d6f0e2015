"""One pipeline rank of a plan: what it holds, its state memory, its traffic and its checkpoint bytes
(``bench.predict.plan``'s notation).
More: docs/memory-plan.md.
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
    ExpertOverlap,
    GradDtype,
    ModelConfig,
    OptimizerSharding,
    ParallelConfig,
    PipelineSchedule,
    RecomputeConfig,
    RecomputeMode,
)


def in_flight_microbatches(
    schedule: str, pp: int, virtual_stages: int, microbatches: int, rank: int, paired: bool = False
) -> float:
    """Whole-rank microbatches whose activations rank ``rank`` holds at its peak (see docs/memory-plan.md);
    ``paired``: the plan runs pairs (``moe_engine.parallel.paired_plan``: interleaved 1F1B's one more
    forward in the warm-up)."""
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
        extra = 1 if paired and schedule == "interleaved1f1b" else 0
        chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1 + extra)
    return chunks / v


def _ring(n: int) -> float:
    return (n - 1) / n


def ceil_div(a: int, n: int) -> int:
    return -(-a // n)


def experts_wgrad_in_gemm(par: ParallelConfig) -> bool:
    """Whether the experts' weight-gradient GEMMs add into the gradient buffer (``main_grad``) and no
    whole weight gradient exists: under ddp with fp32 buffers, in a plain backward. FSDP's parameters
    have no such buffer, a bf16 one takes the op's two-pass path (an fp32 model's ``param`` buffers
    would qualify: not counted, the plan stays an upper bound), and a schedule that splits the
    backward computes them through ``autograd.grad``: a zero-bubble one, or interleaved 1F1B's paired
    plan in its cool-down (``moe_engine.parallel.paired_plan``)."""
    paired_split = (
        par.schedule is PipelineSchedule.INTERLEAVED_1F1B and par.resolved_overlap is ExpertOverlap.MICROBATCHES
    )
    return (
        par.accumulate_in_gemm
        and par.grad_dtype is GradDtype.FP32
        and par.dp_mode is DataParallelMode.DDP
        and (par.pp == 1 or not (par.schedule.splits_backward or paired_split))
    )


def _backward_workspace_bytes(
    model: ModelConfig,
    h: _Rank,
    tokens: int,
    b: PrecisionBytes,
    par: ParallelConfig,
    blocks: list[BlockActivations],
) -> float:
    """The most the rank's backward holds on top of the activations (docs/memory-plan.md's candidates).

    One MoE block's expert backward holds per row the gradient of the SwiGLU product, the recomputed
    product and the gradient of the pre-activations (4F) next to the local experts' weight gradients
    (made whole before they are added into their buffer, except where their GEMM adds into the ddp
    buffer itself: ``experts_wgrad_in_gemm``), plus what the block's recompute brought
    back if that is still alive; a recomputed block's recompute on its own. A block's backward runs
    after the LM head's, whose saved tensors of that microbatch are freed by then. The head's own
    backward: the cross-entropy's fp32 gradients of the log-probabilities and of the logits, then the
    logits' gradient next to the LM head's weight gradient; the embedding's gradient, V x D.
    """
    moe, a, v, d = model.moe, b.activation, model.vocab_size, model.d_model
    in_blocks = [block.recompute_peak for block in blocks]
    if h.n_moe:
        rows = expert_rows(tokens, model, par) * a * 4 * moe.expert_hidden
        experts = rows
        if not experts_wgrad_in_gemm(par):
            experts += a * (moe.num_experts // par.ep) * 3 * d * moe.expert_hidden
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
    """Bytes a DCP checkpoint holds for pipeline stage ``h``, each replicated tensor once (docs/memory-plan.md).

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
    # As the engine decides (overlaps_microbatches): a fully recomputed MoE block anywhere runs the plain order.
    replays_routes = full and any(model.is_moe_layer(i) for i in recomputed)
    paired = par.resolved_overlap is ExpertOverlap.MICROBATCHES and not replays_routes
    in_flight = in_flight_microbatches(par.schedule.value, pp, v, m, h.rank, paired)
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
