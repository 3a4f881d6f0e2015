"""``moe-bench plan``: parameters, FLOPs, per-rank memory, traffic and checkpoint bytes of a layout, by arithmetic.
More: docs/memory-plan.md.
"""

from __future__ import annotations

from typing import Any

from bench.metrics import COMM_PARTS, PLAN_MEMORY_PARTS, entry
from bench.predict.plan.activations import kv_bytes_per_token
from bench.predict.plan.bytes import BYTES, PrecisionBytes, parameter_pieces, precision_bytes
from bench.predict.plan.rank import (
    ceil_div,
    checkpoint_bytes,
    checkpoint_counted,
    in_flight_microbatches,
    plan_rank,
    rank_holdings,
)
from bench.units import GIB, format_count, format_memory
from moe_engine.config import DataParallelMode, DispatchKind, GradDtype, OptimizerSharding, RecomputeMode
from moe_engine.flops import parameter_counts, recompute_flops_per_token, training_flops_per_token
from moe_engine.parallel.layout import stage_blocks, stage_layers

__all__ = [
    "BYTES",
    "PrecisionBytes",
    "in_flight_microbatches",
    "kv_bytes_per_token",
    "plan_scenario",
    "precision_bytes",
    "stage_layers",
    "summary_line",
]


def _layout(scenario, layers_per_rank: int, tokens: int) -> dict[str, Any]:
    par = scenario.parallel_config
    return {
        "world_size": scenario.world_size,
        "dp": par.dp,
        "ep": par.ep,
        "pp": par.pp,
        "edp": par.edp,
        "virtual_stages": par.virtual_stages,
        "schedule": par.schedule.value,
        "microbatches": par.microbatches,
        "dp_mode": par.dp_mode.value,
        "optimizer_sharding": par.optimizer_sharding.value,
        "dispatch": par.dispatch.value,
        "capacity_factor": par.capacity_factor,
        "grad_dtype": par.grad_dtype.value,
        "layers_per_rank": layers_per_rank,
        "local_experts": scenario.model.moe.num_experts // par.ep,
        "tokens_per_microbatch_per_rank": tokens,
    }


def _gradients(scenario) -> str:
    par = scenario.parallel_config
    if par.dp_mode is DataParallelMode.FSDP:
        return (
            "fsdp keeps its own gradients whatever grad_dtype (sharded, reduce-scattered in fp32), priced "
            "with the parameters' bytes as the same 16 bytes per parameter"
        )
    if par.grad_dtype is GradDtype.FP32:
        return (
            "gradient buffers in fp32 (grad_dtype fp32): each backward's gradient is added into them, and the "
            "data-parallel reduction sends fp32"
        )
    return "gradient buffers in the parameters' dtype (grad_dtype param), reduced in it"


def _recompute_assumption(scenario) -> str:
    recompute = scenario.recompute
    if not recompute.enabled:
        return (
            "activations: tensors saved for backward with flash attention and no recomputation "
            "(see bench/predict/plan/__init__.py); routing indices, norms' statistics and other small tensors are ignored"
        )
    subset = (
        f"the first {recompute.first_per_stage} blocks of each pipeline chunk"
        if recompute.first_per_stage
        else "every block"
        if recompute.every == 1
        else f"every block whose index is a multiple of {recompute.every}"
    )
    what = (
        "each block keeps only its input; its forward (all-to-alls included) runs again in backward"
        if recompute.mode is RecomputeMode.FULL
        else "the named parts (" + ", ".join(p.value for p in recompute.parts) + ") keep only their inputs and run "
        "again in backward"
    )
    return (
        f"activations: recompute {recompute.mode.value} on {subset}: {what}; one block's (or part's) "
        "recomputed activations are counted in the backward workspace; recompute FLOPs are reported apart "
        "(recompute_flops_per_token), model FLOPs leave them out; routing indices, norms' statistics and "
        "other small tensors are ignored"
    )


