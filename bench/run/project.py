"""``moe-bench project SCENARIO --device NAME``: a layout's step on a device, priced op by op.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.predict.breakdown import step_breakdown
from bench.predict.collectives import Network
from bench.predict.device import DeviceProfile
from bench.predict.dispatch_rows import DispatchShape
from bench.predict.op_projection import engine_dispatch, project_priced_step, step_prices
from bench.predict.overlap import PairedPipeline, overlapped_pairs
from bench.predict.plan import plan_scenario
from bench.predict.pricing import PricedOp, price_ops
from bench.predict.projection import STEP_KEYS, ZERO_BUBBLE, Schedule
from bench.predict.skew import SkewModel
from bench.predict.split_weights import split_weight_add_s
from bench.run.proxy.rank.pipeline import stage_order
from bench.run.trace import PROGRESS_EVERY_S, StepTrace, retarget, trace_step
from bench.scenario import Scenario, scenario_from_dict
from bench.units import format_gib
from moe_engine.config import DataParallelMode, DispatchKind, ExpertOverlap, RecomputeMode, RoutingMode
from moe_engine.flops import training_flops_per_token
from moe_engine.parallel.layout import Layout, check_proxy_layout, stage_blocks

logger = logging.getLogger(__name__)

TRACED_MICROBATCHES = 2
"""Microbatches a projection traces: the first stands for every one but the last, where buckets launch."""


class DoesNotFit(ValueError):
    """The layout needs more memory per rank than the device has."""


class NotTraceable(ValueError):
    """A layout the trace cannot build a rank of; the message names the field."""


def check_traceable(scenario: Scenario) -> None:
    """The layouts a trace builds: a proxy rank's (ddp, zero1; gpipe or 1f1b, one stage per rank, or a
    multi-stage schedule's rank as its one-stage 1F1B twin), and FSDP without pipeline stages (the real
    build path, whose pipeline would wait for its neighbours)."""
    if scenario.precision == "fp32":
        # torch's fake-tensor kernel of the grouped GEMM takes bf16 operands only.
        raise NotTraceable(f"{scenario.file}: precision: the trace prices bf16 and mxfp8 layouts, got fp32")
    parallel = scenario.parallel_config
    if parallel.dp_mode is DataParallelMode.FSDP:
        if parallel.pp > 1:
            raise NotTraceable(
                f"{scenario.file}: parallel.pp: an FSDP layout traces without pipeline stages, got pp {parallel.pp}"
            )
        return
    try:
        # A rank of a multi-stage schedule is traced as its one-stage 1F1B twin (``traced_scenario``).
        check_proxy_layout(traced_scenario(scenario, None).parallel_config)
    except ValueError as err:
        raise NotTraceable(f"{scenario.file}: {err}") from None


TRACED_SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules a proxy rank runs; a rank of any other is traced as 1F1B (``on_cluster``)."""


def on_cluster(scenario: Scenario, profile: DeviceProfile) -> Scenario:
    """The scenario as it runs on ``profile``'s cluster: ``parallel.ranks_per_node`` left unset (None) is
    the profile's ``gpus_per_node`` where the expert group spans nodes (ep > gpus_per_node), as the
    engine's node-aware dispatch reads it."""
    parallel = scenario.parallel_config
    fields = {f.name for f in dataclasses.fields(parallel)}
    gpus_per_node = Network.from_cluster(profile.cluster()).gpus_per_node
    if "ranks_per_node" not in fields or parallel.ranks_per_node is not None or parallel.ep <= gpus_per_node:
        return scenario
    spec = copy.deepcopy(scenario.spec)
    spec["parallel"]["ranks_per_node"] = gpus_per_node
    return scenario_from_dict(spec, file=scenario.file)


