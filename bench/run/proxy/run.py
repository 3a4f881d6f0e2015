"""Proxy mode: run one rank of a scenario's layout for real in a fake world, then project the cluster.

What runs, what is measured and how it scales to the scenario: docs/proxies-and-projections.md, "What a
proxy run measures and how it scales"; the rank's pieces are in ``bench.run.proxy.rank``.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from bench.metrics import entry
from bench.predict.collectives import Collective, Network, summarize_collectives
from bench.predict.device import load_profile
from bench.predict.plan import plan_scenario
from bench.predict.proxy_projection import (
    ProjectionTarget,
    StageSize,
    StepMeasurement,
    project_full_scale,
    project_run_scale,
)
from bench.run.execute import ExecuteResult
from bench.run.project import DoesNotFit, NotTraceable, project_on_device
from bench.run.proxy.measure import bucket_measurements, measure_rank, phase_table, sync_table
from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
from bench.run.proxy.scale import ProxyScale, run_spec
from bench.run.trace import group_phases
from bench.scenario import Scenario, scenario_from_dict
from moe_engine.flops import training_flops_per_token


def _as_plan(spec: dict[str, Any]) -> Scenario:
    plan = copy.deepcopy(spec)
    plan["mode"] = "plan"
    plan.pop("proxy", None)
    return scenario_from_dict(plan)


def run_proxy(
    scenario: Scenario,
    device: torch.device,
    project_devices: Sequence[str] = (),
) -> ExecuteResult:
    """Run the proxy of ``scenario`` in this process (which must not be in a process group); the result
    also carries the op-level projection on its ``cluster.device`` and on each of ``project_devices``."""
    if scenario.cluster is None:
        raise ValueError(f"{scenario.name}: a proxy scenario needs a cluster section (its network prices the step)")
    spec, scale = run_spec(scenario, device)
    run_scenario = scenario_from_dict(spec, file=scenario.file)
    assert scenario.proxy is not None  # run_spec refuses a scenario without a proxy section
    if scenario.proxy.threads:
        torch.set_num_threads(scenario.proxy.threads)
    join_fake_world(scale.rank, scenario.world_size)
    try:
        measured, groups = measure_rank(run_scenario, scale, device)
        phases = group_phases(groups)
        family_groups: dict[str, str] = {"dense": groups.dp.group_name, "expert": groups.edp.group_name}
    finally:
        leave_fake_world()

    net = Network.from_cluster(scenario.cluster.to_dict())
    _, plan_run = plan_scenario(_as_plan(spec))
    _, plan_full = plan_scenario(_as_plan(scenario.spec))
    table = phase_table(measured)
    sync_rows = sync_table(measured)
    measurement = StepMeasurement(
        statistics.median(measured.compute_s),
        table,
        measured.calls,
        phases,
        family_groups,
        bucket_measurements(measured, sync_rows),
    )
    parallel = run_scenario.parallel_config
    target = ProjectionTarget(scale.rank, scenario.world_size, parallel.pp, parallel.schedule.value, net)
    run_projection = project_run_scale(
        measurement,
        scale,
        target,
        run_scenario.run.tokens_per_step,
        training_flops_per_token(run_scenario.model, scale.seq_len_run),
    ).projection
    full_projection = project_full_scale(
        measurement,
        scale,
        StageSize.from_plan(plan_run, scale.pp_rank),
        StageSize.from_plan(plan_full, scale.pp_rank),
        target,
        scenario.run.tokens_per_step,
        training_flops_per_token(scenario.model),
    ).projection

    peak_key = "cuda_peak_active_bytes" if device.type == "cuda" else "peak_tensor_bytes"
    measured_peak = measured.memory[peak_key]
    plan_stage = plan_run["stages"][scale.pp_rank]
    plan_total = plan_stage["memory_total_bytes"]
    rank_tokens = scale.microbatches_run * scale.tokens_per_microbatch_run

    result = ExecuteResult()
    m = result.metrics
    m["step_time_s"] = entry("step_time_s", measured.compute_s)
    m["rank_tokens_per_s"] = entry("rank_tokens_per_s", [rank_tokens / t for t in measured.compute_s])
    m[peak_key] = entry(peak_key, [measured_peak])
    m["plan_memory_total_bytes"] = entry("plan_memory_total_bytes", [plan_total])
    m["plan_memory_gap"] = entry("plan_memory_gap", [measured_peak / plan_total - 1])
    for prefix, projection in (("projected_run", run_projection), ("projected", full_projection)):
        m[f"{prefix}_step_time_s"] = entry(f"{prefix}_step_time_s", [projection.step_s])
        m[f"{prefix}_tokens_per_s_per_gpu"] = entry(f"{prefix}_tokens_per_s_per_gpu", [projection.tokens_per_s_per_gpu])
        m[f"{prefix}_tflops_per_gpu"] = entry(f"{prefix}_tflops_per_gpu", [projection.tflops_per_gpu])
    m["projected_memory_total_bytes"] = entry(
        "projected_memory_total_bytes", [plan_full["stages"][scale.pp_rank]["memory_total_bytes"]]
    )

    calls_per_step = [Collective(c.op, c.ranks, c.nbytes, phases.get(c.group_name, "other")) for c in measured.calls]
    result.details.update(
        rank=asdict(groups.layout.coords(scale.rank)),
        scale=asdict(scale) | {"block_ratio": scale.block_ratio, "token_ratio": scale.token_ratio},
        run_scale_note=_scale_note(scale, device),
        phases_s=table,
        sync_windows={
            "buckets": sync_rows,
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
        device_projections=_device_projections(scenario, project_devices),
        plan_full_scale={
            "memory_total_bytes": plan_full["stages"][scale.pp_rank]["memory_total_bytes"],
            "memory_bytes": plan_full["stages"][scale.pp_rank].get("memory_bytes"),
        },
        network=asdict(net),
        flops_per_token=training_flops_per_token(scenario.model),
        tokens_per_step=scenario.run.tokens_per_step,
        world_size=scenario.world_size,
        layout=scenario.parallel_config.to_dict(),
        losses=measured.losses,
    )
    return result


def _device_projections(scenario: Scenario, extra: Sequence[str]) -> dict[str, Any]:
    """The op-level projection (``bench.run.project``) on each device: the scenario's own, then ``extra``."""

    assert scenario.cluster is not None  # run_proxy refuses a scenario without one
    names = [n for n in [scenario.cluster.device, *extra] if n]
    projections = {}
    for name in dict.fromkeys(names):
        try:
            projections[name] = project_on_device(scenario, load_profile(name))
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
            "measured_peak_bytes": memory["peak_forward_backward_bytes"],
            "plan_bytes": backward,
            "gap": memory["peak_forward_backward_bytes"] / backward - 1,
        }
        out["optimizer_step"] = {
            "measured_peak_bytes": memory["peak_optimizer_step_bytes"],
            "plan_bytes": step,
            "gap": memory["peak_optimizer_step_bytes"] / step - 1,
        }
    out["measured_on"] = "CUDA allocator peak" if device.type == "cuda" else "tracked tensor bytes (CPU)"
    return out
