"""Proxy mode: run one rank of a scenario's layout for real in a fake world, then project the cluster.

What runs
    The process joins a fake world as ``proxy.rank`` of the layout's dp * pp ranks and builds only
    that rank's share (``moe_engine.proxy``): its pipeline stage, its local experts, its optimizer
    shard. Collectives are issued but move nothing; the recorder logs their sizes. Peers' traffic is
    simulated from the routing mode (``moe_engine.proxy.peers``). On a CPU host ``proxy.cpu_scale``
    shrinks the run: fewer blocks of the stage (every block of a stage has the same shapes), shorter
    sequences, fewer sequences per microbatch, fewer microbatches, and fp32 for a CPU without bf16 units
    (``cpu_scale.precision``: the plan it is checked against is then the fp32 plan of the same run);
    the experts keep their shapes. A GPU host runs the
    scenario's own sizes. The proxy runs as many microbatches as the schedule keeps in flight on the
    rank (so the activation peak is the real one), at least 2 (the accumulation path) and at most the
    scenario's.

What is measured (at the run's scale)
    Step time without the proxy's own work of fabricating peers' data, split into phases by
    ``moe_engine.phase_timer`` (attention, router, dispatch, experts, shared expert, dense FFN, block
    norms and residuals, embedding, optimizer, gradient buffers = zeroing them and scaling each bucket
    as its reduction launches, other = final norm, LM head, loss), the peak memory (CUDA allocator, or
    tracked tensor bytes on CPU), overall and for forward/backward and the optimizer step apart; every
    collective's bytes per step. Per gradient bucket (the optimizer's ``SyncTimeline`` and the phase
    timer read as it launches): the compute of the last backward left after its reduction launched,
    split by how it scales (blocks, rest, embedding, later buckets' launches; fabrication left out),
    its share's optimizer update, and its bytes (``details.sync_windows``). The collectives take no
    time on the fake world, so these are the windows a real rank's collectives could hide under.

Projection (``bench.predict.projection``)
    At the run's scale, and scaled to the scenario's: per-microbatch compute of the stage's blocks
    times full_blocks / run_blocks; the blocks and the rest of a microbatch (final norm, LM head,
    loss) times full / run tokens per microbatch (linear in tokens: attention's quadratic term is not
    rescaled); the embedding once per microbatch, unscaled (its backward makes a whole V x D
    gradient); the optimizer times the rank's full / run optimizer-state bytes and the gradient
    buffers' zeroing and scaling times its gradient bytes, once per step; gradient collectives'
    bytes times their family's parameter ratio; all-to-all bytes times the token ratio and their
    count times the block ratio; stage messages times the token ratio; over the scenario's
    microbatches. ``project_run_scale`` and ``project_full_scale`` compute both from a
    ``StepMeasurement`` and the stage's ``StageSize`` at either scale: arithmetic, no model runs.

Overlap windows at the scenario's scale
    ``scaled_sync_buckets``: each gradient bucket's reduction and ZeRO-1 gather, with the compute it
    can hide under, grown from the run's blocks and tokens to the scenario's; the rules are with the
    queue they feed, in ``bench.predict.projection``'s docstring ("Overlap windows of a scaled-down
    run"). Collectives of the gradient groups that no bucket stands for (e.g. the expert-bias counts)
    launch when the backward ends.

Plan vs proxy
    ``bench.predict.plan`` evaluated on exactly what the proxy ran (same blocks, tokens, microbatches), for the
    rank's pipeline stage, next to the measured peak.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bench.predict.plan import plan_scenario
from bench.predict.projection import (
    Collective,
    Network,
    Projection,
    RankTiming,
    Schedule,
    SyncBucket,
    project_step,
    summarize_collectives,
)
from bench.results import metric
from bench.run.execute import ExecuteResult, NonFiniteLoss, synchronize
from bench.run.memory import TensorMemoryTracker, rss_peak_bytes
from bench.run.trace import group_phases
from bench.scenario import Scenario, scenario_from_dict
from moe_engine.flops import training_flops_per_token
from moe_engine.model import Block
from moe_engine.parallel.collective_log import CollectiveCall, CollectiveRecorder
from moe_engine.parallel.data_parallel import DataParallelOptimizer, SyncTimeline
from moe_engine.parallel.groups import ProcessGroups, build_process_groups
from moe_engine.parallel.layout import Layout, stage_layers
from moe_engine.parallel.trainer import ParallelTrainer
from moe_engine.phase_timer import PhaseTimer, instrument_model
from moe_engine.proxy.build import build_proxy_rank
from moe_engine.proxy.peers import ProxyDispatcher
from moe_engine.proxy.world import join_fake_world, leave_fake_world

BLOCK_PHASES = ("attention", "router", "dispatch", "experts", "shared_expert", "dense_ffn", "block")
FABRICATION = "fabrication"
EMBEDDING = "embedding"
GRAD_BUFFERS = "grad_buffers"
WINDOW_CLASSES = ("blocks", "rest", "embedding", "grad_buffers")
"""How a stretch of the last backward scales: the block phases, the rest (what no phase times), the
embedding, and gradient buckets' launches (scaling the bucket by 1/dp)."""