def _assumptions(scenario) -> list[str]:
    precision, par = scenario.precision, scenario.parallel_config
    b = precision_bytes(precision, par.grad_dtype.value, par.dp_mode.value)
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
        if scenario.cluster
        else "no cluster section: the per-rank memory is not compared with a GPU's (moe-bench run compares it with "
        "the device it runs on before starting)",
    ]
    if precision == "mxfp8":
        out.append(
            "mxfp8: saved expert-GEMM inputs (gathered tokens, SwiGLU product) take 1 byte + 1/32 scale "
            "byte per element; weights, gradients and other activations stay bf16; quantised weight "
            "copies are transient and not counted"
        )
    if par.dispatch is DispatchKind.NO_SYNC:
        out.append(
            f"no-sync dispatch: send and receive buffers are capacity_factor ({par.capacity_factor}) x the "
            "balanced load and travel whole; comm buffers count one MoE block's send + receive buffers"
        )
    else:
        out.append(
            "sync dispatch: exact (balanced) counts are sent; comm buffers count one MoE block's send + receive buffers"
        )
    if par.dp_mode is DataParallelMode.FSDP:
        out.append(
            "fsdp: params, grads and optimizer state sharded over dp (experts over edp inside their ep "
            "group, i.e. the stage's experts over dp); one gathered unit (largest block with its local "
            "experts, embedding or head) counted in params and grads; params all-gathered in forward and "
            "backward of every microbatch, grads reduce-scattered once per step"
        )
    elif par.optimizer_sharding is OptimizerSharding.ZERO1:
        out.append(
            "zero1: optimizer state sharded over dp (dense) and edp (experts); gradients reduce-scattered "
            "and updated parameters all-gathered, the same bytes as an all-reduce when params and grads "
            "share a dtype"
        )
    return out


