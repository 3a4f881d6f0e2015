"""The Triton MXFP8 quantizer equals the torch one byte for byte on CUDA, and checks its arguments; in
Triton's interpreter on CPU (a fresh process under TRITON_INTERPRET=1) in
tests/integration/toolchains/test_mxfp8_kernels_interpreted.py."""

import pytest
import torch
from mxfp8_quantize_cases import (
    BLOCK,
    ROUNDINGS,
    assert_same_bytes,
    bits_to_float,
    cases,
    codes,
    random_bits_near_block_exponent,
)

from moe_engine.precision.mxfp8.blocks import quantize
from moe_engine.precision.mxfp8.kernels import _interpreted, quantize_auto, quantize_triton

# --- checks without a kernel launch -------------------------------------------------------------------------


def test_sizes_must_be_block_multiples():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_triton(torch.randn(4, 48))
    with pytest.raises(ValueError, match="axis 0"):
        quantize_triton(torch.randn(40, 64), axis=0)


def test_rejects_integer_input():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_triton(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.skipif(_interpreted(), reason="under TRITON_INTERPRET=1 CPU tensors are accepted")
def test_cpu_tensor_needs_the_interpreter():
    with pytest.raises(ValueError, match="CUDA tensors"):
        quantize_triton(torch.randn(2, 32))


def test_auto_uses_torch_on_cpu():
    x = torch.randn(4, 64)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(quantize_auto(x), quantize(x)))


# --- compiled on CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
@pytest.mark.parametrize("case", list(cases()))
def test_cuda_kernel_matches_torch(case, rounding):
    x, axis, block = cases()[case]
    got = codes(*quantize_triton(x.cuda(), axis, block, rounding))
    assert_same_bytes(got, x, axis, block, rounding)  # against the CPU implementation
    on_gpu = codes(*quantize(x.cuda(), axis, block, rounding))
    assert torch.equal(got[0], on_gpu[0]) and torch.equal(got[1], on_gpu[1])  # and torch on the same device


@pytest.mark.cuda
@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
def test_cuda_kernel_on_many_random_bit_patterns(rounding):
    g = torch.Generator().manual_seed(1)
    near = random_bits_near_block_exponent(g, 1 << 15)
    anything = bits_to_float(torch.randint(0, 2**32, (1 << 14, BLOCK), generator=g))  # NaN and Inf included
    x = torch.cat([near, anything]).reshape(-1, 4096)
    assert_same_bytes(codes(*quantize_triton(x.cuda(), rounding=rounding)), x, -1, BLOCK, rounding)
    assert_same_bytes(codes(*quantize_triton(x.cuda(), axis=0, rounding=rounding)), x, 0, BLOCK, rounding)


@pytest.mark.cuda
def test_cuda_auto_uses_the_kernel():
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    got, expected = quantize_auto(x), quantize_triton(x)
    assert got[0].is_cuda and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected))
