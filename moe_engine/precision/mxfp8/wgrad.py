"""The experts' weight gradients in MXFP8: ``out[e] (+)= a[rows of e]^T @ b[rows of e]`` on operands blocked
along the token axis within each expert's rows (``moe_engine.precision.mxfp8.token_blocks``), the
reduction axis of a weight gradient. The reference recipes (torchao's MXFP8 MoE training, Transformer
Engine's MXFP8 block scaling) run this GEMM in MXFP8 too, with a BF16 one as the opt-out
(``MoEConfig.mxfp8_wgrad``).

Paths: Triton's ``tl.dot_scaled`` on CUDA from capability 8.9 (``gemm.FP8_MIN_CAPABILITY``), with 128 x 128
output tiles, which Blackwell runs on its block-scaled tensor-core MMA; the torch emulation elsewhere
(dequantize to bf16, exact, then ``torch._grouped_mm``). Both sum the exact products in fp32; the
emulation rounds the product to bf16 before it adds it (torch's grouped GEMM writes bf16 only), as
``grouped_wgrad_accumulate``'s reference does. Adding into an fp32 gradient buffer (``out_EXY`` given) is
the kernel's own last step, as ``grouped_wgrad_accumulate`` does for bf16: the product is never written. torch's ``scaled_grouped_mm`` takes this 2D x 2D form only with each
expert's rows copied to multiples of 32 and the scales swizzled per expert, a layout no CPU test can
check; the Triton kernel runs under the interpreter here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_engine.kernels.storage import as_bits, on_device, store_f32
from moe_engine.moe.grouped_gemm import grouped_mm, zero_empty_experts_

# The module, not its names: gemm imports the engine's MoE package, which imports this module.
from moe_engine.precision.mxfp8 import gemm
from moe_engine.precision.mxfp8.blocks import BLOCK
from moe_engine.precision.mxfp8.token_blocks import TokenBlocked

CONFIG = (128, 128, 64, 8, 3)
"""(BLOCK_X, BLOCK_Y, BLOCK_T, num_warps, num_stages): output tiles of 128 x 128 (the block-scaled MMA's
size on sm_100a), 64 token rows per step. Fixed, not tuned: a tuner would time every config inside the
first backward and could pick another one, and with it another summation order, on the next run."""


def available_path(device: torch.device | str) -> gemm.GemmPath:
    """The Triton kernel on CUDA from capability 8.9, the emulation elsewhere."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= gemm.FP8_MIN_CAPABILITY:
        return gemm.GemmPath.TRITON
    return gemm.GemmPath.EMULATION


def grouped_wgrad(
    a: TokenBlocked,
    b: TokenBlocked,
    out_EXY: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    path: gemm.GemmPath | str | None = None,
) -> torch.Tensor | None:
    """``a[rows of e]^T @ b[rows of e]`` for each expert e, on the quantized values, summed in fp32:
    added into the contiguous fp32 ``out_EXY`` (E, X, Y) in place (returns None; an expert without rows
    leaves its slice as it was), or returned as a new (E, X, Y) tensor of ``out_dtype`` (zeros for an
    expert without rows). ``a`` (N, X) and ``b`` (N, Y) are blocked by one offsets tensor. ``path``: triton
    or emulation (None: ``available_path``; triton runs CPU tensors under TRITON_INTERPRET=1)."""
    _check(a, b, out_EXY)
    path = available_path(a.data_NK.device) if path is None else gemm.GemmPath(path)
    if path is gemm.GemmPath.SCALED_GROUPED_MM:
        raise ValueError("grouped_wgrad runs on the triton or emulation path, not torch's scaled_grouped_mm")
    # The fused add into the buffer reads it as well as writing it: a region of its own for the projection.
    region = "mxfp8.grouped_mm" if out_EXY is None else "mxfp8.grouped_wgrad"
    with torch.profiler.record_function(region):
        if path is gemm.GemmPath.TRITON:
            return _triton_wgrad(a, b, out_EXY, out_dtype)
        return _emulated_wgrad(a, b, out_EXY, out_dtype)


def _check(a: TokenBlocked, b: TokenBlocked, out_EXY: torch.Tensor | None) -> None:
    if a.data_NK.shape[0] != b.data_NK.shape[0]:
        raise ValueError(f"grouped_wgrad: a {tuple(a.data_NK.shape)} and b {tuple(b.data_NK.shape)} need the same rows")
    # One offsets tensor for both (compared by identity: its values stay on the device): the kernel numbers
    # b's blocks by a's block ends.
    if a.offsets_E is not b.offsets_E:
        raise ValueError("grouped_wgrad: a and b must be blocked by one offsets tensor")
    devices = {a.data_NK.device, b.data_NK.device} | ({out_EXY.device} if out_EXY is not None else set())
    if len(devices) != 1:
        raise ValueError(f"grouped_wgrad: all tensors on one device, got {sorted(map(str, devices))}")
    if out_EXY is None:
        return
    want = (a.offsets_E.shape[0], a.data_NK.shape[1], b.data_NK.shape[1])
    if tuple(out_EXY.shape) != want or out_EXY.dtype != torch.float32 or not out_EXY.is_contiguous():
        raise ValueError(
            f"grouped_wgrad: out_EXY must be a contiguous float32 {want} (a view of a flat gradient buffer), got "
            f"{out_EXY.dtype} {tuple(out_EXY.shape)} with strides {tuple(out_EXY.stride())}"
        )