def traced_scenario(scenario: Scenario, microbatches: int | None) -> Scenario:
    """The scenario as traced: only ``microbatches`` of its microbatches per step (same microbatch size),
    and a rank of a schedule other than gpipe or 1f1b as a 1F1B rank with one stage (its per-microbatch
    ops: the same blocks, the same microbatches; the schedule's order, bubble and overlap are the
    projection's, and its stage messages are counted per stage it holds: ``projection_document``)."""
    parallel = scenario.parallel_config
    m = parallel.microbatches
    assert m is not None  # ParallelConfig.__post_init__ resolves None to pp
    one_stage = parallel.pp == 1 or parallel.schedule.value in TRACED_SCHEDULES
    overlapped = parallel.resolved_overlap is ExpertOverlap.MICROBATCHES
    if (microbatches is None or microbatches >= m) and one_stage and not overlapped:
        return scenario
    spec = copy.deepcopy(scenario.spec)
    if overlapped:
        # The same ops one microbatch after the other: the projection prices the interleaving.
        spec["parallel"]["overlap"] = "none"
    if microbatches is not None and microbatches < m:
        spec["parallel"]["microbatches"] = microbatches
        spec["run"]["tokens_per_step"] = scenario.run.tokens_per_step // m * microbatches
    if not one_stage:
        spec["parallel"]["schedule"] = "1f1b"
        spec["parallel"]["virtual_stages"] = 1
    # Trace as an execute-free plan: its mode only decides which sections it needs.
    return scenario_from_dict(spec, file=scenario.file)


def memory_fit(scenario: Scenario, profile: DeviceProfile) -> dict[str, Any]:
    """The plan's most loaded rank against the device's memory."""
    _, details = plan_scenario(scenario)
    need = max(s["memory_total_bytes"] for s in details["stages"])
    return {
        "memory_need_bytes": need,
        "device_memory_bytes": profile.memory_bytes,
        "fraction_of_device": need / profile.memory_bytes,
        "fits": need <= profile.memory_bytes,
        "most_loaded_stage": details["most_loaded"]["memory"],
    }


def _stage_kind(scenario: Scenario, stage: int) -> tuple:
    """What tells a pipeline stage's traced step apart from another's (docs/projection-formulas.md)."""
    model, parallel = scenario.model, scenario.parallel_config
    stages = stage_blocks(model.n_layers, parallel.pp)
    recomputed = set(scenario.recompute.blocks(stages))
    assert parallel.microbatches is not None  # ParallelConfig.__post_init__ resolves None to pp
    return (
        stage == 0,
        stage == parallel.pp - 1,
        tuple((model.is_moe_layer(i), i in recomputed) for i in stages[stage]),
        tuple(stage_order(parallel.schedule, parallel.pp, stage, parallel.microbatches)),
    )


def shared_traces(traced: Scenario) -> list[int]:
    """For each pipeline stage of ``traced`` (the scenario as traced), the stage whose trace it takes:
    the first identical one (docs/projection-formulas.md), itself when it is the first."""
    parallel = traced.parallel_config
    fixed_shapes = (
        parallel.ep == 1
        or parallel.dispatch is DispatchKind.NO_SYNC
        or traced.model.moe.routing is RoutingMode.BALANCED
    )
    if parallel.pp == 1 or not fixed_shapes:
        return list(range(parallel.pp))
    first: dict[tuple, int] = {}
    return [first.setdefault(_stage_kind(traced, stage), stage) for stage in range(parallel.pp)]


@dataclass
class StageTrace:
    """One pipeline stage's traced step (its own or its twin's, retargeted), priced op by op."""

    pipeline_rank: int
    rank: int
    trace: StepTrace
    priced: list[PricedOp]
    shared_with: int | None
    """The pipeline rank whose trace this is; None when traced for this stage."""
    seconds: float
    """Spent on this stage: tracing and pricing, or retargeting a twin's."""


