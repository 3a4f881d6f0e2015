"""The router's scores, combine weights and loss statistics as one op forward and one op backward.
What each kernel computes and saves, and its rounding against the eager composition:
docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import on_device, programs_for, warps_for

MAX_EXPERTS = 256
"""Most experts of one row (the whole row sits in one program's registers)."""
TILE_ELEMENTS = 4096
"""Elements of one program step: rows go several to a step."""


# --- the reference: the eager composition --------------------------------------------------------------


def _scores(logits: Tensor, sigmoid: bool) -> tuple[Tensor, Tensor]:
    """(scores, probabilities the balance loss averages), as ``moe.router.Router.forward`` computes them."""
    if sigmoid:
        scores = torch.sigmoid(logits)
        return scores, scores / scores.sum(dim=-1, keepdim=True)
    scores = torch.softmax(logits, dim=-1)
    return scores, scores


def reference_forward(
    logits: Tensor, expert: Tensor, sigmoid: bool, normalize: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(weight_TK, mean_probs_E, lse_T) by the router's eager formulas."""
    scores, probs = _scores(logits, sigmoid)
    weight = scores.gather(1, expert)
    if normalize:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weight = weight * scale
    return weight, probs.mean(dim=0), torch.logsumexp(logits, dim=-1)


def reference_backward(
    grad_weight: Tensor,
    grad_mean_probs: Tensor,
    grad_lse: Tensor,
    logits: Tensor,
    expert: Tensor,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> Tensor:
    """grad_logits (docs/kernels.md's formulas)."""
    softmax = torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits) if sigmoid else softmax
    chosen = scores.gather(1, expert)
    if normalize:
        total = chosen.sum(dim=-1, keepdim=True)
        grad_chosen = (scale / total) * (grad_weight - (grad_weight * chosen).sum(dim=-1, keepdim=True) / total)
    else:
        grad_chosen = grad_weight * scale
    grad_probs = (grad_mean_probs / logits.shape[0]).expand_as(logits)
    if sigmoid:
        score_sum = scores.sum(dim=-1, keepdim=True)
        probs = scores / score_sum
        grad_scores = (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True)) / score_sum
    else:
        grad_scores = grad_probs.clone()
    grad_scores = grad_scores.scatter_add(1, expert, grad_chosen)
    if sigmoid:
        grad_logits = grad_scores * scores * (1.0 - scores)
    else:
        grad_logits = torch.ops.aten._softmax_backward_data(grad_scores, softmax, -1, torch.float32)
    return grad_logits + grad_lse.unsqueeze(-1) * softmax


# --- the Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _row_tile(logits_ptr, rows, live, cols, in_row, n_experts, SIGMOID: tl.constexpr):
    """(softmax, scores, logsumexp) of a tile of rows; padding columns hold -inf logits and 0 scores,
    dead rows 0 logits (so nothing in them is NaN)."""
    offsets = rows.to(tl.int64)[:, None] * n_experts + cols[None, :]
    logits = tl.load(logits_ptr + offsets, mask=live[:, None] & in_row[None, :], other=0.0)
    logits = tl.where(in_row[None, :], logits, float("-inf"))
    row_max = tl.max(logits, axis=1)
    ex = tl.exp(logits - row_max[:, None])
    total = tl.sum(ex, axis=1)
    softmax = ex / total[:, None]
    if SIGMOID:
        scores = tl.where(in_row[None, :], tl.sigmoid(logits), 0.0)
    else:
        scores = softmax
    return softmax, scores, row_max + tl.log(total)


@triton.jit
def _gathered(scores, expert_ptr, rows, live, cols, slots, top_k, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """scores[t, expert[t, j]] as a (rows, slots) tile; dead rows read expert 0 (a positive score: no 0 / 0
    in their renormalisation)."""
    chosen = tl.zeros([BLOCK_ROWS, BLOCK_K], dtype=tl.float32)
    for j in range(top_k):
        e = tl.load(expert_ptr + rows.to(tl.int64) * top_k + j, mask=live, other=0)
        picked = tl.sum(tl.where(cols[None, :] == e[:, None], scores, 0.0), axis=1)
        chosen += tl.where(slots[None, :] == j, picked[:, None], 0.0)
    return chosen


@triton.jit
def _forward_kernel(
    logits_ptr,
    expert_ptr,
    weight_ptr,
    lse_ptr,
    partial_ptr,
    n_rows,
    n_experts,
    top_k,
    inv_rows,
    scale,
    tiles_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    in_row = cols < n_experts
    slots = tl.arange(0, BLOCK_K)
    in_k = slots < top_k
    probs_sum = tl.zeros([BLOCK_ROWS, BLOCK_E], dtype=tl.float32)
    first = tl.program_id(0) * tiles_per_program * BLOCK_ROWS
    for tile in range(tiles_per_program):
        rows = first + tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        _, scores, lse = _row_tile(logits_ptr, rows, live, cols, in_row, n_experts, SIGMOID)
        tl.store(lse_ptr + rows, lse, mask=live)
        if SIGMOID:
            probs = scores / tl.sum(scores, axis=1)[:, None]
        else:
            probs = scores
        probs_sum += tl.where(live[:, None] & in_row[None, :], probs, 0.0)
        weight = _gathered(scores, expert_ptr, rows, live, cols, slots, top_k, BLOCK_ROWS, BLOCK_K)
        if NORMALIZE:
            weight = weight / tl.sum(weight, axis=1)[:, None]
        weight = weight * scale
        offsets_TK = rows.to(tl.int64)[:, None] * top_k + slots[None, :]
        tl.store(weight_ptr + offsets_TK, weight, mask=live[:, None] & in_k[None, :])
    partial = tl.sum(probs_sum, axis=0) * inv_rows
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * n_experts + cols, partial, mask=in_row)


@triton.jit
def _backward_kernel(
    logits_ptr,
    expert_ptr,
    grad_weight_ptr,
    grad_mean_ptr,
    grad_lse_ptr,
    grad_logits_ptr,
    n_rows,
    n_experts,
    top_k,
    inv_rows,
    scale,
    tiles_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    in_row = cols < n_experts
    slots = tl.arange(0, BLOCK_K)
    in_k = slots < top_k
    grad_probs = (tl.load(grad_mean_ptr + cols, mask=in_row, other=0.0) * inv_rows)[None, :]
    first = tl.program_id(0) * tiles_per_program * BLOCK_ROWS
    for tile in range(tiles_per_program):
        rows = first + tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        softmax, scores, _ = _row_tile(logits_ptr, rows, live, cols, in_row, n_experts, SIGMOID)
        chosen = _gathered(scores, expert_ptr, rows, live, cols, slots, top_k, BLOCK_ROWS, BLOCK_K)
        offsets_TK = rows.to(tl.int64)[:, None] * top_k + slots[None, :]
        grad_weight = tl.load(grad_weight_ptr + offsets_TK, mask=live[:, None] & in_k[None, :], other=0.0)
        if NORMALIZE:
            chosen_sum = tl.sum(chosen, axis=1)[:, None]
            weighted = tl.sum(grad_weight * chosen, axis=1)[:, None] / chosen_sum
            grad_chosen = (scale / chosen_sum) * (grad_weight - weighted)
        else:
            grad_chosen = grad_weight * scale
        if SIGMOID:
            score_sum = tl.sum(scores, axis=1)[:, None]
            probs = scores / score_sum
            grad_scores = (grad_probs - tl.sum(grad_probs * probs, axis=1)[:, None]) / score_sum
        else:
            grad_scores = grad_probs + tl.zeros([BLOCK_ROWS, BLOCK_E], dtype=tl.float32)
        for j in range(top_k):
            e = tl.load(expert_ptr + rows.to(tl.int64) * top_k + j, mask=live, other=0)
            g = tl.sum(tl.where(slots[None, :] == j, grad_chosen, 0.0), axis=1)
            grad_scores += tl.where(cols[None, :] == e[:, None], g[:, None], 0.0)
        if SIGMOID:
            grad_logits = grad_scores * scores * (1.0 - scores)
        else:
            grad_logits = scores * (grad_scores - tl.sum(grad_scores * scores, axis=1)[:, None])
        grad_lse = tl.load(grad_lse_ptr + rows, mask=live, other=0.0)
        grad_logits += grad_lse[:, None] * softmax
        offsets = rows.to(tl.int64)[:, None] * n_experts + cols[None, :]
        tl.store(grad_logits_ptr + offsets, grad_logits, mask=live[:, None] & in_row[None, :])


def path(device: torch.device | str, dtype: torch.dtype = torch.float32, num_experts: int = 1) -> dispatch.KernelPath:
    """``dispatch.KernelPath`` of the router's scores for logits of ``dtype`` over ``num_experts``."""
    limit = None
    if dtype != torch.float32:
        limit = (
            f"the kernel takes float32 logits (the router computes in fp32), not {str(dtype).removeprefix('torch.')}"
        )
    elif num_experts > MAX_EXPERTS:
        limit = f"rows of {num_experts} experts exceed the kernel's {MAX_EXPERTS}"
    return dispatch.choose("router_scores", device, dtype, _forward_kernel, limit)


def _chosen(logits: Tensor) -> dispatch.KernelPath:
    chosen = path(logits.device, logits.dtype, logits.shape[-1])
    dispatch.note_fallback(chosen, logits.device)
    return chosen


def _launch_shape(rows: int, block: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, row tiles per program, rows per tile), as ``norm``'s kernels walk their rows."""
    rows_per_tile = max(1, min(triton.next_power_of_2(max(rows, 1)), TILE_ELEMENTS // block))
    tiles = triton.cdiv(rows, rows_per_tile)
    per_program = triton.cdiv(tiles, programs_for(tiles, device))
    return triton.cdiv(tiles, per_program), per_program, rows_per_tile


def _meta(rows: int, experts: int, top_k: int, device: torch.device, sigmoid: bool, normalize: bool):
    block = triton.next_power_of_2(experts)
    programs, per_program, rows_per_tile = _launch_shape(rows, block, device)
    meta = {
        "BLOCK_ROWS": rows_per_tile,
        "BLOCK_E": block,
        "BLOCK_K": triton.next_power_of_2(top_k),
        "SIGMOID": sigmoid,
        "NORMALIZE": normalize,
        "num_warps": warps_for(rows_per_tile * block),
    }
    return programs, per_program, meta


def _triton_forward(logits: Tensor, expert: Tensor, sigmoid: bool, normalize: bool, scale: float):
    logits, expert = logits.contiguous(), expert.contiguous()
    (rows, experts), top_k = logits.shape, expert.shape[1]
    weight = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if not rows:
        return weight, torch.full((experts,), float("nan"), device=logits.device), lse
    programs, per_program, meta = _meta(rows, experts, top_k, logits.device, sigmoid, normalize)
    partial = torch.empty(programs, experts, dtype=torch.float32, device=logits.device)
    with on_device(logits):
        _forward_kernel[(programs,)](
            logits,
            expert,
            weight,
            lse,
            partial,
            rows,
            experts,
            top_k,
            1.0 / rows,
            scale,
            per_program,
            **meta,
        )
    return weight, partial.sum(0), lse


def _triton_backward(
    grad_weight: Tensor,
    grad_mean_probs: Tensor,
    grad_lse: Tensor,
    logits: Tensor,
    expert: Tensor,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> Tensor:
    logits, expert = logits.contiguous(), expert.contiguous()
    (rows, experts), top_k = logits.shape, expert.shape[1]
    grad_logits = torch.empty_like(logits)
    if not rows:
        return grad_logits
    programs, per_program, meta = _meta(rows, experts, top_k, logits.device, sigmoid, normalize)
    with on_device(logits):
        _backward_kernel[(programs,)](
            logits,
            expert,
            grad_weight.contiguous(),
            grad_mean_probs.contiguous(),
            grad_lse.contiguous(),
            grad_logits,
            rows,
            experts,
            top_k,
            1.0 / rows,
            scale,
            per_program,
            **meta,
        )
    return grad_logits


# --- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::router_scores", mutates_args=())
def router_scores_op(
    logits: Tensor, expert: Tensor, sigmoid: bool, normalize: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(weight_TK, mean_probs_E, lse_T)."""
    if _chosen(logits).fused:
        return _triton_forward(logits, expert, sigmoid, normalize, scale)
    return reference_forward(logits, expert, sigmoid, normalize, scale)


@router_scores_op.register_fake
def _(logits, expert, sigmoid, normalize, scale):
    rows, experts = logits.shape
    return logits.new_empty(rows, expert.shape[1]), logits.new_empty(experts), logits.new_empty(rows)


@torch.library.custom_op("moe_engine::router_scores_backward", mutates_args=())
def router_scores_backward_op(
    grad_weight: Tensor,
    grad_mean_probs: Tensor,
    grad_lse: Tensor,
    logits: Tensor,
    expert: Tensor,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> Tensor:
    """grad_logits."""
    args = (grad_weight, grad_mean_probs, grad_lse, logits, expert, sigmoid, normalize, scale)
    if _chosen(logits).fused:
        return _triton_backward(*args)
    return reference_backward(*args)


@router_scores_backward_op.register_fake
def _(grad_weight, grad_mean_probs, grad_lse, logits, expert, sigmoid, normalize, scale):
    return logits.new_empty(logits.shape)


def _setup_router_scores(ctx, inputs, output):
    logits, expert, sigmoid, normalize, scale = inputs
    ctx.options = (sigmoid, normalize, scale)
    ctx.save_for_backward(logits, expert)


def _backward_router_scores(ctx, grad_weight, grad_mean_probs, grad_lse):
    logits, expert = ctx.saved_tensors
    grad_logits = router_scores_backward_op(grad_weight, grad_mean_probs, grad_lse, logits, expert, *ctx.options)
    return grad_logits, None, None, None, None


router_scores_op.register_autograd(_backward_router_scores, setup_context=_setup_router_scores)


def router_scores(
    logits_TE: Tensor, expert_TK: Tensor, sigmoid: bool = False, normalize: bool = False, scale: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """(weight_TK, mean_probs_E, lse_T) of fp32 router logits for the selected experts (docs/kernels.md),
    one op forward and one backward, saving the logits and the experts only."""
    return router_scores_op(logits_TE, expert_TK, sigmoid, normalize, float(scale))
