"""Run the pytest-benchmark micro-benchmarks and fold their JSON into one result document."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import machine_info
from bench.metrics import entry
from bench.release.version import engine_info
from bench.results import SCHEMA_VERSION, result_dir, scenario_hash, utc_now, write_result

logger = logging.getLogger(__name__)

MICRO_DIR = Path(__file__).resolve().parent / "micro"


def fold_benchmarks(report: dict) -> dict[str, dict]:
    """Metrics from a pytest-benchmark JSON report: per-round times and the derived ratios."""
    metrics = {}
    for bench in report["benchmarks"]:
        name = bench["name"].removeprefix("test_").replace("[", "_").replace("]", "").replace("-", "_").lower()
        rounds = bench["stats"].get("data") or [bench["stats"]["median"]]
        metrics[f"{name}_time_s"] = entry(f"{name}_time_s", rounds)
        if "flops" in bench["extra_info"]:
            flops = bench["extra_info"]["flops"]
            metrics[f"{name}_gflops"] = entry(f"{name}_gflops", [flops / t / 1e9 for t in rounds])
    for key, value in report.get("derived", {}).items():
        metrics[key] = entry(key, [value["ratio"]])
    return metrics


def run_micro(device: str, out_root: Path) -> int:
    spec = {"benchmarks": "bench/micro", "device": device}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moe-micro-") as tmp:
        report_path = Path(tmp) / "micro.json"
        env = dict(os.environ, MOE_BENCH_DEVICE=device)
        command = [
            sys.executable,
            "-m",
            "pytest",
            str(MICRO_DIR),
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-enable",
            f"--benchmark-json={report_path}",
            "--benchmark-save-data",
        ]
        completed = subprocess.run(command, env=env, cwd=MICRO_DIR.parent.parent)
        status = "ok" if completed.returncode == 0 and report_path.exists() else "failed"
        report = json.loads(report_path.read_text()) if report_path.exists() else {"benchmarks": []}
    machine, engine = machine_info(), engine_info()
    document = {
        "schema_version": SCHEMA_VERSION,
        "engine": engine,
        "timestamp": utc_now(),
        "duration_s": time.perf_counter() - started,
        "machine": machine,
        "scenario": {"name": f"micro-{device}", "file": None, "hash": scenario_hash(spec), "spec": spec},
        "mode": "micro",
        "device": device,
        "status": status,
        "error": None if status == "ok" else f"pytest exited with code {completed.returncode}",
        "metrics": fold_benchmarks(report) if status == "ok" else {},
        "details": {"derived": report.get("derived", {})},
    }
    path = write_result(document, result_dir(out_root, engine["version"], machine["name"]))
    logger.info(f"micro-benchmarks: {status}; result in {path}")
    return 0 if status == "ok" else 1
