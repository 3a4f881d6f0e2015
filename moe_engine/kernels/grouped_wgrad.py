"""The experts' weight gradients added into an fp32 gradient buffer by the grouped GEMM itself (beta = 1),
as Megatron's gradient-accumulation fusion does: ``out[e] += a[rows of e]^T @ b[rows of e]``.

Today's two passes, ``torch._grouped_mm`` to a gradient in the operands' dtype and then an elementwise
add into the buffer, become one: the product never exists in memory, and for bf16 operands it is no
longer rounded to bf16 before it is added. torch has no grouped GEMM with ``out`` and ``beta``, so on
CUDA this is a Triton kernel; the reference (CPU) path is the eager composition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import moe_engine.kernels.dispatch as dispatch
from moe_engine.kernels.storage import as_bits, load_f32, on_device

OP = "grouped_wgrad_accumulate"
MIN_CAPABILITY = (8, 0)
"""``tl.dot`` on bf16 needs the tensor cores of compute capability 8.0 (Ampere) on."""

CONFIGS = {
    # operands: (BLOCK_M, BLOCK_K, BLOCK_R, num_warps, num_stages)
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float32: (128, 64, 32, 8, 3),
}
"""The one config each operand dtype runs: out tiles of BLOCK_M x BLOCK_K, rows in steps of BLOCK_R.
Fixed, not tuned: a tuner would time every config inside the first backward (a clone of the fp32
buffer per config, device syncs) and might choose differently from one run to the next, and with it
the summation order, so that two runs' gradients would differ in their last bits. bf16 takes the tensor
cores' usual 128 x 128 tile; fp32, whose dot runs on the FMA units with its operands in registers,
a narrower tile and shorter row steps (128 x 128 in steps of 32 rows spilled on sm_100a). Both compile
without spills for sm_80, sm_90a and sm_100a (``python -m bench.validate.kernel_compile``).
gpu-check times the op against the two passes it replaces (``bench/micro/test_grouped_wgrad.py``)."""


# --- the reference: the eager composition --------------------------------------------------------------


def reference_accumulate(a_NM: Tensor, b_NK: Tensor, offsets_E: Tensor, out_EMK: Tensor) -> None:
    """``out_EMK += torch._grouped_mm(a_NM.t(), b_NK, offs=offsets_E)``: the product in the operands'
    dtype, then one add, as the engine computed and accumulated the gradient before this op."""
    product_EMK = torch._grouped_mm(a_NM.t(), b_NK, offs=offsets_E)
    if product_EMK.is_cuda:
        # torch's CUDA grouped GEMM may leave an empty group's product unwritten; zeroed on the
        # device, without reading the offsets on the host.
        counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
        product_EMK.masked_fill_((counts_E <= 0).view(-1, 1, 1), 0)
    out_EMK.add_(product_EMK)


# --- the Triton kernel ---------------------------------------------------------------------------------


_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
"""Whether Triton's interpreter runs the kernel, whose dot does not take bf16 (it multiplies the bit
patterns); read in the kernel, so that its launches look the same interpreted and compiled."""


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,
    b_ptr,
    offsets_ptr,
    out_ptr,
    N,
    M,
    K,
    stride_an,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BF16: tl.constexpr,
):
    """out[e, m tile, k tile] += a[rows of e, m tile]^T @ b[rows of e, k tile], summed in fp32.

    Program (k tile, m tile, group e). bf16 operands arrive as their int16 bits (``storage.as_bits``):
    compiled, reinterpreted as bf16 for the tensor cores; interpreted, widened exactly to fp32. fp32
    values are multiplied in full fp32 precision (not TF32).
    """
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.program_id(2)
    # Clamped to the operands' rows: an offset past them cannot make the kernel read past them.
    end = tl.minimum(tl.load(offsets_ptr + e), N)
    start = tl.minimum(tl.where(e > 0, tl.load(offsets_ptr + tl.maximum(e - 1, 0)), 0), end)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = ms < M
    k_ok = ks < K
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    # The row loop stays at the top level, where Triton's software pipeliner finds it; an empty
    # group runs it zero times.
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + r
        row_ok = (rows < end)[:, None]
        rows64 = rows.to(tl.int64)[:, None]
        a_offsets = rows64 * stride_an + ms[None, :]
        b_offsets = rows64 * stride_bn + ks[None, :]
        a_mask = row_ok & m_ok[None, :]
        b_mask = row_ok & k_ok[None, :]
        if BF16 and not _INTERPRETED:
            a = tl.load(a_ptr + a_offsets, mask=a_mask, other=0).to(tl.bfloat16, bitcast=True)
            b = tl.load(b_ptr + b_offsets, mask=b_mask, other=0).to(tl.bfloat16, bitcast=True)
            acc = tl.dot(tl.trans(a), b, acc)
        else:
            a = load_f32(a_ptr, a_offsets, a_mask, BF16)
            b = load_f32(b_ptr, b_offsets, b_mask, BF16)
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
    if start < end:  # an empty group's tile is neither read nor written
        out = out_ptr + e.to(tl.int64) * M * K + ms.to(tl.int64)[:, None] * K + ks[None, :]
        mask = m_ok[:, None] & k_ok[None, :]
        tl.store(out, tl.load(out, mask=mask, other=0.0) + acc, mask=mask)


def path(device: torch.device | str, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32) -> dispatch.KernelPath:
    """``dispatch.KernelPath`` of ``grouped_wgrad_accumulate`` for operands of ``dtype`` added into a
    buffer of ``out_dtype``."""
    device = torch.device(device)
    limit = None
    if out_dtype != torch.float32:
        limit = f"the kernel adds into float32, not {str(out_dtype).removeprefix('torch.')}"
    elif device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            limit = "tl.dot needs compute capability {}.{}, the GPU has {}.{}".format(*MIN_CAPABILITY, *capability)
    return dispatch.choose(OP, device, dtype, _grouped_wgrad_kernel, limit)


def _triton_accumulate(a_NM: Tensor, b_NK: Tensor, offsets_E: Tensor, out_EMK: Tensor) -> None:
    block_m, block_k, block_r, warps, stages = CONFIGS[a_NM.dtype]
    a_NM = a_NM if a_NM.stride(-1) == 1 else a_NM.contiguous()
    b_NK = b_NK if b_NK.stride(-1) == 1 else b_NK.contiguous()
    num_groups, m, k = out_EMK.shape
    n = a_NM.shape[0]
    if not (num_groups and m and k and n):
        return

    grid = (triton.cdiv(k, block_k), triton.cdiv(m, block_m), num_groups)
    with on_device(out_EMK):
        _grouped_wgrad_kernel[grid](
            as_bits(a_NM),
            as_bits(b_NK),
            offsets_E.contiguous(),
            out_EMK,
            n,
            m,
            k,
            a_NM.stride(0),
            b_NK.stride(0),
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            BLOCK_R=block_r,
            BF16=a_NM.dtype == torch.bfloat16,
            num_warps=warps,
            num_stages=stages,
        )


def _check(a_NM: Tensor, b_NK: Tensor, offsets_E: Tensor, out_EMK: Tensor) -> None:
    if a_NM.dim() != 2 or b_NK.dim() != 2 or out_EMK.dim() != 3 or offsets_E.dim() != 1:
        raise ValueError(
            "grouped_wgrad_accumulate takes a_NM (N, M), b_NK (N, K), offsets_E (E,) and out_EMK (E, M, K); "
            f"got {a_NM.dim()}-D, {b_NK.dim()}-D, {offsets_E.dim()}-D and {out_EMK.dim()}-D"
        )
    want = (offsets_E.shape[0], a_NM.shape[1], b_NK.shape[1])
    if a_NM.shape[0] != b_NK.shape[0] or tuple(out_EMK.shape) != want:
        raise ValueError(
            f"grouped_wgrad_accumulate: a_NM {tuple(a_NM.shape)} and b_NK {tuple(b_NK.shape)} with "
            f"{offsets_E.shape[0]} groups need the same N and out_EMK of shape {want}, got {tuple(out_EMK.shape)}"
        )
    if offsets_E.dtype != torch.int32:
        raise TypeError(f"grouped_wgrad_accumulate: offsets_E must be int32, got {offsets_E.dtype}")
    if a_NM.dtype != b_NK.dtype:
        raise TypeError(f"grouped_wgrad_accumulate: a_NM is {a_NM.dtype} and b_NK {b_NK.dtype}: one dtype expected")
    if not out_EMK.is_contiguous():
        raise ValueError(
            f"grouped_wgrad_accumulate: out_EMK must be contiguous (a view of a flat gradient buffer), got "
            f"strides {tuple(out_EMK.stride())} for shape {tuple(out_EMK.shape)}"
        )
    devices = {a_NM.device, b_NK.device, offsets_E.device, out_EMK.device}
    if len(devices) != 1:
        raise ValueError(f"grouped_wgrad_accumulate: all tensors on one device, got {sorted(map(str, devices))}")


# --- the op --------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_engine::grouped_wgrad_accumulate", mutates_args=("out_EMK",))
def grouped_wgrad_accumulate_op(a_NM: Tensor, b_NK: Tensor, offsets_E: Tensor, out_EMK: Tensor) -> None:
    _check(a_NM, b_NK, offsets_E, out_EMK)
    chosen = path(a_NM.device, a_NM.dtype, out_EMK.dtype)
    dispatch.note_fallback(chosen, a_NM.device)
    if chosen.fused:
        _triton_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    else:
        reference_accumulate(a_NM, b_NK, offsets_E, out_EMK)


@grouped_wgrad_accumulate_op.register_fake
def _(a_NM, b_NK, offsets_E, out_EMK):
    _check(a_NM, b_NK, offsets_E, out_EMK)
    return None


def grouped_wgrad_accumulate(a_NM: Tensor, b_NK: Tensor, offsets_E: Tensor, out_EMK: Tensor) -> None:
    """``out_EMK[e] += a_NM[rows].T @ b_NK[rows]`` for each group e and its rows [offsets_E[e-1],
    offsets_E[e]) (from 0 for e = 0), in place, as one op.

    ``offsets_E``: int32 cumulative ends, on the device (never read on the host); rows after the last
    end are ignored and an empty group leaves its ``out_EMK[e]`` as it was. ``a_NM`` and ``b_NK`` of
    one dtype; ``out_EMK`` contiguous (a view of a flat gradient buffer). The Triton kernel (CUDA, bf16
    or fp32 operands, an fp32 buffer) sums the exact products in fp32 and adds once; the reference
    rounds the product to the operands' dtype first (``reference_accumulate``).
    """
    grouped_wgrad_accumulate_op(a_NM, b_NK, offsets_E, out_EMK)