class StageLog:
    """What a projection tells while it traces its stages, as log records: each stage as it starts,
    whether it is traced or takes an identical stage's trace, the trace's ops now and then (every
    ``PROGRESS_EVERY_S``), and what it took. Each record carries ``stage_event`` (begin, stage, ops,
    done), ``scenario``, ``stage``, ``stages``, ``rank`` and ``detail`` for a live display (``bench.run.console.TraceBars``);
    every count of ops is a debug record, one now and then an info line."""

    def __init__(self) -> None:
        self._scenario, self._stages, self._sources = "", 1, [0]
        self._ranks: dict[int, int] = {}
        self._started = self._reported = time.perf_counter()

    def _log(self, level: int, text: str, event: str, stage: int, detail: str = "") -> None:
        extra = {
            "stage_event": event,
            "scenario": self._scenario,
            "stage": stage,
            "stages": self._stages,
            "rank": self._ranks.get(stage),
            "detail": detail,
        }
        logger.log(level, text, extra=extra)

    def begin(self, scenario: str, sources: list[int]) -> None:
        """A projection of ``scenario`` whose stage i takes stage ``sources[i]``'s trace."""
        self._scenario, self._stages, self._sources = scenario, len(sources), sources
        self._started = time.perf_counter()
        self._log(logging.INFO, f"{scenario}: {sharing_text(sources)}", "begin", 0)

    def where(self, stage: int) -> str:
        return f"{self._scenario}: stage {stage} of {self._stages} (rank {self._ranks.get(stage, '?')})"

    def stage(self, stage: int, rank: int, microbatches: int) -> None:
        """Stage ``stage`` (at ``rank``) begins: traced, or its twin's trace taken."""
        self._ranks[stage] = rank
        self._reported = time.perf_counter()
        source = self._sources[stage]
        if source == stage:
            twins = [s for s, src in enumerate(self._sources) if src == stage and s != stage]
            also = f"; its trace serves {_stages(twins)}" if twins else ""
            text = f"{self.where(stage)}: tracing at full size, {microbatches} microbatches{also}"
            self._log(logging.INFO, text, "stage", stage, "tracing")
        else:
            text = f"{self.where(stage)}: taking stage {source}'s trace"
            self._log(logging.DEBUG, text, "stage", stage, f"taking stage {source}'s trace")

    def ops(self, stage: int, count: int, phase: str) -> None:
        """The stage's trace holds ``count`` ops, the latest of ``phase`` (forward, backward, ...)."""
        now = time.perf_counter()
        detail = f"{count:,} ops traced ({phase})"
        if now - self._reported >= PROGRESS_EVERY_S:
            self._reported = now
            text = f"{self.where(stage)}: {detail}, {now - self._started:.0f}s elapsed"
            self._log(logging.INFO, text, "ops", stage, detail)
        elif logger.isEnabledFor(logging.DEBUG):
            self._log(logging.DEBUG, f"{self.where(stage)}: {detail}", "ops", stage, detail)

    def done(self, staged: StageTrace) -> None:
        """A stage is traced and priced, or has its twin's trace."""
        stage = staged.pipeline_rank
        if staged.shared_with is None:
            what = f"traced {len(staged.trace.ops):,} ops in {staged.seconds:.0f}s"
        else:
            what = f"stage {staged.shared_with}'s trace (identical stage)"
        text = f"{self.where(stage)}: {what}; {time.perf_counter() - self._started:.0f}s elapsed"
        self._log(logging.INFO, text, "done", stage)


def sharing_text(sources: list[int], done: bool = False) -> str:
    """Which stages are (``done``: were) traced and which take an identical stage's trace, in words;
    stage i takes stage ``sources[i]``'s."""
    traced = [s for s, src in enumerate(sources) if s == src]
    if len(sources) == 1:
        return "one stage traced" if done else "one stage to trace"
    text = f"{len(traced)} of {len(sources)} stages {'traced' if done else 'to trace'}"
    shared: dict[int, list[int]] = {}
    for stage, source in enumerate(sources):
        if source != stage:
            shared.setdefault(source, []).append(stage)
    if not shared:
        return text + " (every stage)"

    def verb(twins: list[int]) -> str:
        return "took" if done else ("takes" if len(twins) == 1 else "take")

    return (
        text
        + "; "
        + "; ".join(
            f"{_stages(twins)} {verb(twins)} stage {source}'s trace (identical)" for source, twins in shared.items()
        )
    )


