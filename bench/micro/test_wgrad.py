"""A dense projection's weight gradient added into an fp32 gradient buffer by the GEMM
(``moe_engine::wgrad_accumulate``: cuBLAS through ``torch.addmm`` with ``out_dtype``) against the two
passes it replaces, ``torch.mm`` to a bf16 gradient and ``out.add_`` into the buffer, side by side in
one run.

Shapes: 8,192 rows (two 4,096-token sequences), bf16 operands: an attention projection (M = K = 4,096)
and an MLP's down projection (M = 4,096, K = 14,336). Each pair stores the GEMM's FLOPs in
``extra_info``, so the ratio of their FLOP/s is two-pass seconds / fused seconds (above 1: the fused op
is faster). Before timing, the fused op's result is checked against an fp32 GEMM. CUDA only
(``MOE_BENCH_DEVICE=cuda``): on a CPU both would run the eager composition.
"""

from __future__ import annotations

import pytest
import torch

from moe_engine import kernels

ROUNDS = 5
SHAPES = {
    # (rows, M, K)
    "attention": (8192, 4096, 4096),
    "mlp_down": (8192, 4096, 14336),
}


def _operands(shape: str, device: torch.device):
    rows, m, k = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    a_NM = torch.randn(rows, m, device=device, generator=g).to(torch.bfloat16)
    b_NK = torch.randn(rows, k, device=device, generator=g).to(torch.bfloat16)
    return a_NM, b_NK, torch.zeros(m, k, device=device)


def _check_fused(a_NM, b_NK) -> None:
    """The fused op against the fp32 GEMM of the same bf16 values (both sum exact products in fp32),
    relative to the largest value: 10 sqrt(rows) fp32 unit roundoffs, as tests/support/tolerances.py
    derives it."""
    out_MK = torch.zeros(a_NM.shape[1], b_NK.shape[1], device=a_NM.device)
    kernels.wgrad_accumulate(a_NM, b_NK, out_MK)
    want_MK = a_NM.float().t() @ b_NK.float()
    tol = 10 * (a_NM.shape[0] ** 0.5 * 2.0**-24 + 2.0**-24)
    error = ((out_MK - want_MK).abs().max() / want_MK.abs().max()).item()
    assert error <= tol, f"fused result off by {error:.2e} of the largest value (tolerance {tol:.2e})"


@pytest.mark.parametrize("side", ["fused", "two-pass"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_wgrad(benchmark, bench_device, shape, side):
    if bench_device.type != "cuda":
        pytest.skip("a CUDA benchmark (MOE_BENCH_DEVICE=cuda): on a CPU both sides run the eager composition")
    a_NM, b_NK, out_MK = _operands(shape, bench_device)
    if side == "fused":
        _check_fused(a_NM, b_NK)

        def step():
            kernels.wgrad_accumulate(a_NM, b_NK, out_MK)
    else:

        def step():
            out_MK.add_(a_NM.t().mm(b_NK))

    def timed():
        step()
        torch.cuda.synchronize(bench_device)

    timed()
    rows, m, k = SHAPES[shape]
    benchmark.extra_info.update(
        flops=2 * rows * m * k,
        device=str(bench_device),
        path="torch.addmm(out_dtype=float32)" if side == "fused" else "torch.mm + add_",
    )
    benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=2, iterations=1)
