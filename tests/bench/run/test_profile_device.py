"""bench.run.profile_device: a tiny CPU sweep gives a profile the loader accepts, with the work of each
point as the pricing counts it (hand-computed here, not recomputed by the module's own formulas).

The gloo calibration is passed in (``network=``) so that the test runs no torchrun; the sweep is
``tiny_sweep`` (well under a second of timing).
"""

from __future__ import annotations

import copy

import pytest
import torch

from bench.predict.device import load_profile, profile_from_dict
from bench.run.profile_device import profile_device, tiny_sweep, write_profile

NETWORK = {"gbps": 1.5, "latency_us": 100.0}

# tiny_sweep's shapes and their work, computed by hand.
GEMM_WORK = {  # (M, N, K) -> 2 M N K
    (16, 16, 16): 8_192,
    (32, 64, 48): 196_608,
    (64, 32, 128): 524_288,
    (64, 1, 32, 2): 8_192,  # a batched product (B, M, N, K): 2 B M N K
}
GROUPED_WORK = {  # (E, rows, N, K) -> 2 rows N K, ONE group
    (2, 8, 32, 64): 32_768,
    (4, 8, 32, 64): 32_768,
    (2, 32, 32, 64): 131_072,
    (4, 32, 32, 64): 131_072,
}
ATTENTION_WORK = {  # (B, H, S, d) -> forward 4 B H S S d / 2 (causal), backward 2.5 x that
    (1, 2, 32, 16): (65_536, 163_840),
    (1, 2, 64, 16): (262_144, 655_360),
}
MEMORY_WORK = {  # 3 x numel x element size
    "fp32": {(256,): 3_072, (4_096,): 49_152, (65_536,): 786_432},
    "bf16": {(256,): 1_536, (4_096,): 24_576, (65_536,): 393_216},
}


@pytest.fixture(scope="module")
def profile():
    lines = []
    result = profile_device("cpu", threads=1, name="tiny-cpu", progress=lines.append, sweep=tiny_sweep(), load=False,
                            network=NETWORK)
    assert any(line.startswith("  gemm bf16") for line in lines), "no progress lines"
    return result


def test_profile_passes_the_validator(profile):
    parsed = profile_from_dict(copy.deepcopy(profile), "tiny-cpu.yaml")
    assert parsed.kind == "cpu" and parsed.name == "tiny-cpu"
    assert {(k, d) for k, d in parsed.curves} == {
        ("gemm", "bf16"), ("gemm", "fp32"), ("grouped_gemm", "bf16"), ("grouped_gemm", "fp32"),
        ("attention", "bf16"), ("attention", "fp32"), ("attention_backward", "bf16"),
        ("attention_backward", "fp32"), ("memory", "bf16"), ("memory", "fp32"),
    }
    assert profile["measured"]["threads"] == 1
    assert parsed.network == {"gpus_per_node": 2, "intra_node_gbps": 1.5, "inter_node_gbps": 1.5, "latency_us": 100.0}
    assert parsed.peak_tflops["fp8"] == parsed.peak_tflops["bf16"] == parsed.peak_tflops["mxfp8"]
    assert 0 < parsed.efficiency["free_op_us"] and 0 < parsed.efficiency["launch_overhead_us"]
    smallest = profile["curves"]["memory"]["fp32"][0]
    assert parsed.efficiency["launch_overhead_us"] == pytest.approx(smallest["seconds"] * 1e6, rel=1e-3)


def test_points_are_sorted_and_positive(profile):
    for kind, by_dtype in profile["curves"].items():
        for dtype, points in by_dtype.items():
            works = [p["work"] for p in points]
            assert works == sorted(works), f"{kind}.{dtype} not sorted by work"
            assert all(p["work"] > 0 and p["seconds"] > 0 for p in points), f"{kind}.{dtype}"


def test_work_is_what_the_pricing_counts(profile):
    for dtype in ("bf16", "fp32"):
        gemm = {tuple(p["shape"]): p["work"] for p in profile["curves"]["gemm"][dtype]}
        assert gemm == GEMM_WORK
        grouped = {tuple(p["shape"]): p["work"] for p in profile["curves"]["grouped_gemm"][dtype]}
        assert grouped == GROUPED_WORK
        forward = {tuple(p["shape"]): p["work"] for p in profile["curves"]["attention"][dtype]}
        backward = {tuple(p["shape"]): p["work"] for p in profile["curves"]["attention_backward"][dtype]}
        assert {s: (forward[s], backward[s]) for s in forward} == ATTENTION_WORK
    for dtype, expected in MEMORY_WORK.items():
        assert {tuple(p["shape"]): p["work"] for p in profile["curves"]["memory"][dtype]} == expected


def test_written_file_loads(profile, tmp_path):
    path = write_profile(profile, tmp_path / "tiny-cpu.yaml")
    loaded = load_profile(path)
    assert loaded.measured["threads"] == 1
    assert loaded.curves == profile_from_dict(copy.deepcopy(profile), str(path)).curves
    gemm = loaded.curve("gemm", "bf16")
    assert [p.shape for p in gemm.points] == [(16, 16, 16), (64, 1, 32, 2), (32, 64, 48), (64, 32, 128)]  # by work


def test_threads_are_restored_and_gpu_needs_a_base():
    before = torch.get_num_threads()
    profile_device("cpu", threads=1, progress=lambda line: None, sweep=tiny_sweep(), network=NETWORK, load=False)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="base"):
        profile_device("cuda", progress=lambda line: None)