@dataclass(frozen=True)
class ProxyScale:
    """What the proxy runs against what the scenario describes, for the replayed rank."""

    rank: int
    """Global rank replayed."""
    pp_rank: int
    """Its pipeline rank."""
    blocks_run: int
    """Transformer blocks of its stage that the proxy builds."""
    blocks_full: int
    """Blocks of its stage in the scenario."""
    seq_len_run: int
    """Tokens per sequence in the run."""
    tokens_per_microbatch_run: int
    """Tokens per microbatch on the rank, in the run."""
    tokens_per_microbatch_full: int
    """Tokens per microbatch on the rank, in the scenario."""
    microbatches_run: int
    """Microbatches per step in the run."""
    microbatches_full: int
    """Microbatches per step in the scenario."""

    @property
    def block_ratio(self) -> float:
        return self.blocks_full / self.blocks_run

    @property
    def token_ratio(self) -> float:
        return self.tokens_per_microbatch_full / self.tokens_per_microbatch_run


def run_spec(scenario: Scenario, device: torch.device) -> tuple[dict[str, Any], ProxyScale]:
    """The scenario as the proxy runs it (scaled on CPU), and the scale against the original."""
    spec = copy.deepcopy(scenario.spec)
    model, par, proxy = spec["model"], spec["parallel"], spec["proxy"]
    layout = Layout(scenario.parallel_config)
    pp_rank = layout.coords(proxy["rank"]).pp_rank
    n_layers, seq_len, pp, dp = model["n_layers"], model["seq_len"], par["pp"], par["dp"]
    blocks_full = len(stage_layers(n_layers, pp)[pp_rank])
    m_full = par["microbatches"]
    sequences_full = scenario.run["tokens_per_step"] // seq_len // dp // m_full
    scale = proxy["cpu_scale"] if device.type == "cpu" else {}

    blocks = min(scale.get("blocks") or blocks_full, blocks_full)
    if blocks < blocks_full:
        model["n_layers"] = pp * blocks
    seq_len_run = scale.get("seq_len") or seq_len
    model["seq_len"] = seq_len_run
    sequences = scale.get("sequences_per_microbatch") or sequences_full
    if scale.get("microbatches"):
        m_run = min(scale["microbatches"], m_full)
    elif proxy["microbatches"]:
        m_run = min(proxy["microbatches"], m_full)
    elif pp > 1:
        in_flight = m_full if par["schedule"] == "gpipe" else min(m_full, pp - pp_rank)
        m_run = max(min(2, m_full), in_flight)
    else:
        m_run = min(2, m_full)
    par["microbatches"] = m_run
    spec["run"]["tokens_per_step"] = dp * m_run * sequences * seq_len_run
    if scale.get("precision"):
        spec["precision"] = scale["precision"]
    scale_record = ProxyScale(
        rank=proxy["rank"], pp_rank=pp_rank, blocks_run=blocks, blocks_full=blocks_full,
        seq_len_run=seq_len_run, tokens_per_microbatch_run=sequences * seq_len_run,
        tokens_per_microbatch_full=sequences_full * seq_len, microbatches_run=m_run, microbatches_full=m_full,
    )
    return spec, scale_record


