"""The proxy's projection arithmetic: from one measured step of the rank (``StepMeasurement``) to the
step at the run's scale and at the scenario's (``project_run_scale``, ``project_full_scale``), the
collectives' scaling (``CallScaling``, ``classify_calls``) and the gradient buckets' overlap windows
(``scaled_sync_buckets``). Rules in ``bench.run.proxy.run``'s docstring ("Projection", "Overlap windows at
the scenario's scale"). Arithmetic only: nothing here runs a model."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench.predict.collectives import Collective, Network
from bench.predict.overlap import SyncBucket
from bench.predict.projection import Projection, RankTiming, Schedule, project_step

BLOCK_PHASES = ("attention", "router", "dispatch", "experts", "shared_expert", "dense_ffn", "block")
FABRICATION = "fabrication"
EMBEDDING = "embedding"
GRAD_BUFFERS = "grad_buffers"
WINDOW_CLASSES = ("blocks", "rest", "embedding", "grad_buffers")
"""How a stretch of the last backward scales: the block phases, the rest (what no phase times), the
embedding, and gradient buckets' launches (scaling the bucket by 1/dp)."""

if TYPE_CHECKING:  # annotations only: this module runs nothing
    from bench.run.collective_log import CollectiveCall
    from bench.run.proxy.scale import ProxyScale


@dataclass(frozen=True)
class CallScaling:
    """How one recorded call grows from the run's scale to the scenario's."""

    token_ratio: float
    """Bytes of all-to-alls and stage messages (rows per microbatch)."""
    block_ratio: float
    """Number of all-to-alls (one set per MoE block)."""
    param_ratio: dict[str, float]
    """Bytes of gradient collectives, per group name (the dense dp group, the expert edp group)."""

    def apply(self, call: CollectiveCall, phase: str) -> tuple[int, float]:
        """(bytes, calls) that one recorded call stands for at the scenario's scale."""
        if phase == "expert":
            return round(call.nbytes * self.token_ratio), self.block_ratio
        if phase == "pipeline":
            return round(call.nbytes * self.token_ratio), 1.0
        if phase == "grad":
            return round(call.nbytes * self.param_ratio.get(call.group_name, 1.0)), 1.0
        return call.nbytes, 1.0


def classify_calls(
    calls: list[CollectiveCall], phases: dict[str, str], microbatches: int, scaling: CallScaling | None = None
) -> tuple[list[Collective], list[Collective]]:
    """Per-microbatch (expert, pipeline) and per-step (grad, other) entries for the projection.

    Calls of one kind (op, group, phase) are merged: per microbatch, their count divided by the
    microbatches and their mean size (sync dispatch sends a different size every call).
    """
    merged: dict[tuple, list[tuple[int, float]]] = {}
    for call in calls:
        phase = phases.get(call.group_name, "other")
        scaled = scaling.apply(call, phase) if scaling else (call.nbytes, 1.0)
        merged.setdefault((call.op, call.ranks, phase), []).append(scaled)
    per_microbatch, per_step = [], []
    for (op, ranks, phase), entries in merged.items():
        nbytes = round(sum(b for b, _ in entries) / len(entries))
        multiplier = entries[0][1]
        if phase in ("expert", "pipeline"):
            count = len(entries) / microbatches
            if count != int(count):
                raise RuntimeError(f"{len(entries)} {op} calls do not split over {microbatches} microbatches")
            per_microbatch.append(Collective(op, ranks, nbytes, phase, max(1, round(count * multiplier))))
        else:
            per_step.append(Collective(op, ranks, nbytes, phase, len(entries)))
    return per_microbatch, per_step


@dataclass(frozen=True)
class StageSize:
    """What the rank's once-per-step work and gradient collectives grow with, at one scale (from the plan)."""

    dense_params: int
    """Dense parameters of the rank's stage (their gradients sync over the dp group)."""
    expert_params: int
    """Local expert parameters of the stage (their gradients sync over the edp group)."""
    optimizer_bytes: int
    """The rank's optimizer state (its shard of masters and moments): what the optimizer step works on."""
    grad_bytes: int
    """The rank's gradient buffers: what zeroing and scaling them works on."""

    @classmethod
    def from_plan(cls, plan_details: dict[str, Any], pp_rank: int) -> StageSize:
        """The sizes of stage ``pp_rank`` in a plan's details."""
        stage = plan_details["stages"][pp_rank]
        memory = stage["memory_bytes"]
        return cls(stage["dense_params"], stage["local_expert_params"], memory["optimizer"], memory["grads"])


