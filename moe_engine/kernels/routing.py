"""The MoE dispatch gather and the weighted combine (``moe.permute``) as one op forward and one op backward.
What each kernel computes and saves, and its rounding against the eager composition:
docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import as_bits, load_f32, on_device, round_f32, store_f32, warps_for

BLOCK_COLS = 1024
"""Most columns of one program's tile (wider rows take several programs, or several steps)."""
TILE_ELEMENTS = 4096
"""Elements of one program's tile: narrow rows go several to a tile."""


# --- the reference: the eager composition (``moe.permute`` before the fused ops) --------------------------


def _zero_where_not(mask: Tensor | None, rows: Tensor) -> Tensor:
    # A fill, not a multiply: masked rows may hold garbage (NaN) that must not leak.
    if mask is None:
        return rows
    return rows.masked_fill_(~mask.view(-1, *([1] * (rows.dim() - 1))), 0)


def reference_gather(x_TD: Tensor, assignment_R: Tensor, top_k: int, filled_R: Tensor | None) -> Tensor:
    token_R = assignment_R if top_k == 1 else torch.div(assignment_R, top_k, rounding_mode="floor")
    return _zero_where_not(filled_R, x_TD.index_select(0, token_R))


def reference_gather_backward(grad_RD: Tensor, row_N: Tensor, top_k: int, kept_N: Tensor | None) -> Tensor:
    grad_ND = _zero_where_not(kept_N, grad_RD.index_select(0, row_N))
    if top_k == 1:
        return grad_ND
    return grad_ND.view(-1, top_k, grad_ND.shape[-1]).sum(dim=1)


def reference_combine(y_RD: Tensor, weight_TK: Tensor, row_N: Tensor, kept_N: Tensor | None) -> Tensor:
    num_tokens, top_k = weight_TK.shape
    y_TKD = _zero_where_not(kept_N, y_RD.index_select(0, row_N)).view(num_tokens, top_k, -1)
    return torch.bmm(weight_TK.to(y_RD.dtype).unsqueeze(1), y_TKD).squeeze(1)


