"""The SwiGLU activation a = silu(gate) * up as one op forward and one op backward.
More: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import as_bits, load_f32, on_device, round_f32, store_f32

BLOCK_COLS = 1024
"""Most columns of one program's tile (wider rows take several programs)."""
TILE_ELEMENTS = 4096
"""Elements of one program's tile: narrower rows go several to a tile."""


# --- the reference: the eager composition --------------------------------------------------------------


def reference_forward(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def reference_backward(gate: Tensor, up: Tensor, grad_a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(a, grad_gate, grad_up), each rounded where the eager ops round."""
    silu = F.silu(gate)
    grad_gate = torch.ops.aten.silu_backward(grad_a * up, gate)
    return silu * up, grad_gate, grad_a * silu


# --- the Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _tile(n_rows, width, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """(rows as an int64 column, columns as a row, mask) of this program's tile."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _forward_kernel(
    gate_ptr,
    up_ptr,
    a_ptr,
    n_rows,
    width,
    gate_stride,
    up_stride,
    a_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BF16: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, width, BLOCK_ROWS, BLOCK_COLS)
    gate = load_f32(gate_ptr, rows * gate_stride + cols, mask, BF16)
    up = load_f32(up_ptr, rows * up_stride + cols, mask, BF16)
    silu = round_f32(gate * tl.sigmoid(gate), BF16)
    store_f32(a_ptr, rows * a_stride + cols, silu * up, mask, BF16)


@triton.jit
def _backward_kernel(
    gate_ptr,
    up_ptr,
    grad_a_ptr,
    grad_gate_ptr,
    grad_up_ptr,
    a_ptr,
    n_rows,
    width,
    gate_stride,
    up_stride,
    grad_a_stride,
    grad_gate_stride,
    grad_up_stride,
    a_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BF16: tl.constexpr,
    STORE_A: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, width, BLOCK_ROWS, BLOCK_COLS)
    gate = load_f32(gate_ptr, rows * gate_stride + cols, mask, BF16)
    up = load_f32(up_ptr, rows * up_stride + cols, mask, BF16)
    grad_a = load_f32(grad_a_ptr, rows * grad_a_stride + cols, mask, BF16)
    sigma = tl.sigmoid(gate)
    silu = round_f32(gate * sigma, BF16)
    store_f32(grad_up_ptr, rows * grad_up_stride + cols, grad_a * silu, mask, BF16)
    grad_silu = round_f32(grad_a * up, BF16)
    grad_gate = grad_silu * sigma * (1.0 + gate * (1.0 - sigma))
    store_f32(grad_gate_ptr, rows * grad_gate_stride + cols, grad_gate, mask, BF16)
    if STORE_A:
        store_f32(a_ptr, rows * a_stride + cols, silu * up, mask, BF16)


def path(device: torch.device | str, dtype: torch.dtype, *other_dtypes: torch.dtype) -> dispatch.KernelPath:
    """``dispatch.KernelPath`` of SwiGLU for gate of ``dtype`` (up and the gradient in ``other_dtypes``)."""
    limit = None
    if any(other != dtype for other in other_dtypes):
        names = ", ".join(str(d).removeprefix("torch.") for d in (dtype, *other_dtypes))
        limit = f"the kernel takes one dtype for all inputs, not {names}"
    return dispatch.choose("swiglu", device, dtype, _forward_kernel, limit)


def _chosen(gate: Tensor, *others: Tensor) -> dispatch.KernelPath:
    chosen = path(gate.device, gate.dtype, *(t.dtype for t in others))
    dispatch.note_fallback(chosen, gate.device)
    return chosen


def _rows(t: Tensor) -> Tensor:
    """t as (rows, width) with a contiguous last dim, a view where the strides allow."""
    t = t.reshape(-1, t.shape[-1]) if t.ndim != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(rows: int, width: int) -> tuple[tuple[int, int], int, int]:
    """(grid, rows per tile, columns per tile): tiles of about TILE_ELEMENTS, narrow rows several to a tile."""
    block_cols = min(BLOCK_COLS, triton.next_power_of_2(max(width, 1)))
    block_rows = max(1, min(triton.next_power_of_2(rows), TILE_ELEMENTS // block_cols))
    return (triton.cdiv(rows, block_rows), triton.cdiv(width, block_cols)), block_rows, block_cols


def _triton_forward(gate: Tensor, up: Tensor) -> Tensor:
    gate_NF, up_NF = _rows(gate), _rows(up)
    a_NF = torch.empty(gate_NF.shape, dtype=gate.dtype, device=gate.device)
    rows, width = gate_NF.shape
    if rows and width:
        grid, block_rows, block_cols = _grid(rows, width)
        with on_device(gate_NF):
            _forward_kernel[grid](
                as_bits(gate_NF),
                as_bits(up_NF),
                as_bits(a_NF),
                rows,
                width,
                gate_NF.stride(0),
                up_NF.stride(0),
                a_NF.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK_COLS=block_cols,
                BF16=gate.dtype == torch.bfloat16,
            )
    return a_NF.view(gate.shape)


def _triton_backward(gate: Tensor, up: Tensor, grad_a: Tensor, grad_gate: Tensor, grad_up: Tensor, a: Tensor | None):
    """Writes grad_gate, grad_up (and a) in place: (rows, width) tensors, last dim contiguous."""
    rows, width = gate.shape
    if not (rows and width):
        return
    grid, block_rows, block_cols = _grid(rows, width)
    out_a = a if a is not None else grad_up
    with on_device(gate):
        _backward_kernel[grid](
            as_bits(gate),
            as_bits(up),
            as_bits(grad_a),
            as_bits(grad_gate),
            as_bits(grad_up),
            as_bits(out_a),
            rows,
            width,
            gate.stride(0),
            up.stride(0),
            grad_a.stride(0),
            grad_gate.stride(0),
            grad_up.stride(0),
            out_a.stride(0),
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            BF16=gate.dtype == torch.bfloat16,
            STORE_A=a is not None,
        )


# --- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    if _chosen(gate, up).fused:
        return _triton_forward(gate, up)
    return reference_forward(gate, up)


@swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("moe_engine::swiglu_backward", mutates_args=())
def swiglu_backward_op(gate: Tensor, up: Tensor, grad_a: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_gate, grad_up)."""
    if _chosen(gate, up, grad_a).fused:
        gate_NF, up_NF, grad_a_NF = _rows(gate), _rows(up), _rows(grad_a)
        grad_gate_NF, grad_up_NF = torch.empty_like(gate_NF), torch.empty_like(up_NF)
        _triton_backward(gate_NF, up_NF, grad_a_NF, grad_gate_NF, grad_up_NF, None)
        return grad_gate_NF.view(gate.shape), grad_up_NF.view(up.shape)
    _, grad_gate, grad_up = reference_backward(gate, up, grad_a)
    return grad_gate, grad_up


@swiglu_backward_op.register_fake
def _(gate, up, grad_a):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_swiglu(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_swiglu(ctx, grad_a):
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(gate, up, grad_a)


swiglu_op.register_autograd(_backward_swiglu, setup_context=_setup_swiglu)


@torch.library.custom_op("moe_engine::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward_op(h: Tensor, grad_a: Tensor) -> tuple[Tensor, Tensor]:
    """(a, grad_h) for h = [gate | up] of shape (..., 2F) and grad_a (..., F)."""
    h_NH = h.reshape(-1, h.shape[-1])
    gate_NF, up_NF = h_NH.chunk(2, dim=-1)
    grad_h_NH = torch.empty(h_NH.shape, dtype=h.dtype, device=h.device)
    grad_gate_NF, grad_up_NF = grad_h_NH.chunk(2, dim=-1)
    grad_a_NF = _rows(grad_a)
    if _chosen(gate_NF, grad_a).fused:
        a_NF = torch.empty(gate_NF.shape, dtype=h.dtype, device=h.device)
        _triton_backward(gate_NF, up_NF, grad_a_NF, grad_gate_NF, grad_up_NF, a_NF)
    else:
        # Each half of d/dh written in place, no concatenation.
        silu_NF = F.silu(gate_NF)
        torch.mul(grad_a_NF, silu_NF, out=grad_up_NF)
        grad_gate_NF.copy_(torch.ops.aten.silu_backward(grad_a_NF * up_NF, gate_NF))
        a_NF = silu_NF.mul_(up_NF)
    return a_NF.view(*h.shape[:-1], -1), grad_h_NH.view(h.shape)


@swiglu_packed_backward_op.register_fake
def _(h, grad_a):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2)), h.new_empty(h.shape)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, one op forward and one backward, saving only gate and up."""
    return swiglu_op(gate, up)


def swiglu_packed(h: Tensor) -> Tensor:
    """silu(gate) * up for h = [gate | up] (no autograd: for hand-written backwards)."""
    gate, up = h.chunk(2, dim=-1)
    return swiglu_op(gate, up)


def swiglu_packed_backward(h: Tensor, grad_a: Tensor) -> tuple[Tensor, Tensor]:
    """(a, d/dh) of ``swiglu_packed`` for the gradient ``grad_a`` of a, one op."""
    return swiglu_packed_backward_op(h, grad_a)
