"""Micro-benchmark fixtures and the ratios derived from benchmarks measured in the same run.

Run: ``pytest bench/micro --benchmark-json=micro.json`` (``MOE_BENCH_DEVICE=cuda`` on a GPU).
Each benchmark stores its work (``flops``, ``tokens``) in ``extra_info``; the ratios below compare
medians of the same run, so machine speed cancels out. They are added to the JSON under
``derived`` and printed at the end.
"""

from __future__ import annotations

import os

import pytest
import torch

# (numerator, denominator, metric): metric "flops" compares achieved FLOP/s, "tokens" tokens/s.
RATIOS = {
    "moe_layer_vs_dense_flops": ("test_moe_layer[E64-k8]", "test_dense_swiglu_same_flops", "flops"),
    "experts_128_vs_8_tokens": ("test_expert_count[E128-k4]", "test_expert_count[E8-k4]", "tokens"),
}
TARGETS = {"moe_layer_vs_dense_flops": 0.70, "experts_128_vs_8_tokens": 0.85}


@pytest.fixture(scope="session")
def bench_device() -> torch.device:
    device = torch.device(os.environ.get("MOE_BENCH_DEVICE", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("MOE_BENCH_DEVICE=cuda but no CUDA device is available")
    return device


def _rate(bench, metric: str) -> float:
    return bench["extra_info"][metric] / bench["stats"]["median"]


def derive_ratios(benchmarks: list[dict]) -> dict[str, dict]:
    by_name = {b["name"]: b for b in benchmarks}
    derived = {}
    for key, (num, den, metric) in RATIOS.items():
        if num in by_name and den in by_name:
            ratio = _rate(by_name[num], metric) / _rate(by_name[den], metric)
            derived[key] = {"ratio": ratio, "target": TARGETS[key], "numerator": num, "denominator": den}
    return derived


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["derived"] = derive_ratios(output_json["benchmarks"])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    benchmarks = [b.as_dict(include_data=False) for b in session.benchmarks]
    for bench in benchmarks:
        info = bench["extra_info"]
        line = f"{bench['name']}: median {bench['stats']['median'] * 1e3:.1f} ms"
        if "flops" in info:
            line += f", {_rate(bench, 'flops') / 1e9:.1f} GFLOP/s"
        if "tokens" in info:
            line += f", {_rate(bench, 'tokens'):.0f} tokens/s"
        terminalreporter.write_line(line)
    for key, value in derive_ratios(benchmarks).items():
        terminalreporter.write_line(f"{key}: {value['ratio']:.3f} (target >= {value['target']})")
