"""A dense weight gradient added into an fp32 gradient buffer by the GEMM itself (beta = 1), as Megatron's
gradient-accumulation fusion does: ``out += a^T @ b``. The dense counterpart of
``moe_engine.kernels.grouped_wgrad``; on CUDA it is cuBLAS through ``torch.addmm`` (its ``out_dtype``
overload sums bf16 products into the fp32 buffer), so there is no kernel of our own. The CPU, whose
``addmm`` has no ``out_dtype``, runs the two passes the ``.grad`` path makes: the product in the operands'
dtype, then the add. One op, so that a trace sees (and the projection prices) what CUDA runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

OUT_DTYPE_OPERANDS = (torch.bfloat16, torch.float16)
"""Operand dtypes ``torch.addmm``'s ``out_dtype`` overload adds into an fp32 output on CUDA."""


def _rows(t: Tensor) -> Tensor:
    """(N, X) rows of a (..., X) tensor: the leading dims flattened (a view where the strides allow)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def weight_grad(a_NM: Tensor, b_NK: Tensor) -> Tensor:
    """``a_NM^T @ b_NK`` in the operands' dtype (leading dims flattened into N), computed as autograd's
    linear computes a weight gradient (``(b^T a)^T``: the same operands in the same order, so the same bits)."""
    return _rows(b_NK).t().mm(_rows(a_NM)).t()


def reference_accumulate(a_NM: Tensor, b_NK: Tensor, out_MK: Tensor) -> None:
    """``out_MK += a_NM^T @ b_NK``: the product in the operands' dtype (``weight_grad``), then one add."""
    out_MK.add_(weight_grad(a_NM, b_NK))


def _check(a_NM: Tensor, b_NK: Tensor, out_MK: Tensor) -> None:
    if a_NM.dim() < 2 or b_NK.dim() < 2 or out_MK.dim() != 2:
        raise ValueError(
            "wgrad_accumulate takes a_NM (..., M), b_NK (..., K) and out_MK (M, K); "
            f"got {a_NM.dim()}-D, {b_NK.dim()}-D and {out_MK.dim()}-D"
        )
    want = (a_NM.shape[-1], b_NK.shape[-1])
    if a_NM.shape[:-1] != b_NK.shape[:-1] or tuple(out_MK.shape) != want:
        raise ValueError(
            f"wgrad_accumulate: a_NM {tuple(a_NM.shape)} and b_NK {tuple(b_NK.shape)} need the same leading "
            f"dims and out_MK of shape {want}, got {tuple(out_MK.shape)}"
        )
    if a_NM.dtype != b_NK.dtype:
        raise TypeError(f"wgrad_accumulate: a_NM is {a_NM.dtype} and b_NK {b_NK.dtype}: one dtype expected")
    if out_MK.dtype != torch.float32:
        raise TypeError(f"wgrad_accumulate: out_MK must be float32 (an fp32 gradient buffer), got {out_MK.dtype}")
    devices = {a_NM.device, b_NK.device, out_MK.device}
    if len(devices) != 1:
        raise ValueError(f"wgrad_accumulate: all tensors on one device, got {sorted(map(str, devices))}")


@torch.library.custom_op("moe_engine::wgrad_accumulate", mutates_args=("out_MK",))
def wgrad_accumulate_op(a_NM: Tensor, b_NK: Tensor, out_MK: Tensor) -> None:
    _check(a_NM, b_NK, out_MK)
    if not a_NM.is_cuda:
        reference_accumulate(a_NM, b_NK, out_MK)
    elif a_NM.dtype in OUT_DTYPE_OPERANDS:
        torch.addmm(out_MK, _rows(a_NM).t(), _rows(b_NK), out_dtype=torch.float32, out=out_MK)
    else:
        out_MK.addmm_(_rows(a_NM).t(), _rows(b_NK))


@wgrad_accumulate_op.register_fake
def _(a_NM, b_NK, out_MK):
    _check(a_NM, b_NK, out_MK)
    return None


def wgrad_accumulate(a_NM: Tensor, b_NK: Tensor, out_MK: Tensor) -> None:
    """``out_MK += a_NM^T @ b_NK`` in place, as one op: ``a_NM`` the output gradient's rows, ``b_NK``
    the input's (leading dims alike, flattened into N inside the op, so that a caller's reshapes cost
    nothing outside it), ``out_MK`` an fp32 buffer view (a weight's ``main_grad``). On CUDA the GEMM adds into
    it (bf16 or fp16 operands summed in fp32, rounded once); on the CPU the reference rounds the product
    to the operands' dtype first (``reference_accumulate``)."""
    wgrad_accumulate_op(a_NM, b_NK, out_MK)
