"""bench.run.profile.measure (with bench.run.profile: sweep, curves, document): a tiny CPU sweep gives a profile the loader accepts, with the work of each
point as the pricing counts it (hand-computed here, not recomputed by the module's own formulas).

The gloo calibration is passed in (``network=``) so that the test runs no torchrun; the sweep is
``tiny_sweep`` (well under a second of timing).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from bench.predict.device import load_profile, profile_from_dict
from bench.run.profile.curves import Timer
from bench.run.profile.document import write_profile
from bench.run.profile.measure import ProfileOptions, profile_device
from bench.run.profile.sweep import Sweep, estimate_seconds, timed_points, tiny_sweep

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


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def profile():
    logger, lines = logging.getLogger("bench.run"), _Lines()  # a module's fixture: caplog is a test's
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        options = ProfileOptions("cpu", threads=1, name="tiny-cpu", sweep=tiny_sweep(), load=False, network=NETWORK)
        result = profile_device(options)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert any(line.startswith("  gemm bf16") for line in lines.lines), "no progress lines"
    return result


def test_profile_passes_the_validator(profile):
    parsed = profile_from_dict(copy.deepcopy(profile), "tiny-cpu.yaml")
    assert parsed.kind == "cpu" and parsed.name == "tiny-cpu"
    assert {(k, d) for k, d in parsed.curves} == {
        ("gemm", "bf16"),
        ("gemm", "fp32"),
        ("grouped_gemm", "bf16"),
        ("grouped_gemm", "fp32"),
        ("attention", "bf16"),
        ("attention", "fp32"),
        ("attention_backward", "bf16"),
        ("attention_backward", "fp32"),
        ("memory", "bf16"),
        ("memory", "fp32"),
    }
    assert profile["measured"]["threads"] == 1
    assert parsed.network == {"gpus_per_node": 2, "intra_node_gbps": 1.5, "inter_node_gbps": 1.5, "latency_us": 100.0}
    assert parsed.peak_tflops["fp8"] == parsed.peak_tflops["bf16"] == parsed.peak_tflops["mxfp8"]
    assert parsed.efficiency["free_op_us"] > 0 and parsed.efficiency["launch_overhead_us"] > 0
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
    options = ProfileOptions("cpu", threads=1, sweep=tiny_sweep(), network=NETWORK, load=False)
    profile_device(options)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="base"):
        profile_device(ProfileOptions("cuda"))


def test_timed_points_are_the_points_timed_and_fp32_stops_at_the_cap(monkeypatch):
    # 200,000 FLOPs: of tiny_sweep's fp32 points (FLOPs of one call, by hand) the GEMM 64x32x128
    # (524,288), the grouped GEMMs of 32 rows (262,144 and 524,288) and both attention sizes (forward
    # and backward 3.5 x 65,536 and 3.5 x 262,144) are left out.
    sweep = dataclasses.replace(tiny_sweep(), fp32_max_flops=200_000)
    calls = []
    median = Timer.median

    def counted(self, fn, setup=None):
        calls.append(fn)
        return median(self, fn, setup)

    monkeypatch.setattr(Timer, "median", counted)
    options = ProfileOptions("cpu", threads=1, sweep=sweep, base="cpu-2core", load=False)
    result = profile_device(options)
    # bf16: 4 gemm + 4 grouped + 2 x 2 attention + 3 memory; fp32: 3 + 2 + 0 + 3; 2 stream sizes.
    assert len(calls) == len(timed_points(sweep)) == 25
    curves = result["curves"]
    assert {tuple(p["shape"]) for p in curves["gemm"]["fp32"]} == {(16, 16, 16), (32, 64, 48), (64, 1, 32, 2)}
    assert {tuple(p["shape"]) for p in curves["grouped_gemm"]["fp32"]} == {(2, 8, 32, 64), (4, 8, 32, 64)}
    assert "fp32" not in curves["attention"] and "fp32" not in curves["attention_backward"]
    assert len(curves["memory"]["fp32"]) == 3 and len(curves["attention"]["bf16"]) == 2
    measured = [
        (kind, dtype, tuple(p["shape"]))
        for kind, by_dtype in curves.items()
        for dtype, points in by_dtype.items()
        for p in points
    ]
    assert sorted(measured) == sorted((k, d, s) for k, d, s, _, _ in timed_points(sweep) if k != "stream")
    parsed = profile_from_dict(copy.deepcopy(result), "capped.yaml")
    # A base on a CPU stands in for the gloo calibration: its network, with its sources.
    assert parsed.network == {
        "gpus_per_node": 2,
        "intra_node_gbps": 1.437,
        "inter_node_gbps": 1.437,
        "latency_us": 113.5,
    }
    assert result["sources"]["network.latency_us"].startswith("copied from cpu-2core: ")
    assert "above 2e+05 FLOPs a call not timed" in result["sources"]["curves"]


def test_estimate_of_a_one_gemm_sweep_by_hand():
    # At 1 TFLOP/s bf16 and 100 GB/s: the 1000^3 bf16 GEMM is 2 ms a call (its 6 MB move in 0.06 ms):
    # warm-up and sizing 3 x 2 ms, repeats of 2 ms up to the 20 ms point budget (10, within 3..10),
    # 10 ms making operands: 36 ms. The memory point (1000 bf16 elements) and the stream point (the
    # one memory size, fp32) take a 10 us launch a call: 3 x 10 us, the most repeats (10) of 1 ms
    # batches, 10 ms: 20.03 ms each.
    rates = {"bf16": 1e12, "fp32": 1e11, "bytes": 1e11, "launch_s": 1e-5, "point_overhead_s": 0.01}
    sweep = Sweep(
        gemm_shapes=((1000, 1000, 1000),),
        grouped_rows=(),
        grouped_nk=(),
        grouped_experts=(),
        grouped_max_rows=0,
        attention_seq=(),
        memory_numel=(1000,),
        dtypes=("bf16",),
        point_seconds=0.02,
        min_repeats=3,
        max_repeats=10,
        batch_seconds=1e-3,
    )
    assert [p[0] for p in timed_points(sweep)] == ["gemm", "memory", "stream"]
    assert estimate_seconds(sweep, rates) == pytest.approx(0.036 + 2 * 0.02003)