@dataclass(frozen=True)
class BucketMeasurement:
    """One gradient bucket of the rank's optimizer and the compute its collectives can hide under, at the
    run's scale (medians over the measured steps), in the optimizer's bucket order (its launch order)."""

    reduce: CollectiveCall | None
    """Its reduction as issued (all_reduce, or reduce_scatter under ZeRO-1); None in a group of one."""
    gather: CollectiveCall | None
    """Its ZeRO-1 parameter all_gather as issued; None without ZeRO-1 or in a group of one."""
    block_share: float
    """Share of its parameters' elements that are the stage's transformer blocks'."""
    filled: bool
    """It closed by reaching ``bucket_elements``; a bucket left open to the end of the walk (the last of
    its family and dtype) would also take later blocks' parameters at the scenario's scale."""
    reduce_window_s: dict[str, float]
    """The last backward's compute left after its reduction was issued, by ``WINDOW_CLASSES`` (proxy
    fabrication left out; all 0 when it was issued after the backward ended), seconds."""
    update_s: float
    """Its share's optimizer update: from the previous bucket's gather launch (the first bucket's: from
    the end of clipping) to its own, seconds."""


def scaled_sync_buckets(
    buckets: list[BucketMeasurement], blocks_backward_s: float, block_ratio: float = 1.0, token_ratio: float = 1.0
) -> tuple[list[SyncBucket], list[SyncBucket]]:
    """The reductions and the gathers of ``buckets`` at a scale, each list in launch order (rules in
    ``bench.predict.projection``'s docstring); ``blocks_backward_s`` is the run's blocks' backward of
    one microbatch (A)."""
    r_blocks, s_tokens = block_ratio, token_ratio
    copies = max(1, math.ceil(r_blocks - 1e-9))
    a_full = blocks_backward_s
    # Only a filled bucket of block parameters closes once per copy of the blocks at the scenario's scale.
    is_block = [b.block_share >= 1.0 and b.filled for b in buckets]

    def grown(b: BucketMeasurement) -> float:
        # Bytes (and update time) of a bucket kept whole: its block parameters grow with the blocks.
        return 1.0 - b.block_share + b.block_share * r_blocks

    def collective(call: CollectiveCall, factor: float) -> Collective:
        return Collective(call.op, call.ranks, round(call.nbytes * factor), "grad")

    reduces: list[tuple[float, int, int, SyncBucket]] = []
    gathers: list[tuple[float, int, int, SyncBucket]] = []
    block_updates = sum(b.update_s for b, block in zip(buckets, is_block) if block)
    for i, b in enumerate(buckets):
        w = b.reduce_window_s
        after = buckets[i + 1 :]
        after_block = sum(x.update_s for x, block in zip(after, is_block[i + 1 :]) if block)
        after_other = sum(x.update_s * grown(x) for x, block in zip(after, is_block[i + 1 :]) if not block)
        # What no phase times is, this late in the backward, the trainer's own code: it does not grow.
        outside_blocks = w["rest"] + w["embedding"] + w["grad_buffers"]
        if is_block[i]:
            for k in range(copies):
                later = copies - 1 - k
                window = (w["blocks"] + later * a_full) * s_tokens * r_blocks / copies + outside_blocks
                update_window = (after_block + later * block_updates) * r_blocks / copies + after_other
                if b.reduce is not None:
                    reduces.append((window, k, i, SyncBucket(collective(b.reduce, r_blocks / copies), window)))
                if b.gather is not None:
                    gathers.append(
                        (update_window, k, i, SyncBucket(collective(b.gather, r_blocks / copies), update_window))
                    )
        else:
            window = w["blocks"] * s_tokens * r_blocks + outside_blocks
            update_window = after_block * r_blocks + after_other
            if b.reduce is not None:
                reduces.append((window, 0, i, SyncBucket(collective(b.reduce, grown(b)), window)))
            if b.gather is not None:
                gathers.append((update_window, 0, i, SyncBucket(collective(b.gather, grown(b)), update_window)))
    # The engine launches in its fixed bucket order, which is the order of the windows (the longest first).
    reduces.sort(key=lambda entry: (-entry[0], entry[1], entry[2]))
    gathers.sort(key=lambda entry: (-entry[0], entry[1], entry[2]))
    return [entry[3] for entry in reduces], [entry[3] for entry in gathers]


