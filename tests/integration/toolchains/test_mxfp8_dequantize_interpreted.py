"""The MXFP8 backward's fused dequantize (``gemm.dequantize_rows_triton``), run by Triton's interpreter on
CPU in a fresh process under TRITON_INTERPRET=1 (it must be set before the kernel is defined), equals the
eager composition bit for bit: every E4M3 code under E8M0 scales from the smallest (2^-127, a subnormal
fp32 factor) to the NaN scale, into fp32 and bf16, with the operand's K padding dropped."""

import subprocess
import sys

import pytest
import torch
from interpreted_kernels import interpreter_env
from mxfp8_dequantize_cases import SIZE, assert_same_bits, expected, operand

from bench.results import REPO_ROOT

REPO = REPO_ROOT

_CHILD = """
import sys, torch
from moe_engine.precision.mxfp8 import gemm as mxfp8_gemm
data, scales = torch.load(sys.argv[1])
out = {str(d): mxfp8_gemm.dequantize_rows_triton(data, scales, int(sys.argv[3]), d) for d in (torch.float32, torch.bfloat16)}
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mxfp8_dequantize")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(operand(), inputs)
    env = interpreter_env()
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs), str(SIZE)]
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreted_dequantize_equals_eager(interpreted, dtype):
    data, scales = operand()
    assert_same_bits(interpreted[str(dtype)], expected(data, scales, dtype))
