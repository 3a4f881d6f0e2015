"""A results folder with two versions for the report's tests, written with the project's own code.

Scenario specs are the repository's own scenario files (loaded and filled in as a run records them);
plan documents are the real plans of the olmo-core3 layouts; the execute and proxy metrics are
chosen so that every verdict and ratio below can be worked out by hand.

Version 0.1.0 -> 0.2.0 on one machine, tokens/s medians (five samples, interquartile range 1% of the
median each, so the gate's noise is 2% and its threshold the 5% tolerance):

    e8-random-bf16       1000 -> 800   ratio 0.80: regressed (and its step time: 1.25, regressed)
    e64-random-bf16       500 -> 600   ratio 1.20: improved
    e8-ep2-nosync-bf16    700 -> 707   ratio 1.01: unchanged; work_host_syncs 0 -> 1: regressed
    e8-dp2-fsdp-bf16      300 -> failed (a problem; not ok in the candidate: the gate fails)
    e8-skewed-fp32          - -> oom   (a problem; new in the candidate: a note)
    moe-128e-47b (plan)   the same plan in both: unchanged

New in 0.2.0: e8-ep2-sync-bf16 (350: sync / no-sync 350 / 707), e8-random-mxfp8 (960 and 90 MiB
against e8-random-bf16's 800 and 100 MiB: 1.2 and 0.9), e8-ep2-nosync-bf16-recompute-full (560),
the moe-8e-4.6b plan and a moe-128e-47b-proxy result with a projection on its cluster and on a
device profile.
"""

from __future__ import annotations

import copy
from pathlib import Path

from result_docs import make_doc

from bench.predict.plan import plan_scenario
from bench.results import REPO_ROOT, metric, result_dir, write_result
from bench.scenario import load_scenario

BASE, NEW = "0.1.0", "0.2.0"
MACHINE = "cpu-box"
MIB = 2**20

TOKENS = {  # (scenario, version) -> tokens/s median; the samples spread 1% of it around it
    ("e8-random-bf16", BASE): 1000,
    ("e8-random-bf16", NEW): 800,
    ("e64-random-bf16", BASE): 500,
    ("e64-random-bf16", NEW): 600,
    ("e8-ep2-nosync-bf16", BASE): 700,
    ("e8-ep2-nosync-bf16", NEW): 707,
    ("e8-dp2-fsdp-bf16", BASE): 300,
    ("e8-ep2-sync-bf16", NEW): 350,
    ("e8-random-mxfp8", NEW): 960,
    ("e8-ep2-nosync-bf16-recompute-full", NEW): 560,
}
PEAK_MIB = {
    "e8-random-bf16": 100,
    "e64-random-bf16": 300,
    "e8-ep2-nosync-bf16": 80,
    "e8-dp2-fsdp-bf16": 60,
    "e8-ep2-sync-bf16": 80,
    "e8-random-mxfp8": 90,
    "e8-ep2-nosync-bf16-recompute-full": 50,
}
HOST_SYNCS = {("e8-ep2-nosync-bf16", BASE): 0, ("e8-ep2-nosync-bf16", NEW): 1}
FAILED = {
    ("e8-dp2-fsdp-bf16", NEW): ("failed", "RuntimeError: all_gather timed out on rank 1"),
    ("e8-skewed-fp32", NEW): ("oom", "planned 30.0 GiB per rank; the device has 24.0 GiB"),
}
PLANS = {BASE: ["moe-128e-47b"], NEW: ["moe-128e-47b", "moe-8e-4.6b"]}

EXPECTED_VERDICTS = {
    ("e8-random-bf16", "tokens_per_s_per_gpu"): "regressed",
    ("e8-random-bf16", "step_time_s"): "regressed",
    ("e8-random-bf16", "peak_tensor_bytes"): "unchanged",
    ("e64-random-bf16", "tokens_per_s_per_gpu"): "improved",
    ("e8-ep2-nosync-bf16", "tokens_per_s_per_gpu"): "unchanged",
    ("e8-ep2-nosync-bf16", "work_host_syncs"): "regressed",
    ("moe-128e-47b", "memory_total_bytes"): "unchanged",
}
PROJECTION = {"compute": 3.0, "expert_comm": 0.5, "bubble": 0.0, "grad_sync_exposed": 0.25, "optimizer": 0.25}
DEVICE_PROJECTION = {"compute": 1.5, "expert_comm": 0.3, "optimizer": 0.2}
EXPECTED_CHARTS = {"trend": 4, "sweep": 2, "pair": 3, "recompute": 1, "plan-memory": 1, "projection": 1}
"""Trends: e8-random-bf16, e64-random-bf16, e8-ep2-nosync-bf16 and the moe-128e-47b plan (ok in both
versions); sweeps: the runs (e8 and e64-random-bf16) and the plans (moe-8e-4.6b and moe-128e-47b, which
differ only in the number of experts); pairs: sync / no-sync, MXFP8 / BF16 tokens/s and memory (the FSDP
pair has a failed side)."""