def _as_plan(spec: dict[str, Any]) -> Scenario:
    plan = copy.deepcopy(spec)
    plan["mode"] = "plan"
    plan.pop("proxy", None)
    return scenario_from_dict(plan)


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
        target.rank, timing, per_microbatch, per_step, target.schedule_of(m), target.net,
        tokens_per_step, target.world_size, flops_per_token, grad_buckets, gather_buckets,
    )
    return ScaledStep(
        {k: parts[k] / m for k in ("blocks", "rest", "embedding")},
        {"optimizer": optimizer, "grad_buffers": grad_buffers},
        timing, per_microbatch, per_step, grad_buckets, gather_buckets, projection,
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
        {name: params[family][1] / params[family][0] if params[family][0] else 1.0
         for family, name in measured.family_groups.items()},
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
        "optimizer": parts["optimizer"] * optimizer_ratio, "grad_buffers": parts["grad_buffers"] * grad_ratio,
    }
    timing = RankTiming(
        microbatch_s=((blocks * scale.block_ratio + rest) * scale.token_ratio + embedding) / m,
        optimizer_s=step_phases["optimizer"] + step_phases["grad_buffers"],
    )
    projection = project_step(
        target.rank, timing, per_microbatch, per_step, target.schedule_of(scale.microbatches_full), target.net,
        tokens_per_step, target.world_size, flops_per_token, grad_buckets, gather_buckets,
    )
    microbatch_phases = {
        "blocks": blocks * scale.block_ratio * scale.token_ratio / m,
        "rest": rest * scale.token_ratio / m,
        "embedding": embedding / m,
    }
    return ScaledStep(
        microbatch_phases, step_phases, timing, per_microbatch, per_step, grad_buckets, gather_buckets, projection
    )


def _batches(sequences: int, seq_len: int, vocab: int, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed + 12345)
    while True:
        tokens = torch.randint(0, vocab, (sequences, seq_len + 1), generator=generator).to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def _timed(owner, method: str, timer: PhaseTimer, phase: str) -> None:
    """Time every call of ``owner.method`` as ``phase``."""
    inner = getattr(owner, method)

    def timed(*args, **kwargs):
        with timer.region(phase):
            return inner(*args, **kwargs)

    setattr(owner, method, timed)


def _instrument(trainer: ParallelTrainer, rank_model, timer: PhaseTimer) -> None:
    """Phases of the blocks, plus the work whose size follows the parameters rather than the tokens:
    the optimizer, zeroing the gradient buffers, and the embedding (its backward makes a
    whole vocabulary x d_model gradient per microbatch)."""
    instrument_model(timer, rank_model.module)
    embed = getattr(rank_model.module, "embed", None)
    if embed is not None:
        # Its input (token ids) takes no gradient: its backward phase runs until the pass ends,
        # and the embedding's backward is the last work of the pass.
        timer.instrument(embed, EMBEDDING, open_ended=True)
    _timed(trainer.optimizer, "step", timer, "optimizer")
    _timed(trainer.optimizer, "zero_grad", timer, GRAD_BUFFERS)


def _window_classes(
    clock_s: float, start: dict[str, dict[str, float]], end: dict[str, dict[str, float]]
) -> dict[str, float]:
    """A stretch of ``clock_s`` seconds between two phase-timer readings, by ``WINDOW_CLASSES``, without
    fabrication."""

    def spent(*names: str) -> float:
        return sum(sum(end.get(n, {}).values()) - sum(start.get(n, {}).values()) for n in names)

    classes = {"blocks": spent(*BLOCK_PHASES), "embedding": spent(EMBEDDING), "grad_buffers": spent(GRAD_BUFFERS)}
    classes["rest"] = max(0.0, clock_s - sum(classes.values()) - spent(FABRICATION))
    return classes