def unbucketed_calls(calls: list[CollectiveCall], buckets: list[BucketMeasurement]) -> list[CollectiveCall]:
    """``calls`` less one call per bucket reduction and gather (the buckets price those themselves)."""
    left = Counter(call for b in buckets for call in (b.reduce, b.gather) if call is not None)
    out = []
    for call in calls:
        if left[call] > 0:
            left[call] -= 1
        else:
            out.append(call)
    missing = [call for call, n in left.items() for _ in range(n)]
    if missing:
        raise RuntimeError(f"bucket collectives missing from the recorded step: {missing[:3]}")
    return out


@dataclass(frozen=True)
class StepMeasurement:
    """One measured step of the rank, at the run's scale: what both projections start from."""

    compute_s: float
    """Median compute of a step (its wall time without fabricating peers' data), seconds."""
    phases_s: dict[str, dict[str, float]]
    """Median seconds per phase and direction (forward, backward), as in ``details.phases_s``."""
    calls: list[CollectiveCall]
    """Every collective of one step, as recorded."""
    group_phases: dict[str, str]
    """Process group name -> projection phase of its collectives (expert, pipeline, grad)."""
    family_groups: dict[str, str]
    """Parameter family (dense, expert) -> the group its gradient collectives run on."""
    buckets: list[BucketMeasurement] = field(default_factory=list)
    """The optimizer's gradient buckets and their overlap windows (none: every gradient collective is
    priced as launched when the backward ends)."""

    def seconds(self, *names: str) -> float:
        """Seconds of the named phases, forward and backward together."""
        return sum(sum(self.phases_s.get(name, {}).values()) for name in names)

    def split(self) -> dict[str, float]:
        """The step's compute by how it scales: blocks, rest (final norm, LM head, loss: what the phases
        leave of the compute), embedding, optimizer and grad_buffers; seconds per step."""
        parts = {
            "blocks": self.seconds(*BLOCK_PHASES),
            "embedding": self.seconds(EMBEDDING),
            "optimizer": self.seconds("optimizer"),
            "grad_buffers": self.seconds(GRAD_BUFFERS),
        }
        parts["rest"] = max(
            0.0, self.compute_s - parts["optimizer"] - parts["grad_buffers"] - parts["embedding"] - parts["blocks"]
        )
        return parts

    def blocks_backward_s(self, microbatches: int) -> float:
        """The blocks' backward of one microbatch (every microbatch has the same shapes)."""
        return sum(self.phases_s.get(name, {}).get("backward", 0.0) for name in BLOCK_PHASES) / microbatches


@dataclass(frozen=True)
class ProjectionTarget:
    """The cluster a projection prices the rank's step on."""

    rank: int
    """The replayed global rank."""
    world_size: int
    pp: int
    """Pipeline stages."""
    schedule: str
    """Pipeline schedule (gpipe, 1f1b)."""
    net: Network

    def schedule_of(self, microbatches: int) -> Schedule:
        return Schedule(self.pp, 1, microbatches, self.schedule)


@dataclass(frozen=True)
class ScaledStep:
    """A projection's inputs at one scale and the step it projects."""

    microbatch_phases_s: dict[str, float]
    """blocks, rest and embedding: seconds of one microbatch at this scale."""
    step_phases_s: dict[str, float]
    """optimizer and grad_buffers: seconds of the once-per-step work at this scale."""
    timing: RankTiming
    per_microbatch: list[Collective]
    """One microbatch's expert and pipeline collectives at this scale."""
    per_step: list[Collective]
    """The once-per-step grad and other collectives at this scale that no bucket stands for."""
    grad_buckets: list[SyncBucket]
    """The gradient buckets' reductions at this scale, in launch order, with their windows."""
    gather_buckets: list[SyncBucket]
    """The ZeRO-1 gathers at this scale, in launch order, with their windows."""
    projection: Projection


