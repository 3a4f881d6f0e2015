"""The experts' weight gradients in MXFP8 (``moe_engine.precision.mxfp8.wgrad``: both operands quantized in
blocks of 32 tokens within each expert's rows, then the block-scaled GEMM adding into the fp32 buffer)
against the BF16 GEMM adding into it (``moe_engine::grouped_wgrad_accumulate``), side by side in one run.

Shapes: those of ``test_grouped_wgrad`` (a 16-expert rank's gate/up and down gradients, 4,096 rows an
expert, bf16 operands). The MXFP8 side's time includes quantizing its two operands, as the engine's weight
phase does. Each pair stores the GEMM's FLOPs in ``extra_info``: the ratio of their FLOP/s is BF16 seconds
over MXFP8 seconds. Blackwell runs the MXFP8 GEMM on its block-scaled tensor cores; on Hopper Triton upcasts
the e4m3 tiles to bf16, so there the ratio measures that emulation. Before timing, the MXFP8 result is
checked against an fp32 GEMM of the same quantized values. CUDA only (``MOE_BENCH_DEVICE=cuda``).
"""

from __future__ import annotations

import pytest
import torch

from bench.micro.test_grouped_wgrad import ROUNDS, SHAPES, _operands
from moe_engine import kernels
from moe_engine.precision.mxfp8 import wgrad
from moe_engine.precision.mxfp8.token_blocks import quantize_token_blocks


def _check_mxfp8(a_NM, b_NK, offsets_E) -> None:
    """The Triton GEMM against ``torch._grouped_mm`` of the dequantized operands (both sum exact products
    in fp32), relative to the largest value: 10 sqrt(rows) fp32 unit roundoffs (tests/support/tolerances.py)."""
    a, b = quantize_token_blocks(a_NM, offsets_E), quantize_token_blocks(b_NK, offsets_E)
    out_EMK = torch.zeros(offsets_E.numel(), a_NM.shape[1], b_NK.shape[1], device=a_NM.device)
    wgrad.grouped_wgrad(a, b, out_EMK)
    want_EMK = torch._grouped_mm(a.dequantize().t(), b.dequantize(), offs=offsets_E)
    rows = int(offsets_E[0])
    tol = 10 * (rows**0.5 * 2.0**-24 + 2.0**-24)
    error = ((out_EMK - want_EMK).abs().max() / want_EMK.abs().max()).item()
    assert error <= tol, f"MXFP8 weight gradient off by {error:.2e} of the largest value (tolerance {tol:.2e})"


@pytest.mark.parametrize("side", ["mxfp8", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mxfp8_wgrad(benchmark, bench_device, shape, side):
    if bench_device.type != "cuda":
        pytest.skip("a CUDA benchmark (MOE_BENCH_DEVICE=cuda): on a CPU the MXFP8 side runs the emulation")
    a_NM, b_NK, offsets_E, out_EMK = _operands(shape, bench_device)
    if side == "mxfp8":
        _check_mxfp8(a_NM, b_NK, offsets_E)

        def step():
            a, b = quantize_token_blocks(a_NM, offsets_E), quantize_token_blocks(b_NK, offsets_E)
            wgrad.grouped_wgrad(a, b, out_EMK)
    else:

        def step():
            kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)

    def timed():
        step()
        torch.cuda.synchronize(bench_device)

    timed()  # the first call compiles the kernels: kept out of the timing
    experts, rows, m, k = SHAPES[shape]
    path = "mxfp8 " + wgrad.available_path(bench_device).value if side == "mxfp8" else "grouped_wgrad_accumulate"
    benchmark.extra_info.update(flops=2 * experts * rows * m * k, device=str(bench_device), path=path)
    benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=2, iterations=1)
