"""The MXFP8 weight-gradient GEMM's emulation against a per-expert fp64 loop over the specification's
values (``mxfp8_wgrad_cases``): added into an fp32 buffer, and handed back in fp32 and bf16; empty
experts, NaN padding rows; argument checks. The Triton kernel under Triton's interpreter:
tests/integration/toolchains/test_mxfp8_wgrad_interpreted.py.

Tolerance: the products of two E4M3 values times powers of two are exact in fp32, so the emulation
differs from the fp64 loop by its fp32 sums over an expert's rows and by the bf16 rounding of its
product (torch's grouped GEMM writes bf16): 2^-8 of the largest value covers both."""

import pytest
import torch
from mxfp8_wgrad_cases import CASES, token_operand, wgrad_loop
from tolerances import tolerance

from moe_engine.precision.mxfp8 import wgrad
from moe_engine.precision.mxfp8.gemm import GemmPath
from moe_engine.precision.mxfp8.token_blocks import quantize_token_blocks


def _case(name, dtype, seed):
    counts, padding, width, x_width = CASES[name]
    a_NX, offsets_E = token_operand(counts, padding, x_width, dtype, seed)
    b_NY, _ = token_operand(counts, padding, width, dtype, seed + 100)
    return counts, a_NX, b_NY, offsets_E


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_added_into_the_buffer_as_a_per_expert_loop(name, dtype):
    counts, a_NX, b_NY, offsets_E = _case(name, dtype, seed=len(name))
    a, b = quantize_token_blocks(a_NX, offsets_E), quantize_token_blocks(b_NY, offsets_E)
    out_EXY = torch.randn(len(counts), a_NX.shape[1], b_NY.shape[1], generator=torch.Generator().manual_seed(1)) * 1e-3
    before = out_EXY.clone()
    assert wgrad.grouped_wgrad(a, b, out_EXY) is None
    product = wgrad_loop(a_NX, b_NY, counts)
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.equal(out_EXY[e], before[e]), "an expert without rows leaves its slice as it was"
            continue
        want = before[e].double() + product[e]
        assert _relative(out_EXY[e], want) < 2**-8, (name, e)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_handed_back_with_zeros_for_empty_experts(out_dtype):
    counts, a_NX, b_NY, offsets_E = _case("uneven", torch.bfloat16, seed=4)
    a, b = quantize_token_blocks(a_NX, offsets_E), quantize_token_blocks(b_NY, offsets_E)
    out = wgrad.grouped_wgrad(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (len(counts), a_NX.shape[1], b_NY.shape[1])
    product = wgrad_loop(a_NX, b_NY, counts)
    for e, count in enumerate(counts):
        if count == 0:
            assert not out[e].any()
        else:
            assert _relative(out[e], product[e]) < 2**-8


def test_checks_its_operands():
    counts, a_NX, b_NY, offsets_E = _case("uneven", torch.float32, seed=2)
    a, b = quantize_token_blocks(a_NX, offsets_E), quantize_token_blocks(b_NY, offsets_E)
    with pytest.raises(ValueError, match="contiguous float32"):
        wgrad.grouped_wgrad(a, b, torch.zeros(len(counts), a_NX.shape[1], b_NY.shape[1], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous float32"):
        wgrad.grouped_wgrad(a, b, torch.zeros(len(counts), b_NY.shape[1], a_NX.shape[1]).transpose(1, 2))
    short = quantize_token_blocks(b_NY[:-1], offsets_E)
    with pytest.raises(ValueError, match="same rows"):
        wgrad.grouped_wgrad(a, short)
    with pytest.raises(ValueError, match="one offsets tensor"):
        wgrad.grouped_wgrad(a, quantize_token_blocks(b_NY, offsets_E.clone()))
    with pytest.raises(ValueError, match="triton or emulation"):
        wgrad.grouped_wgrad(a, b, path=GemmPath.SCALED_GROUPED_MM)


def test_cpu_runs_the_emulation():
    assert wgrad.available_path("cpu") is GemmPath.EMULATION


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cuda_path_adds_each_experts_product(name):
    counts, a_NX, b_NY, offsets_E = _case(name, torch.bfloat16, seed=len(name))
    offsets = offsets_E.cuda()
    a, b = quantize_token_blocks(a_NX.cuda(), offsets), quantize_token_blocks(b_NY.cuda(), offsets)
    out_EXY = torch.zeros(len(counts), a_NX.shape[1], b_NY.shape[1], device="cuda")
    wgrad.grouped_wgrad(a, b, out_EXY)
    # The Triton kernel adds its fp32 sums; the emulation (below capability 8.9) rounds them to bf16 first.
    triton = wgrad.available_path("cuda") is GemmPath.TRITON
    bound = tolerance(torch.float32, max(counts)) if triton else 2**-8
    product = wgrad_loop(a_NX, b_NY, counts)
    for e, count in enumerate(counts):
        if count:
            assert _relative(out_EXY[e].cpu(), product[e]) < bound, (name, e)
        else:
            assert not out_EXY[e].any()