def reference_combine_backward(
    grad_TD: Tensor,
    y_RD: Tensor,
    weight_TK: Tensor,
    row_N: Tensor,
    assignment_R: Tensor,
    kept_N: Tensor | None,
    filled_R: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(grad_y_RD, grad_weight_TK)."""
    num_tokens, top_k = weight_TK.shape
    y_TKD = _zero_where_not(kept_N, y_RD.index_select(0, row_N)).view(num_tokens, top_k, -1)
    w_T1K = weight_TK.to(y_RD.dtype).unsqueeze(1)
    grad_T1D = grad_TD.contiguous().unsqueeze(1)
    # Dropped rows of y_TKD are zero, so dropped weights get no gradient.
    grad_weight_TK = torch.bmm(grad_T1D, y_TKD.transpose(1, 2)).squeeze(1).to(weight_TK.dtype)
    grad_y_ND = torch.bmm(w_T1K.transpose(1, 2), grad_T1D).view(-1, grad_TD.shape[-1])
    return _zero_where_not(filled_R, grad_y_ND.index_select(0, assignment_R)), grad_weight_TK


# --- the Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _gather_kernel(
    x_ptr,
    assignment_ptr,
    filled_ptr,
    out_ptr,
    n_rows,
    width,
    top_k,
    x_stride,
    out_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BF16: tl.constexpr,
    FILLED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    live = rows < n_rows
    in_row = (cols < width)[None, :]
    source = tl.load(assignment_ptr + rows, mask=live, other=0) // top_k
    take = live
    if FILLED:
        take = take & (tl.load(filled_ptr + rows, mask=live, other=0) != 0)
    x = load_f32(x_ptr, source.to(tl.int64)[:, None] * x_stride + cols[None, :], take[:, None] & in_row, BF16)
    store_f32(out_ptr, rows.to(tl.int64)[:, None] * out_stride + cols[None, :], x, live[:, None] & in_row, BF16)


@triton.jit
def _sum_copies_kernel(
    grad_ptr,
    row_ptr,
    kept_ptr,
    out_ptr,
    n_tokens,
    width,
    top_k,
    grad_stride,
    out_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BF16: tl.constexpr,
    KEPT: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    live = tokens < n_tokens
    in_row = (cols < width)[None, :]
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for j in range(top_k):
        n = tokens.to(tl.int64) * top_k + j
        row = tl.load(row_ptr + n, mask=live, other=0)
        take = live
        if KEPT:
            take = take & (tl.load(kept_ptr + n, mask=live, other=0) != 0)
        acc += load_f32(grad_ptr, row[:, None] * grad_stride + cols[None, :], take[:, None] & in_row, BF16)
    store_f32(out_ptr, tokens.to(tl.int64)[:, None] * out_stride + cols[None, :], acc, live[:, None] & in_row, BF16)


@triton.jit
def _combine_kernel(
    y_ptr,
    weight_ptr,
    row_ptr,
    kept_ptr,
    out_ptr,
    n_tokens,
    width,
    top_k,
    y_stride,
    out_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BF16: tl.constexpr,
    W_BF16: tl.constexpr,
    KEPT: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    live = tokens < n_tokens
    in_row = (cols < width)[None, :]
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for j in range(top_k):
        n = tokens.to(tl.int64) * top_k + j
        w = round_f32(load_f32(weight_ptr, n, live, W_BF16), BF16)
        row = tl.load(row_ptr + n, mask=live, other=0)
        take = live
        if KEPT:
            take = take & (tl.load(kept_ptr + n, mask=live, other=0) != 0)
        y = load_f32(y_ptr, row[:, None] * y_stride + cols[None, :], take[:, None] & in_row, BF16)
        acc += w[:, None] * y
    store_f32(out_ptr, tokens.to(tl.int64)[:, None] * out_stride + cols[None, :], acc, live[:, None] & in_row, BF16)


@triton.jit
def _combine_backward_kernel(
    grad_ptr,
    y_ptr,
    weight_ptr,
    row_ptr,
    kept_ptr,
    filled_ptr,
    grad_y_ptr,
    grad_weight_ptr,
    n_tokens,
    n_rows,
    width,
    top_k,
    token_programs,
    grad_stride,
    y_stride,
    grad_y_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16: tl.constexpr,
    W_BF16: tl.constexpr,
    KEPT: tl.constexpr,
    FILLED: tl.constexpr,
):
    # The first token_programs programs walk tokens; the rest zero the empty rows of grad_y.
    pid = tl.program_id(0)
    if pid < token_programs:
        tokens = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = tokens < n_tokens
        slots = tl.arange(0, BLOCK_K)
        grad_weight = tl.zeros([BLOCK_ROWS, BLOCK_K], dtype=tl.float32)
        for start in range(0, width, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            in_row = (cols < width)[None, :]
            grad = load_f32(
                grad_ptr, tokens.to(tl.int64)[:, None] * grad_stride + cols[None, :], live[:, None] & in_row, BF16
            )
            for j in range(top_k):
                n = tokens.to(tl.int64) * top_k + j
                row = tl.load(row_ptr + n, mask=live, other=0)
                take = live
                if KEPT:
                    take = take & (tl.load(kept_ptr + n, mask=live, other=0) != 0)
                offsets = row[:, None] * y_stride + cols[None, :]
                y = load_f32(y_ptr, offsets, take[:, None] & in_row, BF16)
                grad_weight += tl.where(slots[None, :] == j, tl.sum(grad * y, axis=1)[:, None], 0.0)
                w = round_f32(load_f32(weight_ptr, n, live, W_BF16), BF16)
                store_f32(
                    grad_y_ptr,
                    row[:, None] * grad_y_stride + cols[None, :],
                    w[:, None] * grad,
                    take[:, None] & in_row,
                    BF16,
                )
        # bmm stores the sum in y's dtype, then .to() the weight's.
        offsets_TK = tokens.to(tl.int64)[:, None] * top_k + slots[None, :]
        store_f32(
            grad_weight_ptr, offsets_TK, round_f32(grad_weight, BF16), live[:, None] & (slots < top_k)[None, :], W_BF16
        )
    else:
        if FILLED:
            rows = (pid - token_programs) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            live = rows < n_rows
            empty = live & (tl.load(filled_ptr + rows, mask=live, other=1) == 0)
            zeros = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, width, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                store_f32(
                    grad_y_ptr,
                    rows.to(tl.int64)[:, None] * grad_y_stride + cols[None, :],
                    zeros,
                    empty[:, None] & (cols < width)[None, :],
                    BF16,
                )


def path(
    device: torch.device | str,
    dtype: torch.dtype,
    *other_dtypes: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    op: str = "gather_rows",
) -> dispatch.KernelPath:
    """``dispatch.KernelPath`` of ``op`` (``gather_rows`` or ``combine_rows``) for rows of ``dtype``
    (the gradient's in ``other_dtypes``), and the combine's weights in ``weight_dtype`` (fp32 or bf16,
    either with either row dtype)."""
    limit = None
    if any(other != dtype for other in other_dtypes):
        names = ", ".join(str(d).removeprefix("torch.") for d in (dtype, *other_dtypes))
        limit = f"the kernel takes one dtype for all rows, not {names}"
    elif weight_dtype is not None and weight_dtype not in dispatch.TRITON_DTYPES:
        limit = f"the kernel takes float32 or bfloat16 weights, not {str(weight_dtype).removeprefix('torch.')}"
    kernel = _gather_kernel if op == "gather_rows" else _combine_kernel
    return dispatch.choose(op, device, dtype, kernel, limit)


def _chosen(op: str, rows: Tensor, *others: Tensor, weight: Tensor | None = None) -> dispatch.KernelPath:
    chosen = path(
        rows.device,
        rows.dtype,
        *(t.dtype for t in others),
        weight_dtype=None if weight is None else weight.dtype,
        op=op,
    )
    dispatch.note_fallback(chosen, rows.device)
    return chosen


def _rows(t: Tensor) -> Tensor:
    """t as (rows, width) with a contiguous last dim (a view where the strides allow)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _tile(rows: int, width: int) -> tuple[int, int]:
    """(rows, columns) of a tile of about TILE_ELEMENTS, narrow rows several to a tile."""
    block_cols = min(BLOCK_COLS, triton.next_power_of_2(max(width, 1)))
    return max(1, min(triton.next_power_of_2(max(rows, 1)), TILE_ELEMENTS // block_cols)), block_cols


def _mask(mask: Tensor | None, fallback: Tensor) -> Tensor:
    """A bool mask as the kernel reads it (bytes), or any tensor where the kernel ignores it."""
    return fallback if mask is None else mask.contiguous().view(torch.uint8)


def _triton_gather(x_TD: Tensor, assignment_R: Tensor, top_k: int, filled_R: Tensor | None) -> Tensor:
    x_TD = _rows(x_TD)
    rows, width = assignment_R.numel(), x_TD.shape[1]
    out_RD = torch.empty(rows, width, dtype=x_TD.dtype, device=x_TD.device)
    if rows and width:
        block_rows, block_cols = _tile(rows, width)
        grid = (triton.cdiv(rows, block_rows), triton.cdiv(width, block_cols))
        assignment_R = assignment_R.contiguous()
        with on_device(x_TD):
            _gather_kernel[grid](
                as_bits(x_TD),
                assignment_R,
                _mask(filled_R, assignment_R),
                as_bits(out_RD),
                rows,
                width,
                top_k,
                x_TD.stride(0),
                out_RD.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK_COLS=block_cols,
                BF16=x_TD.dtype == torch.bfloat16,
                FILLED=filled_R is not None,
                num_warps=warps_for(block_rows * block_cols),
            )
    return out_RD


def _triton_sum_copies(grad_RD: Tensor, row_N: Tensor, top_k: int, kept_N: Tensor | None) -> Tensor:
    grad_RD = _rows(grad_RD)
    tokens, width = row_N.numel() // top_k, grad_RD.shape[1]
    out_TD = torch.empty(tokens, width, dtype=grad_RD.dtype, device=grad_RD.device)
    if tokens and width:
        block_rows, block_cols = _tile(tokens, width)
        grid = (triton.cdiv(tokens, block_rows), triton.cdiv(width, block_cols))
        row_N = row_N.contiguous()
        with on_device(grad_RD):
            _sum_copies_kernel[grid](
                as_bits(grad_RD),
                row_N,
                _mask(kept_N, row_N),
                as_bits(out_TD),
                tokens,
                width,
                top_k,
                grad_RD.stride(0),
                out_TD.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK_COLS=block_cols,
                BF16=grad_RD.dtype == torch.bfloat16,
                KEPT=kept_N is not None,
                num_warps=warps_for(block_rows * block_cols),
            )
    return out_TD


def _triton_combine(y_RD: Tensor, weight_TK: Tensor, row_N: Tensor, kept_N: Tensor | None) -> Tensor:
    y_RD, weight_TK = _rows(y_RD), weight_TK.contiguous()
    (tokens, top_k), width = weight_TK.shape, y_RD.shape[1]
    out_TD = torch.empty(tokens, width, dtype=y_RD.dtype, device=y_RD.device)
    if tokens and width:
        block_rows, block_cols = _tile(tokens, width)
        grid = (triton.cdiv(tokens, block_rows), triton.cdiv(width, block_cols))
        row_N = row_N.contiguous()
        with on_device(y_RD):
            _combine_kernel[grid](
                as_bits(y_RD),
                as_bits(weight_TK),
                row_N,
                _mask(kept_N, row_N),
                as_bits(out_TD),
                tokens,
                width,
                top_k,
                y_RD.stride(0),
                out_TD.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK_COLS=block_cols,
                BF16=y_RD.dtype == torch.bfloat16,
                W_BF16=weight_TK.dtype == torch.bfloat16,
                KEPT=kept_N is not None,
                num_warps=warps_for(block_rows * block_cols),
            )
    return out_TD


def _triton_combine_backward(
    grad_TD: Tensor, y_RD: Tensor, weight_TK: Tensor, row_N: Tensor, kept_N: Tensor | None, filled_R: Tensor | None
) -> tuple[Tensor, Tensor]:
    grad_TD, y_RD, weight_TK = _rows(grad_TD), _rows(y_RD), weight_TK.contiguous()
    (tokens, top_k), (rows, width) = weight_TK.shape, y_RD.shape
    grad_y_RD = torch.empty(rows, width, dtype=y_RD.dtype, device=y_RD.device)
    grad_weight_TK = torch.empty_like(weight_TK)
    if not width:
        return grad_y_RD, grad_weight_TK.zero_()
    block_rows, block_cols = _tile(max(tokens, rows), width)
    token_programs = triton.cdiv(tokens, block_rows)
    zero_programs = triton.cdiv(rows, block_rows) if filled_R is not None else 0
    if token_programs + zero_programs:
        row_N = row_N.contiguous()
        with on_device(y_RD):
            _combine_backward_kernel[(token_programs + zero_programs,)](
                as_bits(grad_TD),
                as_bits(y_RD),
                as_bits(weight_TK),
                row_N,
                _mask(kept_N, row_N),
                _mask(filled_R, row_N),
                as_bits(grad_y_RD),
                as_bits(grad_weight_TK),
                tokens,
                rows,
                width,
                top_k,
                token_programs,
                grad_TD.stride(0),
                y_RD.stride(0),
                grad_y_RD.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK_COLS=block_cols,
                BLOCK_K=triton.next_power_of_2(top_k),
                BF16=y_RD.dtype == torch.bfloat16,
                W_BF16=weight_TK.dtype == torch.bfloat16,
                KEPT=kept_N is not None,
                FILLED=filled_R is not None,
                num_warps=warps_for(block_rows * block_cols),
            )
    return grad_y_RD, grad_weight_TK


# --- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::gather_rows", mutates_args=())
def gather_rows_op(
    x: Tensor, assignment: Tensor, row: Tensor, top_k: int, filled: Tensor | None, kept: Tensor | None
) -> Tensor:
    """rows_RD; ``row`` and ``kept`` are the backward's (the map the other way)."""
    if _chosen("gather_rows", x).fused:
        return _triton_gather(x, assignment, top_k, filled)
    return reference_gather(x, assignment, top_k, filled)


@gather_rows_op.register_fake
def _(x, assignment, row, top_k, filled, kept):
    return x.new_empty(assignment.shape[0], x.shape[1])


@torch.library.custom_op("moe_engine::gather_rows_backward", mutates_args=())
def gather_rows_backward_op(grad: Tensor, row: Tensor, top_k: int, kept: Tensor | None) -> Tensor:
    """grad_x_TD: each token's kept rows of ``grad`` summed."""
    if _chosen("gather_rows", grad).fused:
        return _triton_sum_copies(grad, row, top_k, kept)
    return reference_gather_backward(grad, row, top_k, kept)


@gather_rows_backward_op.register_fake
def _(grad, row, top_k, kept):
    return grad.new_empty(row.shape[0] // top_k, grad.shape[1])


def _setup_gather_rows(ctx, inputs, output):
    _, _, row, top_k, _, kept = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(row, kept)


def _backward_gather_rows(ctx, grad):
    row, kept = ctx.saved_tensors
    return gather_rows_backward_op(grad, row, ctx.top_k, kept), None, None, None, None, None


gather_rows_op.register_autograd(_backward_gather_rows, setup_context=_setup_gather_rows)


@torch.library.custom_op("moe_engine::combine_rows", mutates_args=())
def combine_rows_op(
    y: Tensor, weight: Tensor, row: Tensor, assignment: Tensor, kept: Tensor | None, filled: Tensor | None
) -> Tensor:
    """y_TD in y's dtype; ``assignment`` and ``filled`` are the backward's."""
    if _chosen("combine_rows", y, weight=weight).fused:
        return _triton_combine(y, weight, row, kept)
    return reference_combine(y, weight, row, kept)


@combine_rows_op.register_fake
def _(y, weight, row, assignment, kept, filled):
    return y.new_empty(weight.shape[0], y.shape[1])


@torch.library.custom_op("moe_engine::combine_rows_backward", mutates_args=())
def combine_rows_backward_op(
    grad: Tensor,
    y: Tensor,
    weight: Tensor,
    row: Tensor,
    assignment: Tensor,
    kept: Tensor | None,
    filled: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(grad_y_RD, grad_weight_TK)."""
    if _chosen("combine_rows", y, grad, weight=weight).fused:
        return _triton_combine_backward(grad, y, weight, row, kept, filled)
    return reference_combine_backward(grad, y, weight, row, assignment, kept, filled)


@combine_rows_backward_op.register_fake
def _(grad, y, weight, row, assignment, kept, filled):
    return y.new_empty(y.shape), weight.new_empty(weight.shape)


def _setup_combine_rows(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_combine_rows(ctx, grad):
    y, weight, row, assignment, kept, filled = ctx.saved_tensors
    grad_y, grad_weight = combine_rows_backward_op(grad, y, weight, row, assignment, kept, filled)
    return (
        grad_y if ctx.needs_input_grad[0] else None,
        grad_weight if ctx.needs_input_grad[1] else None,
        None,
        None,
        None,
        None,
    )


combine_rows_op.register_autograd(_backward_combine_rows, setup_context=_setup_combine_rows)


def gather_rows(
    x_TD: Tensor,
    assignment_R: Tensor,
    row_N: Tensor,
    top_k: int,
    filled_R: Tensor | None = None,
    kept_N: Tensor | None = None,
) -> Tensor:
    """rows_RD[r] = x_TD[assignment_R[r] // top_k] (zero where not ``filled_R``), one op forward and one
    backward (each token's kept rows, found by ``row_N``, summed)."""
    return gather_rows_op(x_TD, assignment_R, row_N, top_k, filled_R, kept_N)


def combine_rows(
    y_RD: Tensor,
    weight_TK: Tensor,
    row_N: Tensor,
    assignment_R: Tensor,
    kept_N: Tensor | None = None,
    filled_R: Tensor | None = None,
) -> Tensor:
    """y_TD[t] = sum_j weight_TK[t, j] * y_RD[row_N[t*k + j]] over the kept assignments, in y's dtype,
    one op forward and one backward, saving no gathered copy of the rows."""
    return combine_rows_op(y_RD, weight_TK, row_N, assignment_R, kept_N, filled_R)


def gather_rows_backward(grad_RD: Tensor, row_N: Tensor, top_k: int, kept_N: Tensor | None = None) -> Tensor:
    """grad_x_TD[t] = sum_j grad_RD[row_N[t*k + j]] over the kept assignments: the gather's backward,
    for callers that gather by other means (``gather_mx``)."""
    return gather_rows_backward_op(grad_RD, row_N, top_k, kept_N)