def project_run_scale(
    measured: StepMeasurement, scale: ProxyScale, target: ProjectionTarget, tokens_per_step: int, flops_per_token: float
) -> ScaledStep:
    """The projection of the step as it ran: the measured compute and collectives over the run's microbatches."""
    parts, m = measured.split(), scale.microbatches_run
    calls = unbucketed_calls(measured.calls, measured.buckets)
    per_microbatch, per_step = classify_calls(calls, measured.group_phases, m)
    grad_buckets, gather_buckets = scaled_sync_buckets(measured.buckets, measured.blocks_backward_s(m))
    optimizer, grad_buffers = parts["optimizer"], parts["grad_buffers"]
    timing = RankTiming(
        microbatch_s=(measured.compute_s - optimizer - grad_buffers) / m, optimizer_s=optimizer + grad_buffers
    )
    projection = project_step(
        target.rank,
        timing,
        per_microbatch,
        per_step,
        target.schedule_of(m),
        target.net,
        tokens_per_step,
        target.world_size,
        flops_per_token,
        grad_buckets,
        gather_buckets,
    )
    return ScaledStep(
        {k: parts[k] / m for k in ("blocks", "rest", "embedding")},
        {"optimizer": optimizer, "grad_buffers": grad_buffers},
        timing,
        per_microbatch,
        per_step,
        grad_buckets,
        gather_buckets,
        projection,
    )


def project_full_scale(
    measured: StepMeasurement,
    scale: ProxyScale,
    run: StageSize,
    full: StageSize,
    target: ProjectionTarget,
    tokens_per_step: int,
    flops_per_token: float,
) -> ScaledStep:
    """The projection of the scenario's step from the run's measurement (rules in the module docstring).

    Per microbatch (the measured step's over its ``scale.microbatches_run``): the blocks x block ratio x
    token ratio, the rest x token ratio, the embedding as measured. Once per step: the optimizer x
    full / run optimizer bytes, the gradient buffers x full / run gradient bytes. Collectives by
    ``CallScaling`` (dense and expert parameter ratios from ``run`` and ``full``), the buckets' by
    ``scaled_sync_buckets``. Over the scenario's ``scale.microbatches_full``; ``tokens_per_step`` and
    ``flops_per_token`` are the scenario's.
    """
    parts, m = measured.split(), scale.microbatches_run
    params = {"dense": (run.dense_params, full.dense_params), "expert": (run.expert_params, full.expert_params)}
    scaling = CallScaling(
        scale.token_ratio,
        scale.block_ratio,
        {
            name: params[family][1] / params[family][0] if params[family][0] else 1.0
            for family, name in measured.family_groups.items()
        },
    )
    calls = unbucketed_calls(measured.calls, measured.buckets)
    per_microbatch, per_step = classify_calls(calls, measured.group_phases, m, scaling)
    grad_buckets, gather_buckets = scaled_sync_buckets(
        measured.buckets, measured.blocks_backward_s(m), scale.block_ratio, scale.token_ratio
    )
    # The optimizer works on the rank's optimizer shard; zeroing and scaling on its gradient buffers.
    optimizer_ratio = full.optimizer_bytes / run.optimizer_bytes
    grad_ratio = full.grad_bytes / run.grad_bytes
    blocks, rest, embedding = parts["blocks"], parts["rest"], parts["embedding"]
    step_phases = {
        "optimizer": parts["optimizer"] * optimizer_ratio,
        "grad_buffers": parts["grad_buffers"] * grad_ratio,
    }
    timing = RankTiming(
        microbatch_s=((blocks * scale.block_ratio + rest) * scale.token_ratio + embedding) / m,
        optimizer_s=step_phases["optimizer"] + step_phases["grad_buffers"],
    )
    projection = project_step(
        target.rank,
        timing,
        per_microbatch,
        per_step,
        target.schedule_of(scale.microbatches_full),
        target.net,
        tokens_per_step,
        target.world_size,
        flops_per_token,
        grad_buckets,
        gather_buckets,
    )
    microbatch_phases = {
        "blocks": blocks * scale.block_ratio * scale.token_ratio / m,
        "rest": rest * scale.token_ratio / m,
        "embedding": embedding / m,
    }
    return ScaledStep(
        microbatch_phases, step_phases, timing, per_microbatch, per_step, grad_buckets, gather_buckets, projection
    )
