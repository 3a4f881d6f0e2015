"""The experts' weight gradients added into an fp32 gradient buffer by one Triton GEMM
(``moe_engine::grouped_wgrad_accumulate``) against the two passes it replaces, ``torch._grouped_mm`` to a
bf16 gradient and ``out.add_`` into the buffer, side by side in one run.

Shapes: a 16-expert rank's gradients, 4,096 rows an expert, bf16 operands: the gate/up projection's
(M = 2 x 1,536, K = 2,048) and the down projection's (M = 2,048, K = 1,536). Each pair stores the GEMM's
FLOPs in ``extra_info``, so the ratio of their FLOP/s is two-pass seconds / fused seconds (above 1: the
fused op is faster). Before timing, the fused op's result at the shape is checked against an fp32 GEMM.
CUDA only (``MOE_BENCH_DEVICE=cuda``): on a CPU both would run the eager composition.
"""

from __future__ import annotations

import pytest
import torch

from moe_engine import kernels

ROUNDS = 5
SHAPES = {
    # (experts, rows each, M, K)
    "gate_up": (16, 4096, 2 * 1536, 2048),
    "down": (16, 4096, 2048, 1536),
}


def _operands(shape: str, device: torch.device):
    experts, rows, m, k = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    a_NM = torch.randn(experts * rows, m, device=device, generator=g).to(torch.bfloat16)
    b_NK = torch.randn(experts * rows, k, device=device, generator=g).to(torch.bfloat16)
    offsets_E = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
    return a_NM, b_NK, offsets_E, torch.zeros(experts, m, k, device=device)


def _check_fused(a_NM, b_NK, offsets_E) -> None:
    """The fused op at this shape against the fp32 GEMM of the same bf16 values (both sum exact products
    in fp32), relative to the largest value: 10 sqrt(rows) fp32 unit roundoffs, as tests/support/tolerances.py
    derives it."""
    out_EMK = torch.zeros(offsets_E.numel(), a_NM.shape[1], b_NK.shape[1], device=a_NM.device)
    kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    want_EMK = torch._grouped_mm(a_NM.float().t(), b_NK.float(), offs=offsets_E)
    rows = int(offsets_E[0])
    tol = 10 * (rows**0.5 * 2.0**-24 + 2.0**-24)
    error = ((out_EMK - want_EMK).abs().max() / want_EMK.abs().max()).item()
    assert error <= tol, f"fused result off by {error:.2e} of the largest value (tolerance {tol:.2e})"


@pytest.mark.parametrize("side", ["fused", "two-pass"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_wgrad(benchmark, bench_device, shape, side):
    if bench_device.type != "cuda":
        pytest.skip("a CUDA benchmark (MOE_BENCH_DEVICE=cuda): on a CPU both sides run the eager composition")
    a_NM, b_NK, offsets_E, out_EMK = _operands(shape, bench_device)
    if side == "fused":
        _check_fused(a_NM, b_NK, offsets_E)

        def step():
            kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    else:

        def step():
            out_EMK.add_(torch._grouped_mm(a_NM.t(), b_NK, offs=offsets_E))

    def timed():
        step()
        torch.cuda.synchronize(bench_device)

    timed()  # the fused op's first call compiles its kernel: kept out of the timing
    experts, rows, m, k = SHAPES[shape]
    path = kernels.kernel_paths(bench_device, torch.bfloat16)["grouped_wgrad_accumulate"]
    benchmark.extra_info.update(
        flops=2 * experts * rows * m * k,
        device=str(bench_device),
        path=path.details if side == "fused" else "torch._grouped_mm + add_",
    )
    benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=2, iterations=1)
