"""MXFP8 quantization as a Triton kernel, equal byte for byte to ``mxfp8.quantize``.
More: docs/precision.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_engine.precision.mxfp8.blocks import BLOCK, ScaleRounding, check_blocked_axis, quantize

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE_ELEMENTS = 4096
"""Elements one program quantizes: enough blocks per program to amortize the index arithmetic."""


@triton.jit
def _quantize_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    n_blocks,
    inner,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    CEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    # Block b covers (o, l, i) of the (outer, size, inner) view with b = (o * size / BLOCK + l) * inner + i,
    # which puts its first element at (b - i) * BLOCK + i and the next ones every `inner` elements.
    b = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)  # [B]
    j = tl.arange(0, BLOCK_P2)  # [E]
    i = b % inner
    offsets = ((b - i) * BLOCK + i)[:, None] + j.to(tl.int64)[None, :] * inner  # [B, E]
    live = b < n_blocks
    mask = live[:, None] & (j < BLOCK)[None, :]
    if BF16_BITS:
        # bfloat16 is the top half of float32. Widening the raw int16 bits avoids a float conversion,
        # which Triton 3.9's interpreter gets wrong for bf16 subnormals.
        bits = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    codes, scale_code = mx_blocks(bits, CEIL)
    tl.store(data_ptr + offsets, codes.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + b, scale_code.to(tl.uint8), mask=live)


@triton.jit
def _quantize_strided_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    inner,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    BLOCK_I: tl.constexpr,
    CEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    # A non-last axis: the (outer, size, inner) view's blocks (o, l, i0 .. i0 + BLOCK_I) side by side.
    # The tile is loaded as [E, BLOCK_I], contiguous along its last dim, so that each thread reads
    # consecutive elements of one row (coalesced, vectorised); the block reduction then runs on its
    # transpose.
    group = tl.program_id(0).to(tl.int64)  # o * size / BLOCK + l
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [I]
    j = tl.arange(0, BLOCK_P2)  # [E]
    offsets = group * BLOCK * inner + j.to(tl.int64)[:, None] * inner + i[None, :]  # [E, I]
    mask = (j < BLOCK)[:, None] & (i < inner)[None, :]
    if BF16_BITS:
        bits = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    codes, scale_code = mx_blocks(tl.trans(bits), CEIL)  # [I, E], [I]
    tl.store(data_ptr + offsets, tl.trans(codes).to(tl.uint8), mask=mask)
    tl.store(scales_ptr + group * inner + i, scale_code.to(tl.uint8), mask=i < inner)


@triton.jit
def mx_blocks(bits, CEIL: tl.constexpr):
    """(E4M3 codes [B, E], E8M0 scale codes [B]) of B blocks given as the fp32 bit patterns of their
    elements ([B, E] int32; padding elements 0, which changes no block's maximum)."""
    magnitude = bits & 0x7FFFFFFF

    # The integer order of magnitudes is their float order, with every NaN above Inf, so this max is
    # the block's amax as torch computes it (NaN wins, then Inf).
    amax = tl.max(magnitude, axis=1)  # [B]
    amax_exponent = amax >> 23
    finite = amax_exponent < 255
    # floor(log2(amax)) - 8. Subnormal and zero maxima give -135 here, below the clamp, which is where
    # their true exponents end up too. For Inf/NaN torch.frexp reports exponent 0 (floor(log2) = -1);
    # only the data bytes of those blocks depend on it, since their scale is the NaN scale.
    shared = tl.where(finite, amax_exponent - 127, -1) - 8
    if CEIL:
        # amax / 2^shared = 2^8 * (1 + mantissa / 2^23) exceeds 448 = 2^8 * 1.75 iff mantissa > 0.75 * 2^23;
        # torch's comparison is true for Inf and false for NaN.
        over = tl.where(finite, (amax & 0x7FFFFF) > 0x600000, amax == 0x7F800000)
        shared = shared + over.to(tl.int32)
    shared = tl.minimum(tl.maximum(shared, -127), 127)
    scale_code = tl.where(finite, shared + 127, 255)
    return _e4m3_codes(bits, magnitude, shared[:, None]), scale_code


@triton.jit
def _e4m3_codes(bits, magnitude, shared):
    """E4M3 code of (fp32 with these bits) / 2^shared: nearest, ties to even, saturated to +-448."""
    field = magnitude >> 23
    mantissa = magnitude & 0x7FFFFF
    # value = significand * 2^exponent exactly, for normal and subnormal fp32 alike.
    significand = tl.where(field == 0, mantissa, mantissa | 0x800000)
    exponent = tl.where(field == 0, -149, field - 150)
    # floor(log2(significand)) from its float conversion, exact because significand < 2^24 (-127 for 0).
    significand_log2 = (significand.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    scaled_log2 = significand_log2 + exponent - shared
    # E4M3 steps are 2^(e - 3) in binade e, and 2^-9 throughout the subnormals below 2^-6.
    binade = tl.maximum(scaled_log2, -6)
    # Bits of the significand below one step. At least -3 (values of few bits scale up exactly);
    # beyond 25 everything rounds to zero, and the cap keeps shifts defined.
    shift = binade - 3 - exponent + shared
    right = tl.minimum(tl.maximum(shift, 0), 25)
    widened = significand << tl.maximum(-shift, 0)
    steps = widened >> right
    remainder = widened & ((1 << right) - 1)
    half = (1 << right) >> 1
    round_up = (remainder > half) | ((remainder == half) & (right > 0) & ((steps & 1) == 1))
    steps = steps + round_up.to(tl.int32)
    # Normal binades hold steps 8..15 (16 carries into the next binade through the addition);
    # subnormals hold 0..7 with 8 being the smallest normal, so one formula encodes both.
    code = tl.minimum(((binade + 6) << 3) + steps, 0x7E)
    code = tl.where(magnitude > 0x7F800000, 0x7F, code)
    return code | ((bits >> 24) & 0x80)


def _interpreted() -> bool:
    """Whether the kernel was defined under TRITON_INTERPRET=1 (and so runs on CPU tensors)."""
    return not isinstance(_quantize_kernel, triton.runtime.JITFunction)


def quantize_triton(
    x: torch.Tensor, axis: int = -1, block: int = BLOCK, rounding: ScaleRounding = ScaleRounding.FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mxfp8.quantize`` on the GPU: (data float8_e4m3fn shaped like x, scales float8_e8m0fnu)."""
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"MXFP8 quantization takes float32, bfloat16 or float16 tensors, not {x.dtype}")
    axis = check_blocked_axis(x.shape, axis, block)
    size = x.shape[axis]
    if not (x.is_cuda or _interpreted()):
        raise ValueError(
            f"quantize_triton runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got one on {x.device}"
        )
    scales_shape = (*x.shape[:axis], size // block, *x.shape[axis + 1 :])
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(scales_shape, dtype=torch.uint8, device=x.device)
    n_blocks = scales.numel()
    if n_blocks:
        bf16 = x.dtype == torch.bfloat16
        x = x.contiguous().view(torch.int16) if bf16 else x.contiguous()
        block_p2 = triton.next_power_of_2(block)
        per_program = max(1, _TILE_ELEMENTS // block_p2)
        inner = math.prod(x.shape[axis + 1 :])
        # Imported here: moe_engine.kernels imports this module (the MXFP8 gather uses its blocks).
        from moe_engine.kernels.storage import on_device

        if inner > 1:
            block_i = min(triton.next_power_of_2(inner), max(16, _TILE_ELEMENTS // block_p2))
            with on_device(x):
                _quantize_strided_kernel[(n_blocks // inner, triton.cdiv(inner, block_i))](
                    x,
                    data,
                    scales,
                    inner,
                    BLOCK=block,
                    BLOCK_P2=block_p2,
                    BLOCK_I=block_i,
                    CEIL=ScaleRounding(rounding) is ScaleRounding.CEIL,
                    BF16_BITS=bf16,
                )
            return data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)
        grid = (triton.cdiv(n_blocks, per_program),)
        with on_device(x):
            _quantize_kernel[grid](
                x,
                data,
                scales,
                n_blocks,
                inner,
                BLOCK=block,
                BLOCK_P2=block_p2,
                BLOCKS_PER_PROGRAM=per_program,
                CEIL=ScaleRounding(rounding) is ScaleRounding.CEIL,
                BF16_BITS=bf16,
            )
    return data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def quantize_auto(
    x: torch.Tensor, axis: int = -1, block: int = BLOCK, rounding: ScaleRounding = ScaleRounding.FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for CUDA tensors, the torch implementation elsewhere: the same bytes either way."""
    if x.is_cuda and x.dtype in _INPUT_DTYPES:
        return quantize_triton(x, axis, block, rounding)
    return quantize(x, axis, block, rounding)
