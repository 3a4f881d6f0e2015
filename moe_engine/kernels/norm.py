"""RMSNorm, alone or after the residual add, as one op forward and one op backward.
More: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import as_bits, load_f32, on_device, programs_for, round_f32, store_f32, warps_for

MAX_WIDTH = 8192
"""Widest row the kernels take; wider rows run the reference. A program keeps a whole row in
registers: compiled for sm_90a, the backward spills from 16,384 (``bench.validate.kernel_compile``),
and the models' widths (d_model, head_dim) stay within 8,192."""
TILE_ELEMENTS = 4096
"""Elements of one program step: rows narrower than this go several to a step."""


# --- the reference: the eager composition --------------------------------------------------------------


def reference_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd) by ``modules.norm.RMSNorm``'s formula; rstd has x's shape without the last dim."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd.squeeze(-1)


def reference_backward(
    grad_y: Tensor, grad_h: Tensor | None, x: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight) of ``reference_forward``, plus ``grad_h`` (the gradient reaching the
    norm's input directly, after a fused add) when given."""
    x32, rstd = x.float(), rstd.unsqueeze(-1)
    xhat = x32 * rstd
    grad_weight = (grad_y * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    g = (grad_y * weight).float()
    grad_x = (rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))).to(x.dtype)
    if grad_h is not None:
        grad_x = grad_x + grad_h
    return grad_x, grad_weight


# --- the Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _forward_kernel(
    x_ptr,
    residual_ptr,
    h_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    n_rows,
    width,
    eps,
    tiles_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    in_row = cols < width
    weight = load_f32(weight_ptr, cols, in_row, BF16)[None, :]
    first = tl.program_id(0) * tiles_per_program * BLOCK_ROWS
    for tile in range(tiles_per_program):
        rows = first + tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        mask = live[:, None] & in_row[None, :]
        offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
        x = load_f32(x_ptr, offsets, mask, BF16)
        if RESIDUAL:
            x = round_f32(load_f32(residual_ptr, offsets, mask, BF16) + x, BF16)
            store_f32(h_ptr, offsets, x, mask, BF16)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / width + eps)
        normed = round_f32(x * rstd[:, None], BF16)
        store_f32(y_ptr, offsets, weight * normed, mask, BF16)
        tl.store(rstd_ptr + rows, rstd, mask=live)


@triton.jit
def _backward_kernel(
    grad_y_ptr,
    grad_h_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    grad_x_ptr,
    grad_weight_partial_ptr,
    n_rows,
    width,
    tiles_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
    GRAD_H: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    in_row = cols < width
    weight = load_f32(weight_ptr, cols, in_row, BF16)[None, :]
    grad_weight = tl.zeros([BLOCK_ROWS, BLOCK], dtype=tl.float32)
    first = tl.program_id(0) * tiles_per_program * BLOCK_ROWS
    for tile in range(tiles_per_program):
        rows = first + tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        mask = live[:, None] & in_row[None, :]
        offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
        grad_y = load_f32(grad_y_ptr, offsets, mask, BF16)
        rstd = tl.load(rstd_ptr + rows, mask=live, other=0.0)[:, None]
        xhat = load_f32(x_ptr, offsets, mask, BF16) * rstd
        grad_weight += grad_y * round_f32(xhat, BF16)
        g = round_f32(grad_y * weight, BF16)
        grad_x = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / width)[:, None])
        if GRAD_H:
            grad_x = round_f32(grad_x, BF16) + load_f32(grad_h_ptr, offsets, mask, BF16)
        store_f32(grad_x_ptr, offsets, grad_x, mask, BF16)
    partial = tl.sum(grad_weight, axis=0)
    tl.store(grad_weight_partial_ptr + tl.program_id(0).to(tl.int64) * width + cols, partial, mask=in_row)


def path(device: torch.device | str, dtype: torch.dtype, width: int = 1, *other_dtypes: torch.dtype):
    """``dispatch.KernelPath`` of RMSNorm (with or without the add) for rows of ``width``, with the
    weight (and residual, gradients) in ``other_dtypes``."""
    limit = None
    if width > MAX_WIDTH:
        limit = f"rows of {width} exceed the kernel's {MAX_WIDTH}"
    elif any(other != dtype for other in other_dtypes):
        names = ", ".join(str(d).removeprefix("torch.") for d in (dtype, *other_dtypes))
        limit = f"the kernel takes one dtype for all inputs, not {names}"
    return dispatch.choose("rms_norm", device, dtype, _forward_kernel, limit)


