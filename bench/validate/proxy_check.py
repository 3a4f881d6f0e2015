"""``moe-bench proxy-check``: the projection against layouts that really run here.

For each execute scenario given (default: the 2-rank smoke layouts), on this machine:

1. measure the gloo links between ranks (``bench.validate.netcal``: alpha and bandwidth);
2. run the scenario for real (``moe-bench run``: torchrun, gloo, one thread per rank);
3. run a proxy of every rank of it (mode proxy, one thread, the scenario's own sizes) with the
   measured links as the cluster, all at once so that they share the machine as the real ranks do,
   and take the slowest rank's projected step, as a real step waits for its slowest rank;
4. report projected / measured - 1, and each proxy's plan-vs-measured memory gap.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.run.runner import Runner, run_with_timeout
from bench.scenario import Scenario, scenario_from_dict

DEFAULT_SCENARIOS = (
    "scenarios/smoke/e8-dp2-bf16.yaml",
    "scenarios/smoke/e8-ep2-nosync-bf16.yaml",
    "scenarios/smoke/e8-ep2-sync-bf16.yaml",
    "scenarios/smoke/e8-pp2-1f1b-bf16.yaml",
)


def calibrate_network(world_size: int, progress: Callable[[str], None], timeout: float = 300) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moe-netcal-") as tmp:
        out = Path(tmp) / "netcal.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "--max-restarts=0", "-m", "bench.validate.netcal", str(out),
        ]
        code, tail = run_with_timeout(command, timeout, progress)
        if code != 0 or not out.exists():
            raise RuntimeError(f"network calibration failed (exit {code}): {tail[-1] if tail else 'no output'}")
        return json.loads(out.read_text())


def proxy_spec(scenario: Scenario, rank: int, network: dict[str, Any]) -> dict[str, Any]:
    """The scenario as a proxy of ``rank`` on this machine's links, at its own sizes."""
    spec = copy.deepcopy(scenario.spec)
    world = scenario.world_size
    spec["mode"] = "proxy"
    spec["name"] = f"{scenario.name}-proxy-rank{rank}"
    spec["proxy"] = {"rank": rank, "threads": 1, "microbatches": spec["parallel"]["microbatches"]}
    spec["cluster"] = {
        "name": "this-machine-gloo", "gpus": world, "gpus_per_node": world, "gpu_memory_gib": 1,
        "peak_tflops": 1, "intra_node_gbps": network["gbps"], "inter_node_gbps": network["gbps"],
        "latency_us": network["latency_us"],
    }
    return spec


def check(runner: Runner, scenarios: list[Scenario], progress: Callable[[str], None]) -> dict[str, Any]:
    worlds = sorted({s.world_size for s in scenarios})
    networks = {}
    for world in worlds:
        progress(f"measuring gloo links between {world} ranks")
        networks[world] = calibrate_network(world, progress)
    rows = []
    for scenario in scenarios:
        progress(f"{scenario.name}: real run on {scenario.world_size} ranks")
        real = runner.run_one(scenario, progress)
        if real.status != "ok":
            rows.append({"scenario": scenario.name, "status": real.status, "error": real.error})
            continue
        progress(f"{scenario.name}: proxies of its {scenario.world_size} ranks, side by side")
        specs = [scenario_from_dict(proxy_spec(scenario, r, networks[scenario.world_size])) for r in range(scenario.world_size)]
        # The real ranks share this machine's cores and memory bandwidth; so do the proxies, run at
        # the same time with one thread each, so that each measures its compute under the same load.
        with ThreadPoolExecutor(max_workers=len(specs)) as pool:
            proxies = list(pool.map(lambda spec: runner.run_one(spec, lambda line: None), specs))
        for rank, proxy in enumerate(proxies):
            if proxy.status != "ok":
                raise RuntimeError(f"the proxy of {scenario.name} rank {rank} ended {proxy.status}: {proxy.error}")
        measured = real.metrics["step_time_s"]["median"]
        projected = max(p.metrics["projected_step_time_s"]["median"] for p in proxies)
        rows.append({
            "scenario": scenario.name,
            "status": "ok",
            "world_size": scenario.world_size,
            "measured_step_s": measured,
            "projected_step_s": projected,
            "error": projected / measured - 1,
            "proxy_compute_s": [p.metrics["step_time_s"]["median"] for p in proxies],
            "plan_memory_gap": [p.metrics["plan_memory_gap"]["median"] for p in proxies],
        })
    return {"networks": {str(k): v for k, v in networks.items()}, "rows": rows}