COMPARISONS_YAML = """
comparisons:
  - name: ddp-ep-over-fsdp
    label: DDP+EP / FSDP tokens/s
    metric: tokens_per_s_per_gpu
    mirrors: "47B MoE on 8 B300"
    reference: "2.68"
    pairs: [[e8-ep2-nosync-bf16, e8-dp2-fsdp-bf16]]
  - name: sync-over-no-sync
    label: sync / no-sync dispatch tokens/s
    metric: tokens_per_s_per_gpu
    mirrors: "routing metadata on the GPU"
    reference: "none published"
    pairs: [[e8-ep2-sync-bf16, e8-ep2-nosync-bf16]]
  - name: mxfp8-over-bf16
    label: MXFP8 / BF16 tokens/s
    metric: tokens_per_s_per_gpu
    mirrors: "MXFP8 on 4 B300"
    reference: "1.21"
    pairs: [[e8-random-mxfp8, e8-random-bf16]]
  - name: mxfp8-over-bf16-memory
    label: MXFP8 / BF16 peak memory
    metric: [cuda_peak_active_bytes, peak_tensor_bytes]
    mirrors: "MXFP8 on 4 B300, peak active memory"
    reference: "0.92"
    pairs: [[e8-random-mxfp8, e8-random-bf16]]
  - name: experts-128-over-8
    label: 128 / 8 experts tokens/s
    metric: tokens_per_s_per_gpu
    mirrors: "8 -> 128 experts"
    reference: "above 0.95"
    pairs: [[e128-ep2-nosync-bf16, e8-ep2-nosync-bf16]]
"""


def scenario_file(name: str) -> Path:
    for folder in ("smoke", "olmo-core3"):
        path = REPO_ROOT / "scenarios" / folder / f"{name}.yaml"
        if path.exists():
            return path
    raise FileNotFoundError(name)


def spread_samples(median: float) -> list[float]:
    """Five samples with this median and an interquartile range of 1% of it."""
    return [median * f for f in (1.0, 1.01, 0.99, 1.005, 0.995)]


def _document(
    version: str,
    name: str,
    mode: str,
    metrics: dict,
    details: dict | None = None,
    status: str = "ok",
    error: str | None = None,
) -> dict:
    scenario = load_scenario(scenario_file(name))
    doc = make_doc(
        name,
        metrics if status == "ok" else {},
        status=status,
        error=error,
        spec=copy.deepcopy(scenario.spec),
        version=version,
        machine=MACHINE,
        timestamp=f"2026-0{1 if version == BASE else 6}-01T00:00:00Z",
    )
    doc["scenario"]["file"] = str(scenario_file(name).relative_to(REPO_ROOT))
    doc["mode"] = mode
    if details is not None:
        doc["details"] = details
    return doc


def execute_doc(version: str, name: str) -> dict:
    if (name, version) in FAILED:
        status, error = FAILED[(name, version)]
        return _document(version, name, "execute", {}, status=status, error=error)
    tokens = spread_samples(TOKENS[(name, version)])
    metrics = {
        "tokens_per_s_per_gpu": metric(tokens, "tokens/s", "higher"),
        "step_time_s": metric([2048 / t for t in tokens], "s", "lower"),
        "peak_tensor_bytes": metric([PEAK_MIB[name] * MIB], "bytes", "lower"),
        "loss": metric([6.93, 6.92, 6.91, 6.90, 6.89], "nats", None),
    }
    if (name, version) in HOST_SYNCS:
        metrics["work_host_syncs"] = metric([HOST_SYNCS[(name, version)]], "count", "lower")
    return _document(version, name, "execute", metrics)


def plan_doc(version: str, name: str) -> dict:
    metrics, details = plan_scenario(load_scenario(scenario_file(name)))
    return _document(version, name, "plan", metrics, details)


def proxy_doc(version: str) -> dict:
    step = sum(PROJECTION.values())
    device_step = sum(DEVICE_PROJECTION.values())
    details = {
        "projection": {"step_s": step, "tokens_per_s_per_gpu": 4096 / step, "breakdown_s": dict(PROJECTION)},
        "device_projections": {
            "b300": {
                "step_s": device_step,
                "tokens_per_s_per_gpu": 4096 / device_step,
                "breakdown_s": dict(DEVICE_PROJECTION),
            },
            "h100-sxm": {"device": "h100-sxm", "fits": False, "error": "does not fit"},
        },
    }
    metrics = {
        "projected_tokens_per_s_per_gpu": metric([4096 / step], "tokens/s", None),
        "rank_tokens_per_s": metric([100.0, 101.0], "tokens/s", "higher"),
    }
    return _document(version, "moe-128e-47b-proxy", "proxy", metrics, details)


def write_two_versions(root: Path) -> Path:
    """The folder described in the module doc, under ``root``; returns ``root``."""
    for version in (BASE, NEW):
        folder = result_dir(root, version, MACHINE)
        names = sorted({n for n, v in TOKENS if v == version} | {n for n, v in FAILED if v == version})
        for name in names:
            write_result(execute_doc(version, name), folder)
        for name in PLANS[version]:
            write_result(plan_doc(version, name), folder)
    write_result(proxy_doc(NEW), result_dir(root, NEW, MACHINE))
    return root


def write_comparisons(path: Path) -> Path:
    path.write_text(COMPARISONS_YAML)
    return path