def _launch_shape(rows: int, block: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, row tiles per program, rows per tile): narrow rows go several to a tile of about
    TILE_ELEMENTS, so that a program step has enough work on a GPU (and the interpreter few steps)."""
    rows_per_tile = max(1, min(triton.next_power_of_2(rows), TILE_ELEMENTS // block))
    tiles = triton.cdiv(rows, rows_per_tile)
    per_program = triton.cdiv(tiles, programs_for(tiles, device))
    return triton.cdiv(tiles, per_program), per_program, rows_per_tile


def _triton_forward(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float):
    width = x.shape[-1]
    x_NW = x.reshape(-1, width).contiguous()
    rows = x_NW.shape[0]
    y_NW = torch.empty_like(x_NW)
    rstd_N = torch.empty(rows, dtype=torch.float32, device=x.device)
    h_NW = torch.empty_like(x_NW) if residual is not None else None
    if rows:
        residual_NW = residual.reshape(-1, width).contiguous() if residual is not None else x_NW
        block = triton.next_power_of_2(width)
        programs, per_program, rows_per_tile = _launch_shape(rows, block, x.device)
        with on_device(x_NW):
            _forward_kernel[(programs,)](
                as_bits(x_NW),
                as_bits(residual_NW),
                as_bits(h_NW if h_NW is not None else y_NW),
                as_bits(weight.contiguous()),
                as_bits(y_NW),
                rstd_N,
                rows,
                width,
                eps,
                per_program,
                BLOCK_ROWS=rows_per_tile,
                BLOCK=block,
                BF16=x.dtype == torch.bfloat16,
                RESIDUAL=residual is not None,
                num_warps=warps_for(rows_per_tile * block),
            )
    h = h_NW.view(x.shape) if h_NW is not None else None
    return h, y_NW.view(x.shape), rstd_N.view(x.shape[:-1])


def _triton_backward(grad_y: Tensor, grad_h: Tensor | None, x: Tensor, weight: Tensor, rstd: Tensor):
    width = x.shape[-1]
    x_NW = x.reshape(-1, width).contiguous()
    rows = x_NW.shape[0]
    grad_x_NW = torch.empty_like(x_NW)
    if not rows:
        return grad_x_NW.view(x.shape), torch.zeros_like(weight)
    grad_y_NW = grad_y.reshape(-1, width).contiguous()
    grad_h_NW = grad_h.reshape(-1, width).contiguous() if grad_h is not None else grad_y_NW
    block = triton.next_power_of_2(width)
    programs, per_program, rows_per_tile = _launch_shape(rows, block, x.device)
    partial_PW = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    with on_device(x_NW):
        _backward_kernel[(programs,)](
            as_bits(grad_y_NW),
            as_bits(grad_h_NW),
            as_bits(x_NW),
            as_bits(weight.contiguous()),
            rstd.reshape(-1).contiguous(),
            as_bits(grad_x_NW),
            partial_PW,
            rows,
            width,
            per_program,
            BLOCK_ROWS=rows_per_tile,
            BLOCK=block,
            BF16=x.dtype == torch.bfloat16,
            GRAD_H=grad_h is not None,
            num_warps=warps_for(rows_per_tile * block),
        )
    return grad_x_NW.view(x.shape), partial_PW.sum(0).to(weight.dtype)


def _chosen(x: Tensor, *others: Tensor | None) -> dispatch.KernelPath:
    chosen = path(x.device, x.dtype, x.shape[-1], *(t.dtype for t in others if t is not None))
    dispatch.note_fallback(chosen, x.device)
    return chosen


# --- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd)."""
    if _chosen(x, weight).fused:
        _, y, rstd = _triton_forward(x, None, weight, eps)
        return y, rstd
    return reference_forward(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(
        x.shape[:-1], dtype=torch.float32
    )


@torch.library.custom_op("moe_engine::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(h = residual + x, y = rms_norm(h), rstd)."""
    if _chosen(x, weight, residual).fused:
        return _triton_forward(x, residual, weight, eps)
    h = residual + x
    y, rstd = reference_forward(h, weight, eps)
    return h, y, rstd


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    y = x.new_empty(x.shape, dtype=torch.promote_types(h.dtype, weight.dtype))
    return h, y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("moe_engine::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    grad_y: Tensor, grad_h: Tensor | None, x: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight); ``x`` is the norm's input (h after a fused add)."""
    if _chosen(x, weight, grad_y, grad_h).fused:
        return _triton_backward(grad_y, grad_h, x, weight, rstd)
    return reference_backward(grad_y, grad_h, x, weight, rstd)


@rms_norm_backward_op.register_fake
def _(grad_y, grad_h, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, rstd)


def _backward_rms_norm(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        return None, None, None
    grad_x, grad_weight = rms_norm_backward_op(grad_y, None, x, weight, rstd)
    return grad_x, grad_weight, None


rms_norm_op.register_autograd(_backward_rms_norm, setup_context=_setup_rms_norm)


def _setup_add_rms_norm(ctx, inputs, output):
    _, _, weight, _ = inputs
    h, _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, weight, rstd)


def _backward_add_rms_norm(ctx, grad_h, grad_y, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        return grad_h, grad_h, None, None
    grad_sum, grad_weight = rms_norm_backward_op(grad_y, grad_h, h, weight, rstd)
    # h = residual + x: both inputs get the whole gradient of h.
    return grad_sum, grad_sum, grad_weight, None


add_rms_norm_op.register_autograd(_backward_add_rms_norm, setup_context=_setup_add_rms_norm)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x's last dim, one op forward and one backward."""
    return rms_norm_op(x, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h)) with h = residual + x, one op forward and one backward."""
    h, y, _ = add_rms_norm_op(x, residual, weight, eps)
    return h, y