class _SyncProbe:
    """Reads the clock and the phase timer as each bucket's reduction is issued and as the backward ends,
    so that each window of the optimizer's ``SyncTimeline`` splits by how it scales, without the proxy's
    fabrication. Each launch (scaling the bucket by 1/dp, then the collective) is timed as grad_buffers:
    its cost follows the bucket's bytes, not the tokens of the phase it happens to run in."""

    def __init__(self, optimizer: DataParallelOptimizer, timer: PhaseTimer):
        self.optimizer, self.timer = optimizer, timer
        self.reset()
        for index, bucket in enumerate(optimizer.buckets):
            self._wrap_launch(bucket, index)
        finish, clip = optimizer.finish_grad_sync, optimizer.clip_grad_norm

        def finish_grad_sync():
            if self.backward_end is None:
                self.backward_end = self._reading()
            finish()

        def clip_grad_norm():
            norm = clip()
            self.updates_start = time.perf_counter()
            return norm

        optimizer.finish_grad_sync, optimizer.clip_grad_norm = finish_grad_sync, clip_grad_norm

    def _reading(self) -> tuple[float, dict[str, dict[str, float]]]:
        return time.perf_counter(), self.timer.totals

    def _wrap_launch(self, bucket, index: int) -> None:
        launch = bucket.launch_reduce

        def launch_reduce():
            with self.timer.region(GRAD_BUFFERS):
                launch()
            self.issued[index] = self._reading()

        bucket.launch_reduce = launch_reduce

    def reset(self) -> None:
        """Forget the last step's readings (call before each step)."""
        self.issued: dict[int, tuple[float, dict[str, dict[str, float]]]] = {}
        self.backward_end: tuple[float, dict[str, dict[str, float]]] | None = None
        self.updates_start: float | None = None

    def record(self, timeline: SyncTimeline) -> list[dict[str, Any]]:
        """Per bucket, of the step just run: its windows (``SyncTimeline``'s and split by class) and its update."""
        end_s, end_totals = self.backward_end
        # Without clipping the updates start as soon as the reductions have been waited for.
        previous = self.updates_start if self.updates_start is not None else timeline.reduce_waited_s
        reduce_windows, gather_windows = timeline.reduce_windows_s(), timeline.gather_windows_s()
        rows = []
        for index in range(len(self.optimizer.buckets)):
            issued_s, totals = self.issued[index]
            classes = _window_classes(end_s - issued_s, totals, end_totals) if issued_s < end_s else {}
            launch = timeline.gather_launch_s[index]
            rows.append({
                "reduce_window_s": reduce_windows[index],
                "reduce_window_compute_s": {name: classes.get(name, 0.0) for name in WINDOW_CLASSES},
                "update_s": launch - previous,
                "gather_window_s": gather_windows[index],
            })
            previous = launch
        return rows


def _bucket_layout(
    optimizer: DataParallelOptimizer, module: torch.nn.Module, bucket_elements: int
) -> list[dict[str, Any]]:
    """Per bucket: its family, the collectives it issues (as the recorder logs them), its block share and
    whether it filled up (``BucketMeasurement``)."""
    in_blocks = {id(p) for m in module.modules() if isinstance(m, Block) for p in m.parameters()}
    layout = []
    for bucket, grad_bytes in zip(optimizer.buckets, optimizer.bucket_bytes()):
        group = bucket.comm.group
        reduce = gather = None
        if group is not None:
            ranks, name = tuple(dist.get_process_group_ranks(group)), group.group_name
            reduce = CollectiveCall("reduce_scatter" if bucket.shard else "all_reduce", ranks, grad_bytes, name)
            if bucket.shard:
                param_bytes = bucket.param_N.numel() * bucket.param_N.element_size()
                gather = CollectiveCall("all_gather", ranks, param_bytes, name)
        elements = sum(p.numel() for p in bucket.params)
        block_elements = sum(p.numel() for p in bucket.params if id(p) in in_blocks)
        layout.append({
            "family": bucket.family.value, "reduce": reduce, "gather": gather,
            "block_share": block_elements / elements if elements else 0.0,
            "filled": elements >= bucket_elements,
        })
    return layout


