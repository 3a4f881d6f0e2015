"""``moe-bench project SCENARIO --device NAME``: a layout's step on a device, priced op by op.

For each pipeline stage, one rank's step is traced at the scenario's full size under fake tensors
(``bench.run.trace``), every op priced on the device profile (``bench.predict.pricing``) and the
step assembled on the profile's network (``bench.predict.op_projection``); the slowest stage sets
the step, as every stage waits for it. Memory comes from the plan (``bench.predict.plan``, checked
against measured peaks by the proxy tests): a layout whose most loaded rank needs more than the
device holds is reported as "does not fit" and not projected.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from bench.predict.device import DeviceProfile
from bench.predict.op_projection import project_priced_step, step_prices
from bench.predict.plan import plan_scenario
from bench.predict.pricing import price_ops
from bench.predict.projection import Network, Schedule, SkewModel
from bench.run.trace import trace_step
from bench.scenario import Scenario, scenario_from_dict
from moe_engine.config import DataParallelMode
from moe_engine.flops import training_flops_per_token
from moe_engine.parallel.layout import Layout, check_proxy_layout

TRACED_MICROBATCHES = 2
"""Microbatches a projection traces: the first stands for every one but the last, where buckets launch."""


class DoesNotFit(ValueError):
    """The layout needs more memory per rank than the device has."""


class NotTraceable(ValueError):
    """A layout the trace cannot build a rank of; the message names the field."""


def check_traceable(scenario: Scenario) -> None:
    """The layouts a trace builds: a proxy rank's (ddp, zero1; gpipe or 1f1b, one stage per rank), and
    FSDP without pipeline stages (the real build path, whose pipeline would wait for its neighbours)."""
    if scenario.precision == "fp32":
        # torch's fake-tensor kernel of the grouped GEMM takes bf16 operands only.
        raise NotTraceable(f"{scenario.file}: precision: the trace prices bf16 and mxfp8 layouts, got fp32")
    parallel = scenario.parallel_config
    if parallel.dp_mode is DataParallelMode.FSDP:
        if parallel.pp > 1:
            raise NotTraceable(f"{scenario.file}: parallel.pp: an FSDP layout traces without pipeline stages, "
                               f"got pp {parallel.pp}")
        return
    try:
        check_proxy_layout(parallel)
    except ValueError as err:
        raise NotTraceable(f"{scenario.file}: {err}") from None


def traced_scenario(scenario: Scenario, microbatches: int | None) -> Scenario:
    """The scenario with only ``microbatches`` of its microbatches per step (same microbatch size)."""
    m = scenario.parallel_config.microbatches
    if microbatches is None or microbatches >= m:
        return scenario
    spec = copy.deepcopy(scenario.spec)
    spec["parallel"]["microbatches"] = microbatches
    spec["run"]["tokens_per_step"] = scenario.run["tokens_per_step"] // m * microbatches
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


def project_on_device(
    scenario: Scenario,
    profile: DeviceProfile,
    skew: SkewModel | None = None,
    microbatches: int | None = TRACED_MICROBATCHES,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """The projection document of ``scenario`` on ``profile`` (module docstring).

    Raises ``DoesNotFit`` (with the numbers) when the plan's rank does not fit the device, and
    ``NotTraceable`` for a layout the trace cannot build.
    """
    check_traceable(scenario)
    fit = memory_fit(scenario, profile)
    if not fit["fits"]:
        raise DoesNotFit(
            f"{scenario.name}: does not fit {profile.name} ({profile.file}: memory_gb = {profile.memory_gb:g}): "
            f"the most loaded rank (stage {fit['most_loaded_stage']}) needs "
            f"{fit['memory_need_bytes'] / 1e9:.1f} GB by the plan"
        )
    parallel = scenario.parallel_config
    traced = traced_scenario(scenario, microbatches)
    m_traced = traced.parallel_config.microbatches
    layout = Layout(parallel)
    net = Network.from_cluster(profile.cluster())
    schedule = Schedule(parallel.pp, parallel.virtual_stages, parallel.microbatches, parallel.schedule.value)
    flops_per_token = training_flops_per_token(scenario.model)
    stages = []
    for stage in range(parallel.pp):
        rank = layout.rank_of(stage, 0, 0)
        started = time.perf_counter()
        progress(f"{scenario.name}: tracing stage {stage} (rank {rank}) at full size, {m_traced} microbatches")
        trace = trace_step(traced, rank=rank, fake=True)
        priced = price_ops(trace.ops, profile)
        prices = step_prices(priced, m_traced, trace.group_phases)
        projection = project_priced_step(
            prices, rank, schedule, net, scenario.run["tokens_per_step"], scenario.world_size, flops_per_token, skew
        )
        stages.append({
            "pipeline_rank": stage,
            "rank": rank,
            "ops_traced": len(trace.ops),
            "trace_s": time.perf_counter() - started,
            "microbatch_s": prices.timing.microbatch_s,
            "optimizer_s": prices.timing.optimizer_s,
            "seconds_by_kind_per_step_traced": prices.seconds_by_kind,
            "traced_matmul_flops_per_microbatch": prices.flops_traced / m_traced,
            "projection": projection.to_dict(),
        })
    slowest = max(stages, key=lambda s: s["projection"]["step_s"])
    projection = slowest["projection"]
    peak = profile.peak_tflops[_peak_dtype(scenario.precision)]
    return {
        "scenario": scenario.name,
        "device": profile.name,
        "device_file": profile.file,
        "device_measured": profile.measured is not None,
        "world_size": scenario.world_size,
        "tokens_per_step": scenario.run["tokens_per_step"],
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
        "assumptions": projection["assumptions"] + [
            f"compute priced op by op on {profile.name} ({'measured curves' if profile.curves else 'declared efficiencies'}"
            f", {profile.file}); network from the profile",
            f"traced {m_traced} of the {parallel.microbatches} microbatches at full size: every microbatch runs the "
            "same ops (only routes differ); the last is where the gradient buckets launch",
            "memory from the plan (bench/predict/plan.py); the step is the slowest pipeline stage's",
            f"MFU = TFLOP/s per GPU (model FLOPs, Megatron's convention) / the {_peak_dtype(scenario.precision)} "
            f"dense peak {peak:g} TFLOP/s",
        ],
    }


def _peak_dtype(precision: str) -> str:
    # MFU is quoted against the dense BF16 peak for bf16 and mxfp8 runs alike (the convention of the
    # reference release's own MFU figures), fp32 against fp32.
    return "fp32" if precision == "fp32" else "bf16"


def summary(doc: dict[str, Any]) -> str:
    """The projection in a few lines."""
    b = doc["breakdown_s"]
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in b.items() if v and k in (
        "compute", "expert_comm", "pipeline_comm", "bubble", "grad_sync_exposed", "optimizer",
        "param_gather_exposed", "other_comm", "skew", "fsdp_gather_exposed"))
    mem = doc["memory"]
    return (
        f"{doc['scenario']} on {doc['world_size']} x {doc['device']}: step {doc['step_s']:.3f} s, "
        f"{doc['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {doc['tflops_per_gpu']:.0f} TFLOP/s/GPU, "
        f"MFU {doc['mfu']:.1%}; memory {mem['memory_need_bytes'] / 1e9:.1f} of {mem['device_memory_bytes'] / 1e9:.0f} GB\n"
        f"  step: {parts}"
    )
