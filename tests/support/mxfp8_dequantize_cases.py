"""The MXFP8 backward's dequantize operand (every E4M3 code under E8M0 scales from the smallest to the NaN
scale, with K padding), the eager composition it must equal, and a bitwise comparison: shared by the CUDA
test (tests/unit/moe_engine/precision/mxfp8/test_dequantize.py) and the interpreted run
(tests/integration/toolchains/test_mxfp8_dequantize_interpreted.py)."""

import torch

from moe_engine.precision.mxfp8.blocks import dequantize

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
