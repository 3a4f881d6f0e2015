"""MXFP8 (OCP Microscaling Formats v1.0): blocks of 32 E4M3 elements sharing one E8M0 scale.
More: docs/precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
E8M0_NAN = 0xFF


class ScaleRounding(str, Enum):
    """How the shared exponent is derived from the block's largest magnitude."""

    FLOOR = "floor"
    """floor(log2(amax)) - 8, the OCP MX specification (values above 448 saturate)."""
    CEIL = "ceil"
    """ceil(log2(amax / 448)): the scale is rounded up so that nothing saturates."""


def check_blocked_axis(shape: torch.Size, axis: int, block: int) -> int:
    """The non-negative axis; a clear error when its size is not a multiple of the block."""
    axis = axis % len(shape)
    size = shape[axis]
    if size % block:
        raise ValueError(
            f"MXFP8 quantizes blocks of {block} along axis {axis}, whose size {size} is not a multiple of "
            f"{block}; pad the tensor to a multiple of {block}"
        )
    return axis


def pad_to_block(t: torch.Tensor, axis: int, block: int = BLOCK) -> torch.Tensor:
    """``t`` zero-padded along ``axis`` to a multiple of ``block`` (itself when it is one already):
    exact for MX operands, since a zero changes no block's maximum and adds nothing to a dot product."""
    axis = axis % t.ndim
    missing = -t.shape[axis] % block
    if not missing:
        return t
    # F.pad lists (left, right) pairs from the last dim backwards.
    return torch.nn.functional.pad(t, [0, 0] * (t.ndim - 1 - axis) + [0, missing])


def _blocks(x: torch.Tensor, axis: int, block: int) -> tuple[torch.Tensor, int]:
    """x with ``axis`` moved last and split into (..., n_blocks, block); returns it and the axis."""
    axis = check_blocked_axis(x.shape, axis, block)
    size = x.shape[axis]
    moved = x.movedim(axis, -1)
    return moved.reshape(*moved.shape[:-1], size // block, block), axis


def shared_exponents(amax: torch.Tensor, rounding: ScaleRounding = ScaleRounding.FLOOR) -> torch.Tensor:
    """int32 shared exponent of each block from its largest magnitude (fp32), clamped to E8M0's range."""
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent with m in [0.5, 1)
    shared = exponent - 1 - E4M3_EMAX
    if ScaleRounding(rounding) is ScaleRounding.CEIL:
        # One binade up where the block maximum would exceed 448 (the scaling is exact in fp32).
        shared = shared + (amax * torch.exp2(-shared.float()) > E4M3_MAX).to(shared.dtype)
    shared = torch.where(amax == 0, E8M0_MIN_EXP, shared)
    return shared.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def quantize(
    x: torch.Tensor, axis: int = -1, block: int = BLOCK, rounding: ScaleRounding = ScaleRounding.FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales): data float8_e4m3fn shaped like x, scales float8_e8m0fnu with the axis divided by block."""
    blocks, axis = _blocks(x.float(), axis, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    shared = shared_exponents(amax, rounding)
    # Multiplying by 2^-shared_exp is exact in fp32 for every exponent E8M0 allows here.
    scaled = blocks * torch.exp2(-shared.float())
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    bad = ~torch.isfinite(amax)
    biased = torch.where(bad, E8M0_NAN, shared + 127).to(torch.uint8)
    # The axis length spelled out, not -1: reshape cannot infer it when another dimension is 0.
    data = data.reshape(*blocks.shape[:-2], blocks.shape[-2] * block).movedim(-1, axis)
    scales = biased.squeeze(-1).movedim(-1, axis).view(torch.float8_e8m0fnu)
    return data.contiguous(), scales.contiguous()


def dequantize(
    data: torch.Tensor, scales: torch.Tensor, axis: int = -1, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values the quantized tensor stands for: data * 2^(scale - 127), NaN where the scale is NaN."""
    blocks, axis = _blocks(data.float(), axis, block)
    biased = scales.view(torch.uint8).movedim(axis % scales.ndim, -1).unsqueeze(-1)
    scale = torch.exp2(biased.float() - 127)
    scale = torch.where(biased == E8M0_NAN, float("nan"), scale)
    values = (blocks * scale).reshape(*blocks.shape[:-2], blocks.shape[-2] * block).movedim(-1, axis)
    return values.to(dtype)


@dataclass
class MXTensor:
    """A tensor kept in MXFP8: what the experts save for backward instead of bf16 activations."""

    data: torch.Tensor
    """float8_e4m3fn elements, shaped like the original."""
    scales: torch.Tensor
    """float8_e8m0fnu shared scales, one per block along ``axis``."""
    axis: int
    """The blocked axis."""
    block: int = BLOCK
    """Elements per scale."""

    @classmethod
    def from_tensor(cls, x: torch.Tensor, axis: int = -1, block: int = BLOCK) -> MXTensor:
        data, scales = quantize(x, axis, block)
        return cls(data, scales, axis, block)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.data, self.scales, self.axis, self.block, dtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes
