"""Rowwise-scaled FP8 (e4m3) with current scaling: the operand format of torchao's float8 training
recipe "rowwise" and of its float8 MoE training, which feed ``torch.nn.functional.scaled_grouped_mm``
with ``ScalingType.RowWise`` (CUTLASS on sm90). One fp32 scale per row of the operand along the
reduction dim, computed from the tensor being cast (no amax history):
More: docs/precision.md.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
"""The largest e4m3fn magnitude."""
EPS = 1e-12
"""Smallest amax a scale is computed from (torchao's ``EPS``): all-zero rows get 448 / 1e-12."""


def rowwise_scales(x: torch.Tensor, axis: int = -1, power_of_2: bool = True) -> torch.Tensor:
    """fp32 quantization scales, one per slice along ``axis`` (kept as a size-1 dim)."""
    amax = x.abs().amax(dim=axis, keepdim=True)
    scale = (E4M3_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(x: torch.Tensor, axis: int = -1, power_of_2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(data float8_e4m3fn shaped like x, fp32 scales with ``axis`` of size 1)."""
    scale = rowwise_scales(x, axis, power_of_2)
    data = (x.to(torch.float32) * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``quantize`` stands for: data / scale (exact in fp32 for power-of-two scales)."""
    return (data.to(torch.float32) / scale).to(dtype)


def grouped_mm_emulated(
    a_MK: torch.Tensor,
    a_scale_M1: torch.Tensor,
    b_ENK: torch.Tensor,
    b_scale_EN1: torch.Tensor,
    offsets_E: torch.Tensor,
) -> torch.Tensor:
    """fp32 (M, N): rows of expert e times B[e]^T on the dequantized operands, what
    ``scaled_grouped_mm`` computes with RowWise scales (A scaled per row, B per row of each expert's
    (N, K) slice) up to summation order; rows after the last offset are zeros."""
    from moe_engine.moe.grouped_gemm import grouped_mm

    a = dequantize(a_MK, a_scale_M1)
    b = dequantize(b_ENK, b_scale_EN1)
    out_MN = grouped_mm(a, b.transpose(1, 2), offsets_E)
    real_M1 = (torch.arange(out_MN.shape[0], device=out_MN.device) < offsets_E[-1]).unsqueeze(1)
    return torch.where(real_M1, out_MN, 0.0)