def stage_traces(
    traced: Scenario,
    profile: DeviceProfile,
    share: bool = True,
) -> Iterator[StageTrace]:
    """Each pipeline stage's step of ``traced`` (the scenario as traced) at rank (stage, 0, 0), priced on
    ``profile``; with ``share``, identical stages trace once (docs/projection-formulas.md). It logs its
    stages as it goes (``StageLog``)."""
    reporter = StageLog()
    parallel = traced.parallel_config
    assert parallel.microbatches is not None  # ParallelConfig.__post_init__ resolves None to pp
    layout = Layout(parallel)
    sources = shared_traces(traced) if share else list(range(parallel.pp))
    reporter.begin(traced.name, sources)
    own: dict[int, StageTrace] = {}
    for stage, source in enumerate(sources):
        rank = layout.rank_of(stage, 0, 0)
        begun = time.perf_counter()
        reporter.stage(stage, rank, parallel.microbatches)
        if source == stage:
            trace = trace_step(
                traced,
                rank=rank,
                fake=True,
                on_ops=functools.partial(reporter.ops, stage),
            )
            priced = price_ops(trace.ops, profile)
            own[stage] = current = StageTrace(stage, rank, trace, priced, None, time.perf_counter() - begun)
        else:
            twin = own[source]
            trace = retarget(twin.trace, traced, rank)
            # Collectives cost nothing here (the network prices them), so the twin's prices hold op for op.
            priced = [p if p.op is op else dataclasses.replace(p, op=op) for p, op in zip(twin.priced, trace.ops)]
            current = StageTrace(stage, rank, trace, priced, source, time.perf_counter() - begun)
        reporter.done(current)
        yield current


def _stages(stages: list[int]) -> str:
    if len(stages) == 1:
        return f"stage {stages[0]}"
    if len(stages) > 2 and stages == list(range(stages[0], stages[-1] + 1)):
        return f"stages {stages[0]}-{stages[-1]}"
    return "stages " + ", ".join(map(str, stages))


def project_on_device(
    scenario: Scenario,
    profile: DeviceProfile,
    skew: SkewModel | None = None,
    microbatches: int | None = TRACED_MICROBATCHES,
    share_stages: bool = True,
    breakdown: bool = False,
) -> dict[str, Any]:
    """The projection document of ``scenario`` on ``profile`` (docs/projection-formulas.md); ``share_stages`` False
    traces every pipeline stage; ``breakdown`` adds the step by op kind and module (``bench.predict.breakdown``).

    Raises ``DoesNotFit`` (with the numbers) when the plan's rank does not fit the device, and
    ``NotTraceable`` for a layout the trace cannot build.
    """
    scenario = on_cluster(scenario, profile)
    check_traceable(scenario)
    fit = memory_fit(scenario, profile)
    if not fit["fits"]:
        raise DoesNotFit(
            f"{scenario.name}: does not fit {profile.name} ({profile.file}: memory_gb = {profile.memory_gb:g}): "
            f"the most loaded rank (stage {fit['most_loaded_stage']}) needs "
            f"{format_gib(fit['memory_need_bytes'], decimals=1)} by the plan, the device holds {format_gib(profile.memory_bytes, decimals=1)}"
        )
    traced = traced_scenario(scenario, microbatches)
    staged = stage_traces(traced, profile, share_stages)
    return projection_document(scenario, profile, fit, staged, skew, breakdown)