def plan_scenario(scenario) -> tuple[dict[str, dict], dict]:
    """Metrics (single-sample ``bench.results.metric`` entries) and details of any scenario's layout.

    ``memory_fraction_of_gpu`` and a boolean ``fits`` need the scenario's ``cluster`` section; without
    one the plan has neither (``details["fits"]`` is None).
    """
    model, par, cluster, recompute = scenario.model, scenario.parallel_config, scenario.cluster, scenario.recompute
    b = precision_bytes(scenario.precision, par.grad_dtype.value, par.dp_mode.value)
    tokens = scenario.run.tokens_per_step // par.dp // par.microbatches
    pieces = parameter_pieces(model)
    split = stage_layers(model.n_layers, par.pp, par.virtual_stages)
    # The engine picks the recomputed blocks over the pp * v chunks (``prepare_blocks``).
    chunks = stage_blocks(model.n_layers, par.num_stages)
    recomputed = set(recompute.blocks(chunks))
    holdings = [rank_holdings(model, pieces, layers, r, par.pp, par.ep) for r, layers in enumerate(split)]
    ranks = [plan_rank(model, h, b, par, tokens, recompute, recomputed) for h in holdings]
    checkpoint_stages = [checkpoint_bytes(model, h, scenario.precision, par) for h in holdings]
    by_memory = max(ranks, key=lambda r: r["memory_bytes"]["total"])
    by_comm = max(ranks, key=lambda r: r["comm_bytes"]["total"])
    counts = parameter_counts(model)
    gpu_bytes = cluster.gpu_memory_gib * GIB if cluster else None
    total = by_memory["memory_bytes"]["total"]

    model_flops = training_flops_per_token(model)
    recompute_flops = recompute_flops_per_token(model, recompute, chunks)
    metrics = {
        "total_params": entry("total_params", [counts.total]),
        "active_params": entry("active_params", [counts.active]),
        # Model FLOPs (what MFU counts), the recompute's apart, and their sum (what the GPUs run).
        "flops_per_token": entry("flops_per_token", [model_flops]),
        "recompute_flops_per_token": entry("recompute_flops_per_token", [recompute_flops]),
        "hardware_flops_per_token": entry("hardware_flops_per_token", [model_flops + recompute_flops]),
    }
    for key in PLAN_MEMORY_PARTS:
        metrics[f"memory_{key}_bytes"] = entry(f"memory_{key}_bytes", [by_memory["memory_bytes"][key]])
    for key in COMM_PARTS:
        metrics[f"comm_{key}_bytes"] = entry(f"comm_{key}_bytes", [by_comm["comm_bytes"][key]])
    if gpu_bytes:
        metrics["memory_fraction_of_gpu"] = entry("memory_fraction_of_gpu", [total / gpu_bytes])
    metrics["checkpoint_bytes_per_rank"] = entry(
        "checkpoint_bytes_per_rank", [max(ceil_div(c, par.dp) for c in checkpoint_stages)]
    )
    metrics["checkpoint_bytes_total"] = entry("checkpoint_bytes_total", [sum(checkpoint_stages)])

    details = {
        "layout": _layout(scenario, len(by_memory["layers"]), tokens),
        "recompute": {
            **recompute.to_dict(),
            "blocks": len(recomputed),
            "flops_fraction_of_model": recompute_flops / model_flops,
        },
        "per_rank": by_memory,
        "most_loaded": {"memory": by_memory["pipeline_rank"], "comm": by_comm["pipeline_rank"]},
        "stages": [
            {
                "pipeline_rank": r["pipeline_rank"],
                "layers": len(r["layers"]),
                "dense_params": r["dense_params"],
                "local_expert_params": r["local_expert_params"],
                "memory_total_bytes": r["memory_bytes"]["total"],
                "memory_bytes": r["memory_bytes"],
                "comm_total_bytes": r["comm_bytes"]["total"],
            }
            for r in ranks
        ],
        "checkpoint": {"counted": checkpoint_counted(par), "stage_bytes": checkpoint_stages},
        "assumptions": _assumptions(scenario),
        "fits": total <= gpu_bytes if gpu_bytes else None,
        "memory_total_gib": total / GIB,
        "cluster": dict(scenario.spec["cluster"]) if cluster else None,
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
    return format_memory(n, decimals=1)


def summary_line(name: str, metrics: dict[str, dict], details: dict[str, Any]) -> str:
    """One line per plan: the counts, the most loaded rank's memory against the GPU's, the traffic, the checkpoint."""
    med = {k: v["median"] for k, v in metrics.items()}
    what = {
        "plan": name,
        "execute": f"{name} (of an execute scenario)",
        "proxy": f"{name} (of a proxy scenario: the whole layout at its own sizes)",
    }[details["scenario_mode"]]
    per_rank = f"{_bytes(med['memory_total_bytes'])} per rank"
    if details["layout"]["pp"] > 1:
        per_rank += f" (pipeline rank {details['most_loaded']['memory']})"
    if details["fits"] is None:
        against = "no cluster section: not compared with a GPU's memory (moe-bench run checks the device it runs on)"
    else:
        cluster = details["cluster"]
        against = f"{med['memory_fraction_of_gpu']:.0%} of {cluster['gpu_memory_gib']:g} GiB per GPU: " + (
            "fits" if details["fits"] else "DOES NOT FIT"
        )
    line = (
        f"{what}: {format_count(med['total_params'])} parameters ({format_count(med['active_params'])} active), "
        f"{per_rank}, {against}; sends {_bytes(med['comm_total_bytes'])} per step; checkpoint "
        f"{_bytes(med['checkpoint_bytes_total'])} ({_bytes(med['checkpoint_bytes_per_rank'])} per rank)"
    )
    recompute = details["recompute"]
    if recompute["mode"] != "none":
        mode = recompute["mode"] + (f" ({', '.join(recompute['parts'])})" if recompute["parts"] else "")
        line += (
            f"; recompute {mode} of {recompute['blocks']} blocks: "
            f"+{recompute['flops_fraction_of_model']:.1%} FLOPs over the model's"
        )
    runs = details["engine_runs_layout"]
    if not runs["ok"]:
        line += f"; the engine does not execute this layout ({runs['reason']})"
    return line
