"""Cross-entropy fused with the LM head, in chunks of rows, so the (N, V) logits never exist at once.
More: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import as_bits, load_f32, on_device, store_f32

IGNORE_INDEX = -100
"""The label of rows that do not count (``F.cross_entropy``'s default)."""
BLOCK_VOCAB = 4096
"""Logits one program step reads (a row's vocabulary takes ceil(V / BLOCK_VOCAB) steps)."""


def default_chunk_rows(rows: int, width: int, vocab: int) -> int:
    """Rows per chunk: a power of two that makes a chunk's logits (rows x V) about as large as the
    hidden states (N x D), so the loss's transient memory stays at the activations' scale."""
    per_chunk = triton.cdiv(max(rows, 1), triton.cdiv(vocab, width))
    return max(1, min(rows, triton.next_power_of_2(per_chunk)))


# --- the reference: the eager composition, one chunk of rows at a time --------------------------------


def reference_chunk_loss(logits_CV: Tensor, labels_C: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(lse, loss) per row of the chunk, fp32; loss 0 on ignored rows."""
    logits32 = logits_CV.float()
    lse_C = torch.logsumexp(logits32, dim=-1)
    valid_C = labels_C != ignore_index
    target_C = logits32.gather(1, torch.where(valid_C, labels_C, 0).unsqueeze(1)).squeeze(1)
    return lse_C, torch.where(valid_C, lse_C - target_C, 0.0)


def reference_chunk_grad(
    logits_CV: Tensor, labels_C: Tensor, lse_C: Tensor, scale: Tensor, ignore_index: int
) -> Tensor:
    """d loss / d logits of the chunk in the logits' dtype: (softmax - onehot) * scale on counted rows."""
    valid_C = labels_C != ignore_index
    grad_CV = torch.exp(logits_CV.float() - lse_C.unsqueeze(1))
    rows = torch.arange(len(labels_C), device=labels_C.device)
    grad_CV[rows, torch.where(valid_C, labels_C, 0)] -= valid_C.float()
    return (grad_CV * torch.where(valid_C, scale, 0.0).unsqueeze(1)).to(logits_CV.dtype)


# --- the Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _loss_kernel(
    logits_ptr, labels_ptr, lse_ptr, loss_ptr, vocab, ignore_index, BLOCK: tl.constexpr, BF16: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    first = row * vocab
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_vocab = cols < vocab
        logits = tl.where(in_vocab, load_f32(logits_ptr, first + cols, in_vocab, BF16), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    target = load_f32(logits_ptr, first + tl.where(valid, label, 0), valid, BF16)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))


@triton.jit
def _grad_kernel(
    logits_ptr, labels_ptr, lse_ptr, scale_ptr, vocab, ignore_index, BLOCK: tl.constexpr, BF16: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    first = row * vocab
    label = tl.load(labels_ptr + row).to(tl.int64)
    scale = tl.where(label != ignore_index, tl.load(scale_ptr), 0.0)
    lse = tl.load(lse_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_vocab = cols < vocab
        logits = load_f32(logits_ptr, first + cols, in_vocab, BF16)
        grad = (tl.exp(logits - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
        store_f32(logits_ptr, first + cols, grad, in_vocab, BF16)


def _block(vocab: int) -> int:
    return min(BLOCK_VOCAB, triton.next_power_of_2(max(vocab, 1)))


def triton_chunk_loss(logits_CV: Tensor, labels_C: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    rows, vocab = logits_CV.shape
    lse_C = torch.empty(rows, dtype=torch.float32, device=logits_CV.device)
    loss_C = torch.empty_like(lse_C)
    if rows:
        with on_device(logits_CV):
            _loss_kernel[(rows,)](
                as_bits(logits_CV),
                labels_C,
                lse_C,
                loss_C,
                vocab,
                ignore_index,
                BLOCK=_block(vocab),
                BF16=logits_CV.dtype == torch.bfloat16,
                num_warps=8,
            )
    return lse_C, loss_C


def triton_chunk_grad(logits_CV: Tensor, labels_C: Tensor, lse_C: Tensor, scale: Tensor, ignore_index: int) -> Tensor:
    """The gradient, written over the logits (which are not needed again)."""
    rows, vocab = logits_CV.shape
    if rows:
        with on_device(logits_CV):
            _grad_kernel[(rows,)](
                as_bits(logits_CV),
                labels_C,
                lse_C,
                scale,
                vocab,
                ignore_index,
                BLOCK=_block(vocab),
                BF16=logits_CV.dtype == torch.bfloat16,
                num_warps=8,
            )
    return logits_CV


def path(
    device: torch.device | str, dtype: torch.dtype, weight_dtype: torch.dtype | None = None
) -> dispatch.KernelPath:
    """``dispatch.KernelPath`` of the fused loss for hidden states of ``dtype``."""
    limit = None
    if weight_dtype is not None and weight_dtype != dtype:
        limit = f"the LM head's weight is {weight_dtype}, the hidden states {dtype}"
    return dispatch.choose("linear_cross_entropy", device, dtype, _loss_kernel, limit)


def _chosen(h: Tensor, weight: Tensor) -> dispatch.KernelPath:
    chosen = path(h.device, h.dtype, weight.dtype)
    dispatch.note_fallback(chosen, h.device)
    return chosen


def _chunks(rows: int, width: int, vocab: int, chunk_rows: int) -> range:
    return range(0, rows, chunk_rows if chunk_rows > 0 else default_chunk_rows(rows, width, vocab))


def _count(labels_N: Tensor, ignore_index: int) -> Tensor:
    return (labels_N != ignore_index).sum().float()


# --- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_rows: int
) -> tuple[Tensor, Tensor]:
    """(mean loss, lse per row) for h (N, D), weight (V, D), labels (N,); chunk_rows <= 0: the default."""
    chunk_loss = triton_chunk_loss if _chosen(h, weight).fused else reference_chunk_loss
    rows, vocab = h.shape[0], weight.shape[0]
    lse_N = torch.empty(rows, dtype=torch.float32, device=h.device)
    loss_N = torch.empty_like(lse_N)
    chunks = _chunks(rows, h.shape[1], vocab, chunk_rows)
    for start in chunks:
        end = min(start + chunks.step, rows)
        logits_CV = F.linear(h[start:end], weight)
        lse_N[start:end], loss_N[start:end] = chunk_loss(logits_CV, labels[start:end], ignore_index)
    return loss_N.sum() / _count(labels, ignore_index), lse_N


@linear_cross_entropy_op.register_fake
def _(h, weight, labels, ignore_index, chunk_rows):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


@torch.library.custom_op("moe_engine::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: Tensor, h: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, ignore_index: int, chunk_rows: int
) -> tuple[Tensor, Tensor]:
    """(grad_h, grad_weight)."""
    chunk_grad = triton_chunk_grad if _chosen(h, weight).fused else reference_chunk_grad
    rows, vocab = h.shape[0], weight.shape[0]
    scale = (grad_loss.float() / _count(labels, ignore_index)).reshape(())
    grad_h = torch.empty_like(h)
    grad_weight32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    chunks = _chunks(rows, h.shape[1], vocab, chunk_rows)
    for start in chunks:
        end = min(start + chunks.step, rows)
        h_CD = h[start:end]
        grad_CV = chunk_grad(F.linear(h_CD, weight), labels[start:end], lse[start:end], scale, ignore_index)
        torch.mm(grad_CV, weight, out=grad_h[start:end])
        _add_product_f32(grad_weight32, grad_CV.t(), h_CD)
    return grad_h, grad_weight32.to(weight.dtype)


def _add_product_f32(acc32: Tensor, a: Tensor, b: Tensor) -> None:
    """acc32 += a @ b with fp32 accumulation, whatever a's and b's dtype."""
    if a.dtype == torch.float32:
        acc32.addmm_(a, b)
    elif a.is_cuda:
        acc32.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc32.addmm_(a.float(), b.float())


@linear_cross_entropy_backward_op.register_fake
def _(grad_loss, h, weight, labels, lse, ignore_index, chunk_rows):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    h, weight, labels, ignore_index, chunk_rows = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, weight, labels, lse)
    ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows


def _backward(ctx, grad_loss, _grad_lse):
    h, weight, labels, lse = ctx.saved_tensors
    if grad_loss is None:
        return None, None, None, None, None
    grad_h, grad_weight = linear_cross_entropy_backward_op(
        grad_loss, h, weight, labels, lse, ctx.ignore_index, ctx.chunk_rows
    )
    return grad_h, grad_weight, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, chunk_rows: int = 0
) -> Tensor:
    """Mean cross-entropy (fp32) of ``F.linear(h, weight)`` against ``labels``, without the logits:
    h (..., D), weight (V, D), labels of h's leading shape. ``chunk_rows``: rows per chunk (0: the
    default, ``default_chunk_rows``)."""
    if labels.shape != h.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match hidden states {tuple(h.shape)}")
    h_ND = h.reshape(-1, h.shape[-1])
    # Resolved here so that a trace records the chunking the op runs (its price depends on it).
    chunk_rows = chunk_rows if chunk_rows > 0 else default_chunk_rows(h_ND.shape[0], h_ND.shape[1], weight.shape[0])
    return linear_cross_entropy_op(h_ND, weight, labels.reshape(-1), ignore_index, chunk_rows)[0]