def projection_document(
    scenario: Scenario,
    profile: DeviceProfile,
    fit: dict[str, Any],
    staged_steps: Iterable[StageTrace],
    skew: SkewModel | None = None,
    breakdown: bool = False,
) -> dict[str, Any]:
    """``project_on_device``'s document from every stage's priced step (``stage_traces``) and the memory fit;
    with ``breakdown``, the slowest stage's step by op kind and module (``bench.predict.breakdown``)."""
    parallel = scenario.parallel_config
    assert parallel.microbatches is not None  # ParallelConfig.__post_init__ resolves None to pp
    net = Network.from_cluster(profile.cluster())
    schedule = Schedule(parallel.pp, parallel.virtual_stages, parallel.microbatches, parallel.schedule.value)
    overlap = _overlap(scenario)
    # The proxy rank a trace builds sends per-expert rows; the engine's rows are priced from them.
    shape = DispatchShape(
        scenario.model.moe.num_experts, scenario.model.moe.top_k, parallel.ep, parallel.ranks_per_node or parallel.ep
    )
    rows_kind = parallel.resolved_dispatch_rows.value if parallel.ep > 1 else "per-expert"
    sync = parallel.dispatch is DispatchKind.SYNC
    per_node = rows_kind == "per-node" and shape.nodes > 1
    levels = 2 if per_node else 1
    # Dedup no-sync buffers carry no routing counts to read the chunks from.
    chunks = parallel.a2a_chunks if rows_kind != "per-expert" else None
    dispatched: dict[int, tuple[list[PricedOp], dict[str, str]]] = {}
    flops_per_token = training_flops_per_token(scenario.model)
    staged_steps = list(staged_steps)
    m_traced = staged_steps[0].trace.microbatches
    stages: list[dict[str, Any]] = []
    projections = []
    for staged in staged_steps:
        rank = staged.rank
        priced, phases = dispatched[staged.pipeline_rank] = engine_dispatch(
            staged.priced, staged.trace.group_phases, rows_kind, shape, sync, staged.rank
        )
        prices = step_prices(priced, m_traced, phases, chunks, levels)
        if schedule.kind in ZERO_BUBBLE and schedule.pp > 1:
            # W actions write the weights' gradients past autograd's hooks: the buckets launch when the
            # backward ends (the optimizer's _gather_hookless_grads), not under it.
            prices = dataclasses.replace(
                prices, grad_buckets=[dataclasses.replace(b, window_s=0.0) for b in prices.grad_buckets]
            )
        if overlap == "microbatches":
            added = split_weight_add_s(scenario.model, parallel, scenario.precision, profile, staged.pipeline_rank)
            prices = dataclasses.replace(prices, timing=dataclasses.replace(prices.timing, weight_add_s=added))
        if schedule.chunks > 1:
            # A rank of v stages sends and receives each microbatch's activations and gradients at each.
            prices = dataclasses.replace(
                prices,
                per_microbatch=[
                    dataclasses.replace(c, count=c.count * schedule.chunks) if c.phase == "pipeline" else c
                    for c in prices.per_microbatch
                ],
            )
        stage_projection = project_priced_step(
            prices,
            rank,
            schedule,
            net,
            scenario.run.tokens_per_step,
            scenario.world_size,
            flops_per_token,
            skew,
            overlap,
            overlapped_pairs(schedule.kind, schedule.pp, staged.pipeline_rank, schedule.microbatches, schedule.chunks)
            if overlap == "microbatches"
            else None,
            PairedPipeline(schedule.kind, schedule.pp, schedule.chunks, schedule.microbatches, staged.pipeline_rank)
            if overlap == "microbatches" and schedule.pp > 1
            else None,
        )
        projections.append(stage_projection)
        stages.append(
            {
                "pipeline_rank": staged.pipeline_rank,
                "rank": rank,
                "trace_shared_with": staged.shared_with,
                "ops_traced": len(staged.trace.ops),
                "trace_s": staged.seconds,
                "microbatch_s": prices.timing.microbatch_s,
                "optimizer_s": prices.timing.optimizer_s,
                "seconds_by_kind_per_step_traced": prices.seconds_by_kind,
                "traced_matmul_flops_per_microbatch": prices.flops_traced / m_traced,
                "projection": stage_projection.to_dict(),
            }
        )
    slowest = max(stages, key=lambda s: s["projection"]["step_s"])
    projection = slowest["projection"]
    shared = [s["pipeline_rank"] for s in stages if s["trace_shared_with"] is not None]
    sharing = (
        [
            (
                f"{_stages(shared)}: the trace of an identical stage (trace_shared_with: same blocks, "
                "ends and microbatch order, routes that fix no shape): its ops and their prices, at the stage's own "
                "ranks, with its twin's rows per expert (bench/run/project.py)"
            )
        ]
        if shared
        else []
    )
    peak = profile.peak_tflops[_peak_dtype(scenario.precision)]
    extra = {}
    if breakdown:
        i = stages.index(slowest)
        staged = staged_steps[i]
        extra["breakdown"] = {
            "pipeline_rank": slowest["pipeline_rank"],
            **step_breakdown(
                *dispatched[staged.pipeline_rank],
                m_traced,
                parallel.microbatches,
                projections[i],
                staged.rank,
                net,
            ),
        }
    return {
        "scenario": scenario.name,
        "device": profile.name,
        "device_file": profile.file,
        "device_measured": profile.measured is not None,
        "world_size": scenario.world_size,
        "tokens_per_step": scenario.run.tokens_per_step,
        "flops_per_token": flops_per_token,
        "step_s": projection["step_s"],
        "tokens_per_s_per_gpu": projection["tokens_per_s_per_gpu"],
        "tflops_per_gpu": projection["tflops_per_gpu"],
        "mfu": projection["tflops_per_gpu"] / peak,
        "mfu_peak_tflops": peak,
        "breakdown_s": projection["breakdown_s"],
        "memory": fit,
        "slowest_stage": slowest["pipeline_rank"],
        "stages": stages,
        "network": dataclasses.asdict(net),
        "traced_microbatches": m_traced,
        "assumptions": projection["assumptions"]
        + [
            f"compute priced op by op on {profile.name} ({'measured curves' if profile.curves else 'declared efficiencies'}"
            f", {profile.file}); network from the profile",
            f"traced {m_traced} of the {parallel.microbatches} microbatches at full size: every microbatch runs the "
            "same ops (only routes differ); the last is where the gradient buckets launch",
            "memory from the plan (bench/predict/plan/); the step is the slowest pipeline stage's",
            *sharing,
            *(
                [
                    f"{schedule.kind}: its W actions write the weights' gradients past autograd's hooks, so every "
                    "gradient bucket launches when the backward ends (window 0), not under it"
                ]
                if schedule.kind in ZERO_BUBBLE and schedule.pp > 1
                else []
            ),
            f"MFU = TFLOP/s per GPU (model FLOPs, Megatron's convention) / the {_peak_dtype(scenario.precision)} "
            f"dense peak {peak:g} TFLOP/s",
        ],
        **extra,
    }


