"""Projection: one rank's measured compute and collectives priced as a step time on a whole cluster.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.predict.collectives import (
    Collective,
    Network,
    collective_seconds,
    is_int,
    is_number,
)
from bench.predict.overlap import (
    NOTHING,
    ExpertOverlap,
    MicrobatchOverlap,
    SyncBucket,
    expert_hidden_s,
    interleaved_exposed_s,
    simulate_sync,
)
from bench.predict.pipeline_replay import ChunkSeconds, replay_idle_s
from bench.predict.skew import SkewModel, skew_seconds, sync_points

__all__ = [
    "BESIDE_KEYS",
    "BREAKDOWN_KEYS",
    "KINDS",
    "OVERLAPS",
    "STEP_KEYS",
    "ZERO_BUBBLE",
    "Projection",
    "RankTiming",
    "Schedule",
    "bubble_s",
    "project_step",
]

PER_MICROBATCH_PHASES = ("expert", "pipeline", "fsdp")
PER_STEP_PHASES = ("grad", "other")
KINDS = ("gpipe", "1f1b", "interleaved1f1b", "interleaved-zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
"""Schedules whose ranks hold two stages each, in a V (stage r and 2 pp - 1 - r)."""
ZERO_BUBBLE = ("interleaved-zb", *V_SHAPED)
"""Schedules that run weight gradients apart from input gradients, in the bubble."""
OVERLAPS = ("none", "chunks", "microbatches")
"""How a microbatch's expert all-to-alls overlap compute (``moe_engine.config.ExpertOverlap``, resolved)."""
STEP_KEYS = (
    "compute",
    "expert_comm",
    "pipeline_comm",
    "fsdp_gather_exposed",
    "bubble",
    "grad_sync_exposed",
    "optimizer",
    "param_gather_exposed",
    "other_comm",
    "skew",
)
"""Keys of ``Projection.breakdown_s`` that add up to the step."""
BESIDE_KEYS = (
    "grad_sync_hidden",
    "grad_sync_total",
    "param_gather_hidden",
    "param_gather_total",
    "fsdp_gather_total",
    "expert_comm_hidden",
    "expert_comm_total",
)
"""Keys of ``Projection.breakdown_s`` reported beside the sum (hidden time overlaps the compute)."""
BREAKDOWN_KEYS = STEP_KEYS + BESIDE_KEYS
"""Keys of ``Projection.breakdown_s``."""


