"""Rowwise FP8 experts as the projection prices them: one kernel per GEMM at the profile's fp8 rate."""

from __future__ import annotations

import pytest
import torch

from bench.predict.device import load_profile
from bench.predict.ops import REGIONS, TensorSpec, TracedOp, region_op
from bench.predict.pricing import op_seconds
from moe_engine.config import ExpertBackendKind
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups


def _op(name, inputs, outputs, **kw):
    return TracedOp(name, tuple(inputs), tuple(outputs), "forward", region="fp8.grouped_mm", region_call=1, **kw)


def _gemm_region(m=256, k=64, n=128, experts=4):
    a = TensorSpec((m, k), "torch.float32")
    b = TensorSpec((experts, k, n), "torch.float32")
    out32 = TensorSpec((m, n), "torch.float32")
    return [
        _op("aten.mul.Tensor", [TensorSpec((m, k), "torch.float8_e4m3fn")], [a]),
        _op("aten.mul.Tensor", [TensorSpec((experts, k, n), "torch.float8_e4m3fn")], [b]),
        _op(
            "aten._grouped_mm.default",
            [a, b, TensorSpec((experts,), "torch.int32")],
            [out32],
            group_rows=(m // experts,) * experts,
        ),
        _op("aten._to_copy.default", [out32], [TensorSpec((m, n), "torch.bfloat16")]),
    ]


def test_gemm_region_by_hand():
    work = region_op(_gemm_region(), "fp8.grouped_mm")
    assert work.kind == "grouped_gemm" and work.dtype == "torch.float8_e4m3fn"
    assert work.flops == 2 * 256 * 64 * 128
    # e4m3 operands, fp32 scales (256 rows of a, 4 x 128 columns of b), the bf16 output.
    assert work.nbytes == 256 * 64 + 4 * 64 * 128 + 4 * (256 + 4 * 128) + 2 * 256 * 128


def test_priced_at_the_fp8_peak_on_h100():
    h100 = load_profile("h100-sxm")
    work = region_op(_gemm_region(m=65536, k=2048, n=1536, experts=8), "fp8.grouped_mm")
    eff = h100.efficiency
    compute_s = work.flops / (h100.peak_tflops["fp8"] * 1e12 * eff["grouped_gemm"])
    memory_s = work.nbytes / (h100.hbm_gbps * 1e9 * eff["memory"])
    assert compute_s > memory_s
    assert op_seconds(work, h100) == pytest.approx(compute_s + eff["launch_overhead_us"] * 1e-6)


def test_quantize_and_dequantize_regions_by_hand():
    x = TensorSpec((256, 64), "torch.bfloat16")
    quantize = region_op([_op("aten.abs.default", [x], [x])], "fp8.quantize")
    assert quantize.kind == "memory" and quantize.nbytes == 2 * 256 * 64 + 256 * 64 + 4 * 256
    dequantize = region_op([_op("aten._to_copy.default", [x], [x])], "fp8.dequantize")
    assert dequantize.kind == "memory" and dequantize.nbytes == 256 * 64 + 4 * 256 + 2 * 256 * 64


def test_the_backend_marks_its_regions():
    """The regions the trace groups into kernels are the ones the backend runs under."""
    layer = GroupedExperts(64, 32, 4, ExpertBackendKind.FP8).to(torch.bfloat16)
    torch.nn.init.normal_(layer.gate_up)
    torch.nn.init.normal_(layer.down)
    groups = ExpertGroups.from_counts(torch.tensor([5, 0, 12, 9]))
    x = torch.randn(26, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x, groups).sum().backward()
    names = [e.name for e in prof.events()]
    assert {"fp8.grouped_mm", "fp8.quantize", "fp8.dequantize"} <= set(REGIONS)
    assert names.count("fp8.grouped_mm") == 4  # fprop h, y; dgrad a, x
    assert names.count("fp8.quantize") >= 8  # each GEMM's two operands
    assert names.count("fp8.dequantize") == 1  # x for the bf16 weight gradient