@dataclass
class _Measured:
    compute_s: list[float]
    phases: list[dict[str, dict[str, float]]]
    calls: list[CollectiveCall]
    memory: dict[str, int]
    losses: list[float]
    buckets: list[dict[str, Any]] = field(default_factory=list)
    """Per bucket (``_bucket_layout``): family, collectives, block share, filled."""
    syncs: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per measured step, per bucket: ``_SyncProbe.record``."""


def _measure(scenario: Scenario, scale: ProxyScale, device: torch.device, progress) -> tuple[_Measured, ProcessGroups]:
    parallel, config, run = scenario.parallel_config, scenario.model, scenario.run
    groups = build_process_groups(Layout(parallel))
    seed = scenario.spec["routing"]["seed"]
    progress(f"building rank {scale.rank}'s share ({scale.blocks_run} of {scale.blocks_full} blocks of stage {scale.pp_rank})")
    rank_model = build_proxy_rank(
        config, parallel, groups, device, seed, recompute=scenario.recompute, compile=run["compile"]
    )
    trainer = ParallelTrainer(rank_model, parallel, groups, scenario.optimizer)
    sync = functools.partial(synchronize, device)
    timer = PhaseTimer(synchronize=sync)
    _instrument(trainer, rank_model, timer)
    probe = _SyncProbe(trainer.optimizer, timer)
    fabrication = functools.partial(timer.region, FABRICATION)
    for layer in rank_model.moe_layers():
        if isinstance(layer.dispatcher, ProxyDispatcher):
            layer.dispatcher.fabrication = fabrication
    if rank_model.pipeline is not None:
        rank_model.pipeline.fabrication = fabrication

    sequences = scale.microbatches_run * scale.tokens_per_microbatch_run // scale.seq_len_run
    batches = _batches(sequences, scale.seq_len_run, config.vocab_size, device, seed)
    layout = _bucket_layout(trainer.optimizer, rank_model.module, parallel.bucket_elements)
    measured = _Measured([], [], [], {}, [], layout)
    total = run["warmup_steps"] + run["steps"]
    for step in range(max(total, 1 + run["steps"])):
        tokens, labels = next(batches)
        census = step == 0
        is_measured = step >= max(run["warmup_steps"], 1)
        if is_measured and device.type == "cuda" and not measured.compute_s:
            torch.cuda.reset_peak_memory_stats(device)
        timer.reset()
        probe.reset()
        sync()
        start = time.perf_counter()
        if census:
            with CollectiveRecorder() as recorder:
                loss = trainer.step(tokens, labels)
            measured.calls = recorder.calls
        else:
            loss = trainer.step(tokens, labels)
        sync()
        wall = time.perf_counter() - start
        totals = timer.totals
        fabricated = sum(totals.get(FABRICATION, {}).values())
        if loss is not None and not math.isfinite(float(loss)):
            raise NonFiniteLoss(f"the proxy's loss is {float(loss)} at step {step}")
        if is_measured:
            measured.compute_s.append(wall - fabricated)
            measured.phases.append(totals)
            measured.syncs.append(probe.record(trainer.optimizer.timeline))
            if loss is not None:
                measured.losses.append(float(loss))
        progress(
            f"step {step + 1}: {'measured' if is_measured else 'warm-up'} {wall - fabricated:.3f}s compute"
            f" (+{fabricated:.3f}s fabricating peers)"
        )
    if device.type == "cuda":
        measured.memory = {
            "cuda_peak_active_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    else:
        progress("memory step (tracked tensors)")
        tokens, labels = next(batches)
        optimizer_step, peaks = trainer.optimizer.step, {}
        with TensorMemoryTracker(trainer.resident_tensors()) as tracker:

            def split_peaks():
                # The forward/backward peak and the optimizer step's, each against its plan term.
                peaks["forward_backward"] = tracker.peak
                tracker.peak = tracker.current
                optimizer_step()

            trainer.optimizer.step = split_peaks
            trainer.step(tokens, labels)
        trainer.optimizer.step = optimizer_step
        measured.memory = {
            "peak_tensor_bytes": max(peaks["forward_backward"], tracker.peak),
            "peak_forward_backward_bytes": peaks["forward_backward"],
            "peak_optimizer_step_bytes": tracker.peak,
            "resident_tensor_bytes": tracker.baseline,
            "rss_peak_bytes": rss_peak_bytes(),
        }
    return measured, groups


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _phase_table(measured: _Measured) -> dict[str, dict[str, float]]:
    """Median seconds per phase and direction over the measured steps, plus other and optimizer."""
    names = sorted({name for totals in measured.phases for name in totals})
    table = {
        name: {d: _median([t.get(name, {}).get(d, 0.0) for t in measured.phases]) for d in ("forward", "backward")}
        for name in names
    }
    compute = _median(measured.compute_s)
    accounted = sum(sum(v.values()) for k, v in table.items() if k != FABRICATION)
    table["other"] = {"forward": max(0.0, compute - accounted), "backward": 0.0}
    return table


def _sync_table(measured: _Measured) -> list[dict[str, Any]]:
    """Per bucket, in launch order: its bytes and the medians of its windows over the measured steps."""
    rows = []
    for index, layout in enumerate(measured.buckets):
        steps = [step[index] for step in measured.syncs]
        reduce, gather = layout["reduce"], layout["gather"]
        rows.append({
            "family": layout["family"],
            "reduce_op": reduce.op if reduce else None,
            "group_size": len(reduce.ranks) if reduce else 1,
            "grad_bytes": reduce.nbytes if reduce else 0,
            "param_gather_bytes": gather.nbytes if gather else 0,
            "block_share": layout["block_share"],
            "filled": layout["filled"],
            "reduce_window_s": _median([s["reduce_window_s"] for s in steps]),
            "reduce_window_compute_s": {
                name: _median([s["reduce_window_compute_s"][name] for s in steps]) for name in WINDOW_CLASSES
            },
            "update_s": _median([s["update_s"] for s in steps]),
            "gather_window_s": _median([s["gather_window_s"] for s in steps]),
        })
    return rows


def _bucket_measurements(measured: _Measured, table: list[dict[str, Any]]) -> list[BucketMeasurement]:
    return [
        BucketMeasurement(layout["reduce"], layout["gather"], layout["block_share"], layout["filled"],
                          row["reduce_window_compute_s"], row["update_s"])
        for layout, row in zip(measured.buckets, table)
    ]


def run_proxy(
    scenario: Scenario,
    device: torch.device,
    progress: Callable[[str], None] = lambda line: None,
    project_devices: list[str] = (),
) -> ExecuteResult:
    """Run the proxy of ``scenario`` in this process (which must not be in a process group); the result
    also carries the op-level projection on its ``cluster.device`` and on each of ``project_devices``."""
    spec, scale = run_spec(scenario, device)
    run_scenario = scenario_from_dict(spec, file=scenario.file)
    if scenario.proxy["threads"]:
        torch.set_num_threads(scenario.proxy["threads"])
    join_fake_world(scale.rank, scenario.world_size)
    try:
        measured, groups = _measure(run_scenario, scale, device, progress)
        phases = group_phases(groups)
        family_groups = {"dense": groups.dp.group_name, "expert": groups.edp.group_name}
    finally:
        leave_fake_world()

    net = Network.from_cluster(scenario.cluster)
    _, plan_run = plan_scenario(_as_plan(spec))
    _, plan_full = plan_scenario(_as_plan(scenario.spec))
    table = _phase_table(measured)
    sync_table = _sync_table(measured)
    measurement = StepMeasurement(
        _median(measured.compute_s), table, measured.calls, phases, family_groups,
        _bucket_measurements(measured, sync_table),
    )
    parallel = run_scenario.parallel_config
    target = ProjectionTarget(scale.rank, scenario.world_size, parallel.pp, parallel.schedule.value, net)
    run_projection = project_run_scale(
        measurement, scale, target,
        run_scenario.run["tokens_per_step"], training_flops_per_token(run_scenario.model, scale.seq_len_run),
    ).projection
    full_projection = project_full_scale(
        measurement, scale, StageSize.from_plan(plan_run, scale.pp_rank), StageSize.from_plan(plan_full, scale.pp_rank),
        target, scenario.run["tokens_per_step"], training_flops_per_token(scenario.model),
    ).projection

    peak_key = "cuda_peak_active_bytes" if device.type == "cuda" else "peak_tensor_bytes"
    measured_peak = measured.memory[peak_key]
    plan_stage = plan_run["stages"][scale.pp_rank]
    plan_total = plan_stage["memory_total_bytes"]
    rank_tokens = scale.microbatches_run * scale.tokens_per_microbatch_run

    result = ExecuteResult()
    m = result.metrics
    m["step_time_s"] = metric(measured.compute_s, "s", "lower")
    m["rank_tokens_per_s"] = metric([rank_tokens / t for t in measured.compute_s], "tokens/s", "higher")
    m[peak_key] = metric([measured_peak], "bytes", "lower")
    m["plan_memory_total_bytes"] = metric([plan_total], "bytes", None)
    m["plan_memory_gap"] = metric([measured_peak / plan_total - 1], "ratio", None)
    for prefix, projection in (("projected_run", run_projection), ("projected", full_projection)):
        m[f"{prefix}_step_time_s"] = metric([projection.step_s], "s", None)
        m[f"{prefix}_tokens_per_s_per_gpu"] = metric([projection.tokens_per_s_per_gpu], "tokens/s", None)
        m[f"{prefix}_tflops_per_gpu"] = metric([projection.tflops_per_gpu], "TFLOP/s", None)
    m["projected_memory_total_bytes"] = metric([plan_full["stages"][scale.pp_rank]["memory_total_bytes"]], "bytes", None)

    calls_per_step = [Collective(c.op, c.ranks, c.nbytes, phases.get(c.group_name, "other")) for c in measured.calls]
    result.details.update(
        rank=asdict(groups.layout.coords(scale.rank)),
        scale=asdict(scale) | {"block_ratio": scale.block_ratio, "token_ratio": scale.token_ratio},
        run_scale_note=_scale_note(scale, device),
        phases_s=table,
        sync_windows={
            "buckets": sync_table,
            "blocks_backward_per_microbatch_s": measurement.blocks_backward_s(scale.microbatches_run),
            "note": "per gradient bucket in launch order, medians over the measured steps: reduce_window_s = the "
                    "backward time left after its reduction launched (SyncTimeline), reduce_window_compute_s = "
                    "the compute of it left after the collective was issued, by how it scales (fabrication left "
                    "out), update_s = its share's optimizer update, gather_window_s = the updates left after its "
                    "ZeRO-1 gather launched; collectives take no time on the fake world",
        },
        memory=measured.memory,
        collectives_per_step=summarize_collectives(calls_per_step),
        projection_run_scale=run_projection.to_dict(),
        projection=full_projection.to_dict(),
        projection_scaling=[
            "per-microbatch compute of the stage's blocks x blocks_full / blocks_run; the blocks and the rest "
            "of the microbatch (final norm, LM head, loss) x tokens_full / tokens_run per microbatch (linear in "
            "tokens; attention's quadratic term not rescaled); the embedding once per microbatch, unscaled (its "
            "backward makes a whole vocabulary x d_model gradient whatever the tokens)",
            "the optimizer step x the rank's full / run optimizer-state bytes, zeroing and scaling the gradient "
            "buffers x its full / run gradient bytes (both once per step, in the projection's optimizer time); "
            "each gradient bucket of block parameters repeats once per copy of the run's blocks (ceil of the "
            "block ratio copies, block_ratio / copies of its bytes each), other buckets keep their count with "
            "their block parameters' bytes x the block ratio; their overlap windows scale as the compute they "
            "hold (rules in bench/predict/projection.py); other gradient-group collectives' bytes x the dense "
            "or expert parameter ratio; all-to-all bytes x the token ratio and their count x the block ratio; "
            "stage messages' bytes x the token ratio",
            "the compute is this machine's: on a CPU the projection prices a cluster of these CPUs on the "
            "scenario's network, not the scenario's GPUs",
        ],
        plan_vs_proxy=_plan_vs_proxy(plan_stage, plan_run, measured.memory, peak_key, device),
        device_projections=_device_projections(scenario, project_devices, progress),
        plan_full_scale={"memory_total_bytes": plan_full["stages"][scale.pp_rank]["memory_total_bytes"],
                         "memory_bytes": plan_full["stages"][scale.pp_rank].get("memory_bytes")},
        network=asdict(net),
        flops_per_token=training_flops_per_token(scenario.model),
        tokens_per_step=scenario.run["tokens_per_step"],
        world_size=scenario.world_size,
        layout=scenario.parallel_config.to_dict(),
        losses=measured.losses,
    )
    return result


def _device_projections(scenario: Scenario, extra: list[str], progress) -> dict[str, Any]:
    """The op-level projection (``bench.run.project``) on each device: the scenario's own, then ``extra``."""
    from bench.predict.device import load_profile
    from bench.run.project import DoesNotFit, NotTraceable, project_on_device

    names = [n for n in [scenario.cluster.get("device"), *extra] if n]
    projections = {}
    for name in dict.fromkeys(names):
        try:
            projections[name] = project_on_device(scenario, load_profile(name), progress=progress)
        except DoesNotFit as err:
            projections[name] = {"device": name, "fits": False, "error": str(err)}
        except NotTraceable as err:
            projections[name] = {"device": name, "error": str(err)}
    return projections


