"""Micro-benchmark fixtures and the ratios derived from benchmarks measured in the same run.

Run: ``pytest bench/micro --benchmark-json=micro.json`` (``MOE_BENCH_DEVICE=cuda`` on a GPU).
Each benchmark stores its work (``flops``, ``tokens``, ``bytes``) in ``extra_info``; the ratios below
compare medians of the same run, so machine speed cancels out. They are added to the JSON under
``derived`` and printed at the end. With ``MOE_BENCH_PROFILE=NAME`` (a device profile,
``devices/NAME.yaml``) each memory-bound benchmark's achieved bytes/s is also set against the
profile's declared memory rate (HBM bandwidth x its memory efficiency): ``derived["memory_rate"]``.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.micro import FUSED_OPS
from bench.predict.device import load_profile

# (numerator, denominator, metric): metric "flops" compares achieved FLOP/s, "tokens" tokens/s.
# "bytes" compares achieved bytes/s: a fused op and its eager composition carry the fused op's bytes,
# so the ratio is eager seconds / fused seconds. "peak_bytes" compares peak memory, the denominator's
# over the numerator's (above 1: the numerator needs less).
MEMORY_JUDGED = {"linear_cross_entropy"}
"""Fused ops that trade time for memory (the fused loss recomputes the logits): judged on peak memory."""
RATIOS = {
    "moe_layer_vs_dense_flops": ("test_moe_layer[E64-k8]", "test_dense_swiglu_same_flops", "flops"),
    "experts_128_vs_8_tokens": ("test_expert_count[E128-k4]", "test_expert_count[E8-k4]", "tokens"),
    **{
        f"fused_over_eager_{op}": (
            f"test_fused_op[{op}-fused]",
            f"test_fused_op[{op}-eager]",
            "peak_bytes" if op in MEMORY_JUDGED else "bytes",
        )
        for op in FUSED_OPS
    },
    # The weight gradient added into the fp32 buffer by the GEMM against the GEMM and an add (FLOP/s).
    **{
        f"grouped_wgrad_fused_over_two_pass_{shape}": (
            f"test_grouped_wgrad[{shape}-fused]",
            f"test_grouped_wgrad[{shape}-two-pass]",
            "flops",
        )
        for shape in ("gate_up", "down")
    },
    # The experts' weight gradient in MXFP8 (its operands' quantization included) against the BF16 GEMM,
    # both adding into the fp32 buffer (FLOP/s; a Blackwell speed-up: Hopper upcasts the e4m3 tiles).
    **{
        f"mxfp8_wgrad_over_bf16_{shape}": (
            f"test_mxfp8_wgrad[{shape}-mxfp8]",
            f"test_mxfp8_wgrad[{shape}-bf16]",
            "flops",
        )
        for shape in ("gate_up", "down")
    },
    # The same for a dense projection's weight gradient (cuBLAS with beta 1 against mm and an add).
    **{
        f"wgrad_fused_over_two_pass_{shape}": (
            f"test_wgrad[{shape}-fused]",
            f"test_wgrad[{shape}-two-pass]",
            "flops",
        )
        for shape in ("attention", "mlp_down")
    },
}
TARGETS = {
    "moe_layer_vs_dense_flops": 0.70,
    "experts_128_vs_8_tokens": 0.85,
    **{
        key: 1.0
        for key in RATIOS
        if key.startswith(
            ("fused_over_eager_", "grouped_wgrad_fused_over_two_pass_", "wgrad_fused_over_two_pass_", "mxfp8_wgrad_")
        )
    },
}


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
            if metric == "peak_bytes":
                ratio = by_name[den]["extra_info"][metric] / max(by_name[num]["extra_info"][metric], 1)
            else:
                ratio = _rate(by_name[num], metric) / _rate(by_name[den], metric)
            derived[key] = {
                "ratio": ratio,
                "target": TARGETS[key],
                "numerator": num,
                "denominator": den,
                "metric": metric,
            }
    return derived


def memory_rates(benchmarks: list[dict]) -> dict[str, dict]:
    """Achieved bytes/s of each benchmark with ``bytes`` against MOE_BENCH_PROFILE's declared memory rate."""
    name = os.environ.get("MOE_BENCH_PROFILE")
    if not name:
        return {}

    profile = load_profile(name)
    declared = profile.hbm_gbps * 1e9 * profile.efficiency["memory"]
    return {
        b["name"]: {
            "achieved_gbps": _rate(b, "bytes") / 1e9,
            "declared_gbps": declared / 1e9,
            "fraction": _rate(b, "bytes") / declared,
            "profile": profile.name,
        }
        for b in benchmarks
        if "bytes" in b["extra_info"]
    }


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["derived"] = derive_ratios(output_json["benchmarks"])
    rates = memory_rates(output_json["benchmarks"])
    if rates:
        output_json["derived"]["memory_rate"] = rates


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
        if "bytes" in info:
            line += f", {_rate(bench, 'bytes') / 1e9:.1f} GB/s ({info.get('path', '')})"
        terminalreporter.write_line(line)
    for key, value in derive_ratios(benchmarks).items():
        judged = " on peak memory" if value["metric"] == "peak_bytes" else ""
        terminalreporter.write_line(f"{key}: {value['ratio']:.3f}{judged} (target >= {value['target']})")
    for key, value in memory_rates(benchmarks).items():
        terminalreporter.write_line(
            f"{key}: {value['fraction']:.0%} of {value['profile']}'s declared memory rate "
            f"({value['achieved_gbps']:.0f} of {value['declared_gbps']:.0f} GB/s)"
        )