@dataclass(frozen=True)
class Schedule:
    """The pipeline schedule the step runs."""

    pp: int
    """Pipeline stages (ranks in a pipeline)."""
    virtual_stages: int
    """Model chunks per pipeline rank (more than one needs interleaved1f1b or interleaved-zb; zbv and
    dualpipev always hold two, given as 1 or 2)."""
    microbatches: int
    """Microbatches per optimizer step on each data-parallel rank."""
    kind: str
    """One of ``KINDS``; ignored when pp == 1."""

    def __post_init__(self) -> None:
        for name in ("pp", "virtual_stages", "microbatches"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"schedule.{name}: must be an integer >= 1, got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"schedule.kind: unknown schedule {self.kind!r}; expected one of {', '.join(KINDS)}")
        # The engine refuses this layout too (ParallelConfig.validate); the bubble formula would not apply.
        if self.kind in V_SHAPED:
            if self.virtual_stages > 2:
                raise ValueError(
                    f"schedule.virtual_stages: {self.kind} holds two stages per rank, got {self.virtual_stages}"
                )
        elif self.virtual_stages > 1 and self.kind not in ("interleaved1f1b", "interleaved-zb"):
            raise ValueError(
                f"schedule.virtual_stages: {self.virtual_stages} stages per rank needs kind interleaved1f1b or "
                f"interleaved-zb, got {self.kind}"
            )

    @property
    def chunks(self) -> int:
        """Stages a rank holds: 2 for the V-shaped schedules, else virtual_stages."""
        return 2 if self.kind in V_SHAPED else self.virtual_stages


@dataclass(frozen=True)
class RankTiming:
    """Compute of the projected rank, per the projection's scale."""

    microbatch_s: float
    """Forward + backward compute of one microbatch on this rank (all its stages), seconds."""
    optimizer_s: float
    """Optimizer step, once per step, seconds (its updates are what ZeRO-1 gathers hide under)."""
    forward_s: float | None = None
    """The forward's share of microbatch_s (F), seconds; the zero-bubble schedules' bubble needs it."""
    weight_grad_s: float | None = None
    """The backward's weight gradients in microbatch_s (W), seconds; the zero-bubble schedules' bubble needs it."""
    weight_add_s: float = 0.0
    """Per step, compute beyond m microbatches: a paired plan's split weight backwards adding their gradients
    into the buffer (``bench.predict.split_weights``), seconds."""

    def __post_init__(self) -> None:
        for name in ("microbatch_s", "optimizer_s", "weight_add_s"):
            value = getattr(self, name)
            if not is_number(value) or not value >= 0:
                raise ValueError(f"timing.{name}: must be a number >= 0, got {value!r}")
        for name in ("forward_s", "weight_grad_s"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not value >= 0):
                raise ValueError(f"timing.{name}: must be a number >= 0 or None, got {value!r}")
        if (self.forward_s or 0.0) + (self.weight_grad_s or 0.0) > self.microbatch_s * (1 + 1e-9):
            raise ValueError(
                f"timing: forward_s + weight_grad_s ({self.forward_s} + {self.weight_grad_s}) exceed microbatch_s "
                f"({self.microbatch_s})"
            )


@dataclass(frozen=True)
class Projection:
    """The projected step of one rank on the target cluster."""

    step_s: float
    """Projected optimizer step time, seconds."""
    tokens_per_s_per_gpu: float
    """tokens_per_step / step_s / world_size."""
    tflops_per_gpu: float
    """flops_per_token * tokens_per_step / step_s / world_size / 1e12."""
    breakdown_s: dict[str, float]
    """Seconds by cause (``BREAKDOWN_KEYS``); those of ``STEP_KEYS`` add up to step_s."""
    assumptions: list[str]
    """Every modelling assumption behind the numbers, in plain sentences with the formulas used."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return {
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "breakdown_s": dict(self.breakdown_s),
            "assumptions": list(self.assumptions),
        }


def _check_entries(name: str, items: list[Collective], phases: tuple[str, ...], world_size: int, rank: int) -> None:
    elsewhere = "per_step (once per step)" if name == "per_microbatch" else "per_microbatch (one microbatch's)"
    for i, c in enumerate(items):
        if not isinstance(c, Collective):
            raise ValueError(f"{name}[{i}]: expected a Collective, got {type(c).__name__}")
        if c.phase not in phases:
            raise ValueError(
                f"{name}[{i}]: phase {c.phase!r} belongs in {elsewhere}; {name} takes {' and '.join(phases)}"
            )
        if max(c.ranks) >= world_size:
            raise ValueError(f"{name}[{i}]: {c.op} group {c.ranks!r} names a rank >= world_size={world_size}")
        if rank not in c.ranks:
            raise ValueError(f"{name}[{i}]: rank {rank} is not in the {c.op} group {c.ranks!r}")


def _seconds(items: list[Collective], phase: str, rank: int, net: Network) -> float:
    return sum(collective_seconds(c, rank, net) for c in items if c.phase == phase)


def bubble_s(schedule: Schedule, t_mb: float, timing: RankTiming) -> float:
    """The pipeline's idle time of one step (the formulas in docs/projection-formulas.md, section "Step")."""
    pp, v = schedule.pp, schedule.chunks
    if pp == 1:
        return 0.0
    if schedule.kind not in ZERO_BUBBLE:
        # Warm-up and drain run chunk-sized pieces of a microbatch, 1/v of one each (v = 1: whole ones).
        return (pp - 1) * t_mb / v
    if timing.forward_s is None or timing.weight_grad_s is None:
        raise ValueError(f"timing: the {schedule.kind} schedule's bubble needs forward_s and weight_grad_s")
    # F, B (input gradients) and W of one microbatch, with its exposed communication spread over them
    # in proportion; a chunk holds 1/v of each.
    scale = t_mb / timing.microbatch_s if timing.microbatch_s else 0.0
    f, w = timing.forward_s * scale, timing.weight_grad_s * scale
    b = t_mb - f - w
    if schedule.kind == "interleaved-zb":
        per_chunk = f + b - w  # ZB1P: (p - 1)(F + B_full - 2W), B_full = B + W
    elif schedule.kind == "zbv":
        per_chunk = f + b - 2 * w  # ZB-V: zero when F = B = W
    else:
        per_chunk = f + 2 * b - w  # DualPipeV: (p - 1)(F&B + B_full - 3W), F&B = F + B_full
    return (pp - 1) * max(0.0, per_chunk) / v


PAIRED_BUBBLE = (
    "the bubble of a paired plan (pp > 1, microbatches overlap) replaces the schedule's formula: the measured "
    "rank's idle seconds in a replay of every rank's paired plan, each action as soon as its rank is free and "
    "its inputs have arrived, taking the measured rank's seconds for its kind (a stage chunk's compute, exposed "
    "all-to-alls and stage messages, 1/v of a microbatch's); messages between ranks take no time in the replay"
)


def paired_bubble_s(
    pairing: MicrobatchOverlap, timing: RankTiming, pipe_s: float, hidden_forward_s: float, hidden_backward_s: float
) -> float:
    """The bubble of a paired pipeline plan: the measured rank's idle seconds in a replay of every rank's
    plan (``bench.predict.pipeline_replay``), each stage chunk's action taking the measured rank's
    seconds for its kind, 1/v of a microbatch's: its compute (the microbatch's, split between forward and
    backward as the programs split it; the weight backward's share from ``timing``), its exposed
    all-to-alls by the interleaving rule, and half the microbatch's stage messages per direction."""
    assert pairing.pipeline is not None
    plan = pairing.pipeline
    v = plan.virtual_stages
    forward, backward = pairing.forward, pairing.backward
    programs_s = forward.compute_s + backward.compute_s
    share = forward.compute_s / programs_s if programs_s else 0.5
    f = timing.microbatch_s * share
    b = timing.microbatch_s - f
    w = min(b, timing.weight_grad_s or 0.0)
    alone_f = max(0.0, interleaved_exposed_s(forward, NOTHING) - hidden_forward_s)
    alone_b = max(0.0, interleaved_exposed_s(backward, NOTHING) - hidden_backward_s)
    # The weight backward beside a backward: the programs' own split (``MicrobatchOverlap.weight_s``),
    # priced at the measured rank's seconds.
    slices = pairing.weight_slices
    chunk = ChunkSeconds(
        forward=(f + alone_f + pipe_s / 2) / v,
        backward=(b + alone_b + pipe_s / 2) / v,
        input_backward=(b - w + alone_b + pipe_s / 2) / v,
        weight_backward=w / v,
        forward_backward=(f + b + interleaved_exposed_s(forward, backward) + pipe_s) / v,
        input_beside_weight=(b + interleaved_exposed_s(pairing.input_backward, slices) + pipe_s / 2) / v,
        backward_beside_weight=(b + w + interleaved_exposed_s(backward, slices) + pipe_s / 2) / v,
    )
    return replay_idle_s(plan.kind, plan.pp, plan.virtual_stages, plan.microbatches, plan.pipeline_rank, chunk)


def _overlap_assumption(overlaps: list[ExpertOverlap], overlap: str) -> str:
    if overlap == "microbatches":
        return (
            "expert all-to-alls overlapped across microbatches: a microbatch's forward runs beside another's "
            "backward, one computing at a time, handing over at each exchange of rows it starts (a chain of "
            "them with no compute between, per-node's two levels, once) and waiting for it when the other has "
            "started its next (or finished); routing counts are waited for at once, exposed; the all-to-alls "
            "queue on one link; forwards "
            "and backwards with no partner (the first and last of pp = 1; under a pipeline the paired plan's "
            "actions alone: its fill's forwards, its drain's backwards) wait for theirs, less what their "
            "chunks hide; no contention between the all-to-alls and compute"
        )
    chunked = [o for o in overlaps if o.chunks > 1] if overlap == "chunks" else []
    if not chunked:
        return (
            "expert all-to-alls (where the layout has them): each layer's rows out and back whole, on the "
            "critical path, not overlapped with compute"
        )
    return (
        f"expert all-to-alls in {chunked[0].chunks} chunks per MoE layer pass (parallel.a2a_chunks): chunk "
        "k+1's dispatch moves while chunk k's experts compute, chunk k's combine while chunk k+1's do; per "
        "pass, its dispatches and combines (half of its all-to-all time each) queue on one link in the "
        "engine's order d0, d1, c0, d2, c1, ..., c(C-1), each chunk's experts (the experts' traced seconds / "
        "(passes * C)) start when its dispatch arrived and the chunk before is done, its combine when they "
        "are done; exposed = the pass's end - its expert compute, at least the first dispatch and the last "
        "combine; the backward by the same rule; no contention between the all-to-alls and compute"
    )


def _assumptions(schedule: Schedule, net: Network, grad_buckets: int, gather_buckets: int) -> list[str]:
    pp, v = schedule.pp, schedule.chunks
    if pp == 1:
        pipeline = "no pipeline (pp = 1): the step runs m microbatches back to back, m * t_mb, no bubble"
    elif schedule.kind in ZERO_BUBBLE:
        rule = {
            "interleaved-zb": "ZB1P: (pp - 1) * max(0, F + B - W) / v",
            "zbv": "ZB-V: (pp - 1) * max(0, F + B - 2W) / 2",
            "dualpipev": "DualPipeV: (pp - 1) * max(0, F + 2B - W) / 2",
        }[schedule.kind]
        pipeline = (
            f"{schedule.kind} over pp = {pp} stages, {v} chunks per rank: pipeline time m * t_mb + bubble, "
            f"bubble = {rule}, F, B (input gradients), W (weight gradients) of one microbatch's t_mb in the "
            "proportions of its compute; every stage is as slow as the measured rank"
        )
    elif schedule.kind == "interleaved1f1b":
        pipeline = (
            f"interleaved 1F1B over pp = {pp} stages with v = {v} chunks per rank: pipeline time "
            "m * t_mb + (pp - 1) * t_mb / v; every stage is as slow as the measured rank"
        )
    else:
        pipeline = (
            f"{schedule.kind} over pp = {pp} stages: pipeline time (m + pp - 1) * t_mb; every stage is "
            "as slow as the measured rank"
        )
    if grad_buckets:
        grad = (
            f"gradient sync: {grad_buckets} bucket reductions launch during the last microbatch's backward, "
            "each w_i seconds of compute before it ends; they queue on one link in launch order, "
            "s_i = max(-w_i, e_(i-1)), e_i = s_i + c_i, exposed = max(0, e_N), hidden = sum c_i - exposed; "
            "gradient collectives without a launch time start when the backward ends"
        )
    else:
        grad = "gradient sync: no bucket launch times given, every gradient collective starts when the backward ends"
    if gather_buckets:
        gather = (
            f"ZeRO-1 parameter gathers: {gather_buckets} buckets launch as their update is written, w_i "
            "seconds of updates before the optimizer ends; same queue on one link"
        )
    else:
        gather = "no overlapped parameter gathers"
    return [
        f"network: {net.gpus_per_node} GPUs per node (rank r on node r // {net.gpus_per_node}), "
        f"{net.intra_node_gbps:g} GB/s per GPU inside a node, {net.inter_node_gbps:g} GB/s per GPU between "
        f"nodes (1 GB = 1e9 bytes), alpha = {net.latency_us:g} us per message",
        "alpha-beta model: a group spanning nodes moves bytes at the inter-node bandwidth, else at the "
        "intra-node one (beta); no contention between concurrent collectives, no protocol overheads",
        "all_to_all: (n-1) * alpha + max(B * (l-1)/n / intra, B * (n-l)/n / inter), l = the group's ranks "
        "on this rank's node, B = this rank's send buffer; the on-node and off-node shares move in parallel",
        "all_reduce (ring): 2 * (n-1) * alpha + 2 * (n-1)/n * B / beta",
        "reduce_scatter and all_gather (ring): (n-1) * alpha + (n-1)/n * B / beta, B = the whole input or output",
        "broadcast (pipelined ring): (n-1) * alpha + B / beta",
        "barrier: 2 * ceil(log2 n) * alpha",
        "send and recv: alpha + B / beta, each recorded message priced on its own",
        "a single-rank group costs nothing (except send and recv)",
        "t_mb = microbatch compute + its expert all-to-alls (less what chunked dispatch hides) + its pipeline "
        "messages: communication inside a microbatch is on the critical path, not overlapped with compute "
        "otherwise; FSDP parameter gathers are prefetched under the compute, only max(0, gathers - compute) "
        "of a microbatch is exposed",
        pipeline,
        grad,
        gather,
        "overlap windows hold compute only (the all-to-alls and stage messages still to run use the link "
        "themselves); a later pipeline stage's sync could also hide under the drain it idles through: not counted",
        "other once-per-step collectives are fully exposed; the optimizer step runs once, after the gradient sync",
        "step = pipeline time + exposed gradient sync + optimizer + exposed parameter gather + other collectives",
    ]


def _skew_assumption(skew: SkewModel | None) -> str:
    if skew is None:
        return "rank skew: not modelled (no measured step-time spread given): ranks reach each collective together"
    return (
        f"rank skew: each blocking collective waits for the slowest rank; skew = z_n * sqrt(S) * cv * compute "
        f"with cv = {skew.cv:.4g} ({skew.source}), S = the step's blocking collectives, n = their largest group; "
        "independent noise between segments and ranks assumed"
    )


def project_step(
    rank: int,
    timing: RankTiming,
    per_microbatch: list[Collective],
    per_step: list[Collective],
    schedule: Schedule,
    net: Network,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    grad_buckets: Iterable[SyncBucket] = (),
    gather_buckets: Iterable[SyncBucket] = (),
    skew: SkewModel | None = None,
    expert_overlap: Iterable[ExpertOverlap] = (),
    overlap: str = "chunks",
    microbatch_overlap: MicrobatchOverlap | None = None,
) -> Projection:
    """The projected step of ``rank`` (formulas in docs/projection-formulas.md).

    ``per_microbatch`` holds the collectives of one microbatch (phases expert and pipeline), ``per_step``
    those issued once per step (phases grad and other) that no bucket stands for; ``tokens_per_step``
    is global. ``grad_buckets`` (the gradient reductions) and ``gather_buckets`` (the ZeRO-1 gathers),
    in launch order, are the overlapped syncs. ``skew``: the rank-skew waits' model (none: 0).
    ``expert_overlap``: the chunked expert all-to-alls of a microbatch, by direction (they are among
    ``per_microbatch``'s expert entries too; none: nothing overlapped). ``overlap``: how the expert
    all-to-alls overlap compute, one of ``OVERLAPS``: none (all exposed), chunks (``expert_overlap``'s
    chunked rule) or microbatches (behind another microbatch's compute: ``microbatch_overlap`` holds
    the interleaved programs and the pairs; a direction that runs alone still hides what its chunks do).
    """
    grad_buckets, gather_buckets, expert_overlap = list(grad_buckets), list(gather_buckets), list(expert_overlap)
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap: unknown overlap {overlap!r}; expected one of {', '.join(OVERLAPS)}")
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size: must be an integer >= 1, got {world_size!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank: must be an integer in [0, {world_size}), got {rank!r}")
    if not is_int(tokens_per_step) or tokens_per_step < 1:
        raise ValueError(f"tokens_per_step: must be an integer >= 1, got {tokens_per_step!r}")
    if not is_number(flops_per_token) or not flops_per_token >= 0:
        raise ValueError(f"flops_per_token: must be a number >= 0, got {flops_per_token!r}")
    if schedule.pp > world_size:
        raise ValueError(f"schedule.pp: {schedule.pp} stages exceed world_size={world_size}")
    _check_entries("per_microbatch", per_microbatch, PER_MICROBATCH_PHASES, world_size, rank)
    _check_entries("per_step", per_step, PER_STEP_PHASES, world_size, rank)
    for name, buckets in (("grad_buckets", grad_buckets), ("gather_buckets", gather_buckets)):
        for i, bucket in enumerate(buckets):
            if not isinstance(bucket, SyncBucket):
                raise ValueError(f"{name}[{i}]: expected a SyncBucket, got {type(bucket).__name__}")
        _check_entries(name, [b.collective for b in buckets], ("grad",), world_size, rank)

    for i, o in enumerate(expert_overlap):
        if not isinstance(o, ExpertOverlap):
            raise ValueError(f"expert_overlap[{i}]: expected an ExpertOverlap, got {type(o).__name__}")
        _check_entries("expert_overlap", list(o.exchanges), ("expert",), world_size, rank)

    m = schedule.microbatches
    expert_total = _seconds(per_microbatch, "expert", rank, net)
    hidden_alone = (
        expert_hidden_s(expert_overlap, rank, net, "forward"),
        expert_hidden_s(expert_overlap, rank, net, "backward"),
    )
    if overlap == "microbatches":
        if microbatch_overlap is None:
            raise ValueError("microbatch_overlap: the microbatches overlap needs the interleaved programs")
        exposed = microbatch_overlap.exposed_s(*hidden_alone)
        # Per microbatch: the step's exposed seconds spread over its m microbatches.
        expert = min(expert_total, max(0.0, exposed / m))
        expert_hidden = expert_total - expert
    else:
        expert_hidden = expert_hidden_s(expert_overlap, rank, net) if overlap == "chunks" else 0.0
        expert = expert_total - expert_hidden
    pipe = _seconds(per_microbatch, "pipeline", rank, net)
    fsdp = _seconds(per_microbatch, "fsdp", rank, net)
    fsdp_exposed = max(0.0, fsdp - timing.microbatch_s)
    t_mb = timing.microbatch_s + expert + pipe + fsdp_exposed
    # Gradient collectives with no launch time start as the backward ends, behind the buckets.
    unbucketed = [SyncBucket(c, 0.0) for c in per_step if c.phase == "grad"]
    grad = simulate_sync([*grad_buckets, *unbucketed], rank, net)
    gather = simulate_sync(gather_buckets, rank, net)
    replayed = overlap == "microbatches" and microbatch_overlap is not None and microbatch_overlap.pipeline is not None
    breakdown = {
        "compute": m * timing.microbatch_s + timing.weight_add_s,
        "expert_comm": m * expert,
        "pipeline_comm": m * pipe,
        "fsdp_gather_exposed": m * fsdp_exposed,
        "bubble": (
            paired_bubble_s(microbatch_overlap, timing, pipe, *hidden_alone)
            if replayed and microbatch_overlap is not None
            else bubble_s(schedule, t_mb, timing)
        ),
        "grad_sync_exposed": grad.exposed_s,
        "optimizer": timing.optimizer_s,
        "param_gather_exposed": gather.exposed_s,
        "other_comm": _seconds(per_step, "other", rank, net),
        "skew": skew_seconds(
            skew,
            *sync_points(per_microbatch, [*per_step, *(b.collective for b in grad_buckets)], m),
            m * timing.microbatch_s,
        ),
        "grad_sync_hidden": grad.hidden_s,
        "grad_sync_total": grad.total_s,
        "param_gather_hidden": gather.hidden_s,
        "param_gather_total": gather.total_s,
        "fsdp_gather_total": m * fsdp,
        "expert_comm_hidden": m * expert_hidden,
        "expert_comm_total": m * expert_total,
    }
    # Summing the parts (rather than pipeline time + ...) keeps the breakdown adding up to the step exactly.
    step = sum(breakdown[k] for k in STEP_KEYS)
    if not step > 0:
        raise ValueError("projected step time is 0: give the rank some compute, optimizer or communication time")
    return Projection(
        step_s=step,
        tokens_per_s_per_gpu=tokens_per_step / step / world_size,
        tflops_per_gpu=flops_per_token * tokens_per_step / step / world_size / 1e12,
        breakdown_s=breakdown,
        assumptions=_assumptions(schedule, net, len(grad_buckets), len(gather_buckets))
        + [_overlap_assumption(expert_overlap, overlap), _skew_assumption(skew)]
        + ([PAIRED_BUBBLE] if replayed else []),
    )