def _overlap(scenario: Scenario) -> str:
    """The overlap the engine runs (``moe_engine.parallel.overlap.overlaps_microbatches``): the layout's,
    but a fully recomputed MoE block replays routes, so auto falls back from microbatches to the plain
    order (chunks where a2a_chunks > 1)."""
    parallel, model = scenario.parallel_config, scenario.model
    overlap = parallel.resolved_overlap
    if overlap is ExpertOverlap.MICROBATCHES and scenario.recompute.mode is RecomputeMode.FULL:
        recomputed = scenario.recompute.blocks(stage_blocks(model.n_layers, parallel.num_stages))
        if any(model.is_moe_layer(i) for i in recomputed):
            overlap = ExpertOverlap.CHUNKS if parallel.a2a_chunks > 1 else ExpertOverlap.NONE
    return overlap.value


def _peak_dtype(precision: str) -> str:
    # MFU is quoted against the dense BF16 peak for bf16 and mxfp8 runs alike (the convention of the
    # reference release's own MFU figures), fp32 against fp32.
    return "fp32" if precision == "fp32" else "bf16"


def summary(doc: dict[str, Any]) -> str:
    """The projection in a few lines."""
    b = doc["breakdown_s"]
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in b.items() if v and k in STEP_KEYS)
    mem = doc["memory"]
    text = (
        f"{doc['scenario']} on {doc['world_size']} x {doc['device']}: step {doc['step_s']:.3f} s, "
        f"{doc['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {doc['tflops_per_gpu']:.0f} TFLOP/s/GPU, "
        f"MFU {doc['mfu']:.1%}; memory {format_gib(mem['memory_need_bytes'], decimals=1)} of "
        f"{format_gib(mem['device_memory_bytes'], decimals=1)}\n"
        f"  step: {parts}"
    )
    if len(doc["stages"]) > 1:
        sources = [
            s["pipeline_rank"] if s["trace_shared_with"] is None else s["trace_shared_with"] for s in doc["stages"]
        ]
        text += f"\n  stages: {sharing_text(sources, done=True)}; the step is stage {doc['slowest_stage']}'s"
    return text
