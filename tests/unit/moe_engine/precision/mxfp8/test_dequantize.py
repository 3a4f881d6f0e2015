"""The MXFP8 backward's fused dequantize equals the eager composition bit for bit: every E4M3 code
under E8M0 scales from the smallest (2^-127, a subnormal fp32 factor) to the NaN scale, into fp32 and
bf16, with the operand's K padding dropped. On CUDA here; run by Triton's interpreter in a fresh process
on CPU in tests/integration/toolchains/test_mxfp8_dequantize_interpreted.py."""

import pytest
import torch
from mxfp8_dequantize_cases import SIZE, assert_same_bits, expected, operand


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_dequantize_rows_equals_eager(dtype):
    from moe_engine.precision.mxfp8.blocks import MXTensor
    from moe_engine.precision.mxfp8.gemm import dequantize_rows

    data, scales = operand()
    t = MXTensor(data.cuda().view(torch.float8_e4m3fn), scales.cuda().view(torch.float8_e8m0fnu), axis=-1)
    assert_same_bits(dequantize_rows(t, SIZE, dtype).cpu(), expected(data, scales, dtype))
