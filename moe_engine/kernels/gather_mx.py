"""The dispatch gather fused with the MXFP8 quantisation of the experts' first GEMM operand.
More: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.routing import reference_gather
from moe_engine.kernels.storage import on_device
from moe_engine.precision.mxfp8.blocks import BLOCK, pad_to_block
from moe_engine.precision.mxfp8.kernels import mx_blocks, quantize_auto

ROWS_PER_PROGRAM = 128
"""Rows of one program's tile, one block of 32 columns wide."""


def reference_gather_mx(
    x_TD: Tensor, assignment_R: Tensor, top_k: int, filled_R: Tensor | None, end_1: Tensor
) -> tuple[Tensor, Tensor]:
    """(codes, scales) as uint8: the eager composition."""
    rows_RD = reference_gather(x_TD, assignment_R, top_k, filled_R)
    real_R1 = (torch.arange(rows_RD.shape[0], device=rows_RD.device) < end_1).unsqueeze(1)
    codes, scales = quantize_auto(pad_to_block(torch.where(real_R1, rows_RD, 0), -1), axis=-1)
    return codes.view(torch.uint8), scales.view(torch.uint8)


@triton.jit
def _gather_mx_kernel(
    x_ptr,
    assignment_ptr,
    filled_ptr,
    end_ptr,
    codes_ptr,
    scales_ptr,
    n_rows,
    width,
    top_k,
    x_stride,
    ROWS: tl.constexpr,
    BF16: tl.constexpr,
    FILLED: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    block = tl.program_id(1)
    cols = block * 32 + tl.arange(0, 32)  # [32]
    live = rows < n_rows
    take = live & (rows < tl.load(end_ptr))
    if FILLED:
        take = take & (tl.load(filled_ptr + rows, mask=live, other=0) != 0)
    source = tl.load(assignment_ptr + rows, mask=live, other=0) // top_k
    offsets = source.to(tl.int64)[:, None] * x_stride + cols[None, :]
    mask = take[:, None] & (cols < width)[None, :]
    if BF16:
        # bf16 is the top half of fp32: its int16 bits widened by a shift, no float conversion.
        bits = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(x_ptr + offsets, mask=mask, other=0)  # fp32 as its int32 bits
    codes, scale_code = mx_blocks(bits, False)
    out = rows.to(tl.int64)[:, None] * width + cols[None, :]
    tl.store(codes_ptr + out, codes.to(tl.uint8), mask=live[:, None] & (cols < width)[None, :])
    tl.store(scales_ptr + rows.to(tl.int64) * (width // 32) + block, scale_code.to(tl.uint8), mask=live)


def path(device: torch.device | str, dtype: torch.dtype, width: int | None = None) -> dispatch.KernelPath:
    """``dispatch.KernelPath`` of ``gather_rows_mx`` for rows of ``dtype`` and ``width`` columns."""
    limit = None
    if width is not None and width % BLOCK:
        limit = f"the rows' width {width} is not a multiple of MXFP8's block of {BLOCK}"
    return dispatch.choose("gather_rows_mx", device, dtype, _gather_mx_kernel, limit)


def _triton_gather_mx(
    x_TD: Tensor, assignment_R: Tensor, top_k: int, filled_R: Tensor | None, end_1: Tensor
) -> tuple[Tensor, Tensor]:
    x_TD = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    rows, width = assignment_R.numel(), x_TD.shape[1]
    codes = torch.empty(rows, width, dtype=torch.uint8, device=x_TD.device)
    scales = torch.empty(rows, width // BLOCK, dtype=torch.uint8, device=x_TD.device)
    if rows and width:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), width // BLOCK)
        assignment_R = assignment_R.contiguous()
        bits = x_TD.view(torch.int16) if x_TD.dtype == torch.bfloat16 else x_TD.view(torch.int32)
        with on_device(x_TD):
            _gather_mx_kernel[grid](
                bits,
                assignment_R,
                assignment_R if filled_R is None else filled_R.contiguous().view(torch.uint8),
                end_1.to(torch.int32).contiguous(),
                codes,
                scales,
                rows,
                width,
                top_k,
                x_TD.stride(0),
                ROWS=ROWS_PER_PROGRAM,
                BF16=x_TD.dtype == torch.bfloat16,
                FILLED=filled_R is not None,
            )
    return codes, scales


@torch.library.custom_op("moe_engine::gather_rows_mx", mutates_args=())
def gather_rows_mx_op(
    x: Tensor, assignment: Tensor, top_k: int, filled: Tensor | None, end: Tensor
) -> tuple[Tensor, Tensor]:
    """(codes uint8 (R, D'), scales uint8 (R, D' / 32)), D' the width padded to a multiple of 32."""
    chosen = path(x.device, x.dtype, x.shape[1])
    dispatch.note_fallback(chosen, x.device)
    if chosen.fused:
        return _triton_gather_mx(x, assignment, top_k, filled, end)
    return reference_gather_mx(x, assignment, top_k, filled, end)


@gather_rows_mx_op.register_fake
def _(x, assignment, top_k, filled, end):
    width = -(-x.shape[1] // BLOCK) * BLOCK
    rows = assignment.shape[0]
    return x.new_empty(rows, width, dtype=torch.uint8), x.new_empty(rows, width // BLOCK, dtype=torch.uint8)


def gather_rows_mx(
    x_TD: Tensor, assignment_R: Tensor, top_k: int, filled_R: Tensor | None, end_1: Tensor
) -> tuple[Tensor, Tensor]:
    """(codes float8_e4m3fn (R, D'), scales float8_e8m0fnu (R, D' / 32)) of the gathered rows, zero
    rows where not ``filled_R`` and from ``end_1`` on: one op (docs/kernels.md)."""
    codes, scales = gather_rows_mx_op(x_TD, assignment_R, top_k, filled_R, end_1)
    return codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)
