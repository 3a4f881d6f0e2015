"""The MXFP8 backward's fused dequantize equals the eager composition bit for bit: every E4M3 code
under E8M0 scales from the smallest (2^-127, a subnormal fp32 factor) to the NaN scale, into fp32 and
bf16, with the operand's K padding dropped. Run by Triton's interpreter in a fresh process on CPU
(``TRITON_INTERPRET=1`` must be set before the kernel is defined); on CUDA by the test below it."""

import os
import subprocess
import sys

import pytest
import torch

from bench.results import REPO_ROOT
from moe_engine.precision.mxfp8.blocks import dequantize

REPO = REPO_ROOT
SCALES = [0, 1, 2, 20, 100, 126, 127, 128, 150, 200, 253, 254, 255]
SIZE = 50
"""Columns kept of the 64 (two blocks): the second block's last 14 are K padding."""


def operand() -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (R, 64) uint8: every code under every scale, scales (R, 2) uint8)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    data = codes.repeat(len(SCALES) * len(SCALES), 1)
    pairs = torch.tensor([(a, b) for a in SCALES for b in SCALES], dtype=torch.uint8)
    return data, pairs.repeat_interleave(4, dim=0)


def expected(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), -1, dtype=dtype)[:, :SIZE]


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    same = (got == want) | (got.isnan() & want.isnan())
    # NaN or not, and the sign of zero, exactly as the eager composition gives them.
    same &= (torch.signbit(got) == torch.signbit(want)) | want.isnan()
    bad = (~same).nonzero()
    assert len(bad) == 0, (
        f"{len(bad)} values differ, first at {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"
    )


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
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs), str(SIZE)]
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreted_dequantize_equals_eager(interpreted, dtype):
    data, scales = operand()
    assert_same_bits(interpreted[str(dtype)], expected(data, scales, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_dequantize_rows_equals_eager(dtype):
    from moe_engine.precision.mxfp8.blocks import MXTensor
    from moe_engine.precision.mxfp8.gemm import dequantize_rows

    data, scales = operand()
    t = MXTensor(data.cuda().view(torch.float8_e4m3fn), scales.cuda().view(torch.float8_e8m0fnu), axis=-1)
    assert_same_bits(dequantize_rows(t, SIZE, dtype).cpu(), expected(data, scales, dtype))