def _emulated_wgrad(a, b, out_EXY, out_dtype):
    # E4M3 values times a power of two fit bf16 exactly, and torch's grouped GEMM takes bf16 only (its
    # CUDA kernel and the fake tensors a projection traces with): it sums the exact products in fp32, as
    # the kernel does, and rounds the product to bf16 once.
    a_NX, b_NY = a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16)
    product_EXY = zero_empty_experts_(grouped_mm(a_NX.t(), b_NY, a.offsets_E), a.offsets_E)
    if out_EXY is None:
        return product_EXY.to(out_dtype)
    out_EXY.add_(product_EXY)
    return None


@triton.jit
def _mx_wgrad_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    offsets_ptr,
    block_ends_ptr,
    out_ptr,
    N,
    X,
    Y,
    ACCUMULATE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_Y: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (Y tile, X tile, expert e): out[e, X tile, Y tile] (+)= a[rows of e, X tile]^T @ b[rows of e,
    Y tile], the rows in steps of BLOCK_T from the expert's first (a block boundary by construction)."""
    pid_y = tl.program_id(0)
    pid_x = tl.program_id(1)
    e = tl.program_id(2)
    # Clamped to the operands' rows: an offset past them cannot make the kernel read past them.
    end = tl.minimum(tl.load(offsets_ptr + e), N)
    start = tl.minimum(tl.where(e > 0, tl.load(offsets_ptr + tl.maximum(e - 1, 0)), 0), end)
    first_block = tl.where(e > 0, tl.load(block_ends_ptr + tl.maximum(e - 1, 0)), 0)
    xs = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    ys = pid_y * BLOCK_Y + tl.arange(0, BLOCK_Y)
    x_ok = xs < X
    y_ok = ys < Y
    t = tl.arange(0, BLOCK_T)
    s = tl.arange(0, BLOCK_T // BLOCK)
    acc = tl.zeros((BLOCK_X, BLOCK_Y), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_T):
        rows = r0 + t
        row_ok = rows < end
        rows64 = rows.to(tl.int64)
        blocks = (first_block + (r0 - start) // BLOCK + s).to(tl.int64)
        block_ok = r0 + s * BLOCK < end
        # Masked rows (past the expert's end: the next expert's) are zeros; masked scales 2^0.
        a = tl.load(a_ptr + rows64[None, :] * X + xs[:, None], mask=x_ok[:, None] & row_ok[None, :], other=0.0)
        a_scale = tl.load(
            a_scale_ptr + blocks[None, :] * X + xs[:, None], mask=x_ok[:, None] & block_ok[None, :], other=127
        )
        b = tl.load(b_ptr + rows64[:, None] * Y + ys[None, :], mask=row_ok[:, None] & y_ok[None, :], other=0.0)
        b_scale = tl.load(
            b_scale_ptr + blocks[None, :] * Y + ys[:, None], mask=y_ok[:, None] & block_ok[None, :], other=127
        )
        acc = tl.dot_scaled(a, a_scale, "e4m3", b, b_scale, "e4m3", acc)
    offsets = e.to(tl.int64) * X * Y + xs.to(tl.int64)[:, None] * Y + ys[None, :]
    mask = x_ok[:, None] & y_ok[None, :]
    if ACCUMULATE:
        if start < end:  # an empty expert's slice is neither read nor written
            tl.store(out_ptr + offsets, tl.load(out_ptr + offsets, mask=mask, other=0.0) + acc, mask=mask)
    else:
        store_f32(out_ptr, offsets, acc, mask, OUT_BF16)


def _triton_wgrad(a, b, out_EXY, out_dtype):
    if out_EXY is None and out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"grouped_wgrad writes float32 or bfloat16, not {out_dtype}")
    rows, x_size = a.data_NK.shape
    y_size = b.data_NK.shape[1]
    experts = a.offsets_E.shape[0]
    out = out_EXY
    if out is None:
        out = torch.empty(experts, x_size, y_size, dtype=out_dtype, device=a.data_NK.device)
    if not (experts and x_size and y_size):
        return None if out_EXY is not None else out
    block_x, block_y, block_t, warps, stages = CONFIG
    grid = (triton.cdiv(y_size, block_y), triton.cdiv(x_size, block_x), experts)
    with on_device(out):
        _mx_wgrad_kernel[grid](
            a.data_NK,
            a.scales_BK.view(torch.uint8),
            b.data_NK,
            b.scales_BK.view(torch.uint8),
            a.offsets_E,
            a.block_ends_E,
            as_bits(out),
            rows,
            x_size,
            y_size,
            ACCUMULATE=out_EXY is not None,
            OUT_BF16=out.dtype == torch.bfloat16,
            BLOCK=BLOCK,
            BLOCK_X=block_x,
            BLOCK_Y=block_y,
            BLOCK_T=block_t,
            num_warps=warps,
            num_stages=stages,
        )
    return None if out_EXY is not None else out
