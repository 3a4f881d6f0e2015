"""``moe-bench proxy-check``: the projection against layouts that really run here.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import copy
import logging
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.logs import quieted
from bench.predict.collectives import Collective
from bench.predict.device import DeviceProfile
from bench.predict.skew import SkewModel, skew_seconds, sync_points
from bench.run.network import calibrate_network
from bench.run.process import OUTPUT
from bench.run.project import project_on_device
from bench.run.runner import Runner
from bench.scenario import Scenario, scenario_from_dict

DEFAULT_SCENARIOS = (
    "scenarios/smoke/e8-dp2-bf16.yaml",
    "scenarios/smoke/e8-ep2-nosync-bf16.yaml",
    "scenarios/smoke/e8-ep2-sync-bf16.yaml",
    "scenarios/smoke/e8-pp2-1f1b-bf16.yaml",
)

logger = logging.getLogger(__name__)


def proxy_spec(scenario: Scenario, rank: int, network: dict[str, Any]) -> dict[str, Any]:
    """The scenario as a proxy of ``rank`` on this machine's links, at its own sizes."""
    spec = copy.deepcopy(scenario.spec)
    world = scenario.world_size
    spec["mode"] = "proxy"
    spec["name"] = f"{scenario.name}-proxy-rank{rank}"
    spec["proxy"] = {"rank": rank, "threads": 1, "microbatches": spec["parallel"]["microbatches"]}
    spec["cluster"] = {
        "name": "this-machine-gloo",
        "gpus": world,
        "gpus_per_node": world,
        "gpu_memory_gib": 1,
        "peak_tflops": 1,
        "intra_node_gbps": network["gbps"],
        "inter_node_gbps": network["gbps"],
        "latency_us": network["latency_us"],
    }
    return spec


def with_warmup(scenario: Scenario, warmup_steps: int) -> Scenario:
    """The scenario with ``warmup_steps`` untimed steps before its timed ones."""
    spec = copy.deepcopy(scenario.spec)
    spec["run"]["warmup_steps"] = warmup_steps
    spec["run"]["timeout_s"] = spec["run"]["timeout_s"] + 2 * warmup_steps
    return scenario_from_dict(spec, file=scenario.file)


def step_time_cv(samples: list[float]) -> float:
    """Robust coefficient of variation of a run's step times: 1.4826 * MAD / median."""
    median = statistics.median(samples)
    mad = statistics.median(abs(t - median) for t in samples)
    return 1.4826 * mad / median if median > 0 else 0.0


def proxy_skew_s(details: dict[str, Any], skew: SkewModel) -> float:
    """The rank-skew waits of a proxy's projected step (``bench.predict.projection``), from its collectives."""
    rows = details["collectives_per_step"]

    def entries(phases):
        return [
            Collective(r["op"], tuple(range(r["group_size"])), r["nbytes"], r["phase"], r["count"])
            for r in rows
            if r["phase"] in phases
        ]

    # The proxy ran the scenario's own microbatches: its per-step counts are the step's.
    count, group = sync_points(entries(("expert", "pipeline")), entries(("grad", "other")), 1)
    return skew_seconds(skew, count, group, details["projection"]["breakdown_s"]["compute"])


def _proxies(runner: Runner, scenario: Scenario, network: dict[str, Any]) -> list:
    specs = [scenario_from_dict(proxy_spec(scenario, r, network)) for r in range(scenario.world_size)]
    # The real ranks share this machine's cores and memory bandwidth; so do the proxies, run at
    # the same time with one thread each, so that each measures its compute under the same load.
    # Side by side, their workers' lines would interleave into noise: only their warnings show.
    with quieted(OUTPUT), ThreadPoolExecutor(max_workers=len(specs)) as pool:
        proxies = list(pool.map(runner.run_one, specs))
    for rank, proxy in enumerate(proxies):
        if proxy.status != "ok":
            raise RuntimeError(f"the proxy of {scenario.name} rank {rank} ended {proxy.status}: {proxy.error}")
    return proxies