def _scale_note(scale: ProxyScale, device: torch.device) -> str:
    if scale.block_ratio == 1 and scale.token_ratio == 1 and scale.microbatches_run == scale.microbatches_full:
        return f"ran at the scenario's own sizes on {device.type}"
    return (
        f"scaled down on {device.type}: {scale.blocks_run} of the stage's {scale.blocks_full} blocks, "
        f"{scale.tokens_per_microbatch_run} instead of {scale.tokens_per_microbatch_full} tokens per microbatch "
        f"(sequences of {scale.seq_len_run}), {scale.microbatches_run} of {scale.microbatches_full} microbatches; "
        "same code path and the same shapes per expert, fewer tokens"
    )


def _plan_vs_proxy(plan_stage, plan_run, memory, peak_key, device) -> dict[str, Any]:
    planned = plan_stage.get("memory_bytes", {})
    state = sum(planned.get(k, 0) for k in ("params", "grads", "optimizer"))
    transient = sum(planned.get(k, 0) for k in ("activations", "comm_buffers"))
    out = {
        "measured_peak_bytes": memory[peak_key],
        "plan_total_bytes": plan_stage["memory_total_bytes"],
        "gap": memory[peak_key] / plan_stage["memory_total_bytes"] - 1,
        "plan_bytes": planned,
        "plan_state_bytes": state,
        "plan_transient_bytes": transient,
    }
    if "resident_tensor_bytes" in memory:
        out["measured_state_bytes"] = memory["resident_tensor_bytes"]
        out["measured_transient_bytes"] = memory[peak_key] - memory["resident_tensor_bytes"]
        backward = state + sum(planned.get(k, 0) for k in ("activations", "comm_buffers", "backward_workspace"))
        step = state + planned.get("optimizer_step", 0)
        out["forward_backward"] = {
            "measured_peak_bytes": memory["peak_forward_backward_bytes"], "plan_bytes": backward,
            "gap": memory["peak_forward_backward_bytes"] / backward - 1,
        }
        out["optimizer_step"] = {
            "measured_peak_bytes": memory["peak_optimizer_step_bytes"], "plan_bytes": step,
            "gap": memory["peak_optimizer_step_bytes"] / step - 1,
        }
    out["measured_on"] = "CUDA allocator peak" if device.type == "cuda" else "tracked tensor bytes (CPU)"
    return out
