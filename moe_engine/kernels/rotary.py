"""Rotary position embedding (rotate-half convention) as one op forward and one op backward.
More: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import as_bits, load_f32, on_device, round_f32, store_f32

_TABLE_DTYPES = (torch.float32, torch.bfloat16)
TILE_ELEMENTS = 2048
"""Half-rows of one program's tile (a (B, H, S) row each, several to a tile)."""


# --- the reference: the eager composition --------------------------------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _rotate_half_transposed(t: Tensor) -> Tensor:
    first, second = t.chunk(2, dim=-1)
    return torch.cat([second, -first], dim=-1)


def reference_forward(x: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    cos, sin = cos_SD.to(x.dtype), sin_SD.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def reference_backward(grad_y: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    cos, sin = cos_SD.to(grad_y.dtype), sin_SD.to(grad_y.dtype)
    return grad_y * cos + _rotate_half_transposed(grad_y * sin)


# --- the Triton kernel ---------------------------------------------------------------------------------


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    n_rows,
    heads,
    seq,
    half,
    x_stride_b,
    x_stride_h,
    x_stride_s,
    y_stride_b,
    y_stride_h,
    y_stride_s,
    table_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
    TABLE_BF16: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # Row r of the tile is (batch, head, position) of x's (B, H, S) leading dims; columns are the half-dim.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < half)
    position = rows % seq
    batch_head = rows // seq
    batch, head = batch_head // heads, batch_head % heads
    x_at = (batch * x_stride_b + head * x_stride_h + position * x_stride_s)[:, None] + cols
    y_at = (batch * y_stride_b + head * y_stride_h + position * y_stride_s)[:, None] + cols
    t_at = (position * table_stride)[:, None] + cols
    x1 = load_f32(x_ptr, x_at, mask, BF16)
    x2 = load_f32(x_ptr, x_at + half, mask, BF16)
    cos1 = round_f32(load_f32(cos_ptr, t_at, mask, TABLE_BF16), BF16)
    cos2 = round_f32(load_f32(cos_ptr, t_at + half, mask, TABLE_BF16), BF16)
    sin1 = round_f32(load_f32(sin_ptr, t_at, mask, TABLE_BF16), BF16)
    sin2 = round_f32(load_f32(sin_ptr, t_at + half, mask, TABLE_BF16), BF16)
    if BACKWARD:
        y1 = round_f32(x1 * cos1, BF16) + round_f32(x2 * sin2, BF16)
        y2 = round_f32(x2 * cos2, BF16) - round_f32(x1 * sin1, BF16)
    else:
        y1 = round_f32(x1 * cos1, BF16) - round_f32(x2 * sin1, BF16)
        y2 = round_f32(x2 * cos2, BF16) + round_f32(x1 * sin2, BF16)
    store_f32(y_ptr, y_at, y1, mask, BF16)
    store_f32(y_ptr, y_at + half, y2, mask, BF16)


def path(device: torch.device | str, dtype: torch.dtype, ndim: int = 4, table_dtype: torch.dtype = torch.float32):
    """``dispatch.KernelPath`` of RoPE for ``ndim``-dim inputs of ``dtype`` and tables of ``table_dtype``."""
    limit = None
    if ndim != 4:
        limit = f"the kernel takes (B, H, S, d) inputs, not {ndim}-dim ones"
    elif table_dtype not in _TABLE_DTYPES:
        limit = f"the kernel takes float32 or bfloat16 tables, not {table_dtype}"
    return dispatch.choose("rope", device, dtype, _rope_kernel, limit)


def _triton_rotate(x: Tensor, cos_SD: Tensor, sin_SD: Tensor, backward: bool) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)
    batch, heads, seq, head_dim = x.shape
    rows = batch * heads * seq
    if rows and head_dim:
        cos_SD, sin_SD = cos_SD.contiguous(), sin_SD.contiguous()
        half = head_dim // 2
        block = triton.next_power_of_2(half)
        block_rows = max(1, min(triton.next_power_of_2(rows), TILE_ELEMENTS // block))
        with on_device(x):
            _rope_kernel[(triton.cdiv(rows, block_rows),)](
                as_bits(x),
                as_bits(cos_SD),
                as_bits(sin_SD),
                as_bits(y),
                rows,
                heads,
                seq,
                half,
                x.stride(0),
                x.stride(1),
                x.stride(2),
                y.stride(0),
                y.stride(1),
                y.stride(2),
                cos_SD.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK=block,
                BF16=x.dtype == torch.bfloat16,
                TABLE_BF16=cos_SD.dtype == torch.bfloat16,
                BACKWARD=backward,
            )
    return y


def _chosen(x: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> dispatch.KernelPath:
    table_dtype = cos_SD.dtype if cos_SD.dtype == sin_SD.dtype else torch.float64
    chosen = path(x.device, x.dtype, x.ndim, table_dtype)
    dispatch.note_fallback(chosen, x.device)
    return chosen


# --- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::rope", mutates_args=())
def rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, d) rotated by the (S, d) tables."""
    if _chosen(x, cos, sin).fused:
        return _triton_rotate(x, cos, sin, backward=False)
    return reference_forward(x, cos, sin)


@rope_op.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


@torch.library.custom_op("moe_engine::rope_backward", mutates_args=())
def rope_backward_op(grad_y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    if _chosen(grad_y, cos, sin).fused:
        return _triton_rotate(grad_y, cos, sin, backward=True)
    return reference_backward(grad_y, cos, sin)


@rope_backward_op.register_fake
def _(grad_y, cos, sin):
    return torch.empty_like(grad_y)


def _setup(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad_y):
    cos, sin = ctx.saved_tensors
    return rope_backward_op(grad_y, cos, sin), None, None


rope_op.register_autograd(_backward, setup_context=_setup)


def rope(x: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate x (B, H, S, d) by the first S rows of the (max_len, d) cos/sin tables, one op forward and
    one backward."""
    seq = x.shape[-2]
    if cos_SD.shape[0] < seq:
        raise ValueError(f"the RoPE tables hold {cos_SD.shape[0]} positions, the input {seq}")
    return rope_op(x, cos_SD[:seq], sin_SD[:seq])