def check(
    runner: Runner,
    scenarios: list[Scenario],
    runs: int = 1,
    profile: DeviceProfile | None = None,
    warmup_steps: int | None = None,
) -> dict[str, Any]:
    """``runs`` real runs of each scenario, each against its proxies' projection (with the rank skew its
    own step-time spread implies) and, given a ``profile``, against the op-level projection on it.
    ``warmup_steps`` replaces the scenarios' own (a fresh process's first steps run slower: on a CPU
    each new GEMM shape builds a kernel, and random routes keep giving experts new row counts for
    tens of steps, ``bench.validate.cpu_warmup``; a profile prices the steady state)."""
    if warmup_steps is not None:
        scenarios = [with_warmup(s, warmup_steps) for s in scenarios]
    worlds = sorted({s.world_size for s in scenarios})
    networks = {}
    for world in worlds:
        logger.info(f"measuring gloo links between {world} ranks")
        networks[world] = calibrate_network(world)
    rows = []
    for scenario in scenarios:
        for run in range(runs):
            logger.info(f"{scenario.name}: real run {run + 1} of {runs} on {scenario.world_size} ranks")
            real = runner.run_one(scenario)
            if real.status != "ok":
                rows.append({"scenario": scenario.name, "run": run, "status": real.status, "error": real.error})
                continue
            logger.info(f"{scenario.name}: proxies of its {scenario.world_size} ranks, side by side")
            proxies = _proxies(runner, scenario, networks[scenario.world_size])
            measured = real.metrics["step_time_s"]["median"]
            samples = real.metrics["step_time_s"]["samples"]
            skew = SkewModel(step_time_cv(samples), f"1.4826 MAD / median of this real run's {len(samples)} step times")
            plain = [p.metrics["projected_step_time_s"]["median"] for p in proxies]
            skewed = [t + proxy_skew_s(p.details, skew) for t, p in zip(plain, proxies)]
            row = {
                "scenario": scenario.name,
                "run": run,
                "status": "ok",
                "world_size": scenario.world_size,
                "measured_step_s": measured,
                "step_time_cv": skew.cv,
                "projected_step_s": max(skewed),
                "error": max(skewed) / measured - 1,
                "projected_without_skew_s": max(plain),
                "error_without_skew": max(plain) / measured - 1,
                "proxy_compute_s": [p.metrics["step_time_s"]["median"] for p in proxies],
                "plan_memory_gap": [p.metrics["plan_memory_gap"]["median"] for p in proxies],
            }
            if profile is not None:
                # One line says it (the real run's); the projection's stage lines would bury it.
                with quieted("bench.run.project"), quieted("bench.run.trace"):
                    op_level = project_on_device(scenario, profile, skew=skew)
                row.update(
                    op_level_step_s=op_level["step_s"],
                    op_level_error=op_level["step_s"] / measured - 1,
                    op_level_breakdown_s=op_level["breakdown_s"],
                )
            rows.append(row)
    return {
        "networks": {str(k): v for k, v in networks.items()},
        "warmup_steps": warmup_steps,
        "rows": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per scenario: the errors of every ok run and their medians."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        entry = out.setdefault(
            row["scenario"], {"runs": 0, "errors": [], "errors_without_skew": [], "op_level_errors": []}
        )
        entry["runs"] += 1
        entry["errors"].append(row["error"])
        entry["errors_without_skew"].append(row["error_without_skew"])
        if "op_level_error" in row:
            entry["op_level_errors"].append(row["op_level_error"])
    medians = {
        "errors": "median_error",
        "errors_without_skew": "median_error_without_skew",
        "op_level_errors": "median_op_level_error",
    }
    for entry in out.values():
        for key, median_key in medians.items():
            entry[median_key] = statistics.median(entry[key]) if entry[key] else None
    return out
