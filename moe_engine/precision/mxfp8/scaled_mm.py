"""The MXFP8 grouped GEMM through torch's ``scaled_grouped_mm`` (block-32 e8m0 scales, CUTLASS, sm100).
The paths, the precision of each GEMM and the operands' layouts: docs/precision.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_engine.kernels.storage import as_bits, on_device
from moe_engine.precision.mxfp8.blocks import BLOCK, MXTensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a platform without Triton zeroes the rows with torch
    triton = None

SCALED_GROUPED_MM_MAJORS = (10,)
"""CUDA capability majors where torch runs the MXFP8 grouped GEMM (its ``_scaled_mm_allowed_device``
with ``sm100_only``: major 10, so B200 (10.0) and B300 (10.3))."""
TILE_ROWS, TILE_COLS = 128, 4
"""A blocked scale tile: 128 rows of 4 scales (each scale covers 32 elements along K)."""
MAX_GROUPS = 1024
"""The kernel sets up each group's arguments in one thread of one block (at most 1024 threads)."""
ALIGNMENT = 16
"""K and N must be multiples of this (torch's checks; 16 bytes of e4m3)."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(..., R, C) e8m0 scales -> (..., round_up(R, 128) * round_up(C, 4)) in the blocked layout
    (docs/precision.md), zero-padded (scale byte 0, read by no element)."""
    *batch, rows, cols = scales.shape
    rows_p, cols_p = _round_up(rows, TILE_ROWS), _round_up(cols, TILE_COLS)
    # Padding on the bytes: the e8m0 dtype has no fill kernels.
    padded = F.pad(scales.view(torch.uint8), (0, cols_p - cols, 0, rows_p - rows))
    # Row i of a tile is 32 a + b: (row tile, a, b, column tile, j) -> (row tile, column tile, b, a, j).
    tiles = padded.reshape(*batch, rows_p // TILE_ROWS, 4, 32, cols_p // TILE_COLS, TILE_COLS)
    n = len(batch)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.permute(order).reshape(*batch, rows_p * cols_p).view(scales.dtype)


def group_padded_rows(scales_MC: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """(round_up(M, 128) + 128 E, C): the rows of each expert moved to start at a multiple of 128
    (expert e at sum_{i<e} round_up(rows_i, 128)), zeros between; rows after the last offset dropped.
    Computed from the offsets on the device: the row count is a bound, not the groups' sum."""
    rows, cols = scales_MC.shape
    experts = offsets_E.numel()
    ends = offsets_E.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    padded_starts = torch.cumsum(padded, 0) - padded
    r = torch.arange(rows, device=scales_MC.device)
    expert = torch.searchsorted(ends, r, right=True)
    owned = expert < experts
    e = expert.clamp(max=experts - 1)
    out_rows = _round_up(rows, TILE_ROWS) + TILE_ROWS * experts
    # Rows no expert owns go to one extra row, cut off below.
    dest = torch.where(owned, padded_starts[e] + r - (ends[e] - sizes[e]), out_rows)
    out = scales_MC.new_zeros((out_rows + 1, cols), dtype=torch.uint8)
    out.index_copy_(0, dest, scales_MC.view(torch.uint8))
    return out[:out_rows].view(scales_MC.dtype)


def accepts(a_MK: MXTensor, b_ENK: MXTensor, out_dtype: torch.dtype) -> bool:
    """Whether ``scaled_grouped_mm`` takes these operands (docs/precision.md): bf16 output, K and N
    multiples of 16, e4m3 blocks of 32, 1 to 1024 experts, and at least as many rows as experts
    (FBGEMM's 2d x 3d entry divides M by the group count for its tile heuristics and, in the
    versions that test that quotient for emptiness, returns an unwritten output when it is 0)."""
    if out_dtype != torch.bfloat16 or a_MK.data.dim() != 2 or b_ENK.data.dim() != 3:
        return False
    if a_MK.block != BLOCK or b_ENK.block != BLOCK:
        return False
    if a_MK.data.dtype != torch.float8_e4m3fn or b_ENK.data.dtype != torch.float8_e4m3fn:
        return False
    m, k = a_MK.data.shape
    experts, n, _ = b_ENK.data.shape
    return k % ALIGNMENT == 0 and n % ALIGNMENT == 0 and 1 <= experts <= MAX_GROUPS and m >= experts


def operands(a_MK: MXTensor, b_ENK: MXTensor, offsets_E: torch.Tensor):
    """(mat_a, mat_b, scale_a, scale_b) as ``scaled_grouped_mm`` takes them (docs/precision.md)."""
    k = a_MK.data.shape[1]
    cols = _round_up(k // BLOCK, TILE_COLS)
    # A transposed weight (the dgrad operand) is a strided view; the op wants (E, N, K) contiguous.
    mat_b = b_ENK.data.contiguous().transpose(1, 2)
    scale_a = blocked_group_scales(a_MK.scales, offsets_E).view(-1, cols)
    scale_b = to_blocked(b_ENK.scales)
    return a_MK.data.contiguous(), mat_b, scale_a, scale_b


def grouped_mm(a_MK: MXTensor, b_ENK: MXTensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """bf16 (M, N): rows of expert e times B[e]^T through ``scaled_grouped_mm``; zero rows after the
    last offset (the op leaves them unwritten). The caller's ``mxfp8.grouped_mm`` profiler region
    covers the scale layout and the op: the projection prices the region as the GEMM."""
    mat_a, mat_b, scale_a, scale_b = operands(a_MK, b_ENK, offsets_E)
    blockwise, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
    # Looked up at call time: tests put a checking stand-in there; torch's stubs do not export it.
    op = F.scaled_grouped_mm  # type: ignore[attr-defined]
    out_MN = op(
        mat_a,
        mat_b,
        scale_a,
        blockwise,
        scale_b,
        blockwise,
        swizzle_a=swizzle,
        swizzle_b=swizzle,
        offs=offsets_E,
        output_dtype=torch.bfloat16,
    )
    return zero_rows_after(out_MN, offsets_E)


def blocked_group_scales(scales_MC: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``to_blocked(group_padded_rows(scales_MC, offsets_E))``: where a kernel runs (CUDA tensors, or
    CPU ones under TRITON_INTERPRET=1), one kernel in place of that composition's twenty-odd small
    ones: a program per 128-row tile of the padded scales finds the tile's expert from the offsets
    and writes the whole tile, zeros included, in the blocked layout."""
    if triton is None or not (scales_MC.is_cuda or _interpreted()):
        return to_blocked(group_padded_rows(scales_MC, offsets_E))
    rows, cols = scales_MC.shape
    experts = offsets_E.numel()
    tiles = -(-rows // TILE_ROWS) + experts
    cols_p = _round_up(cols, TILE_COLS)
    out = torch.empty(tiles * TILE_ROWS * cols_p, dtype=torch.uint8, device=scales_MC.device)
    if out.numel():
        source = scales_MC.view(torch.uint8)
        with on_device(out):
            _blocked_group_scales_kernel[(tiles,)](
                source,
                out,
                offsets_E,
                experts,
                cols,
                cols_p,
                source.stride(0),
                source.stride(1),
                BLOCK_E=max(triton.next_power_of_2(experts), 2),
                BLOCK_C=min(triton.next_power_of_2(cols_p), 64),
            )
    return out.view(scales_MC.dtype)


_ZERO_TILE = (64, 128)
"""Rows and columns one program of the zeroing kernel covers."""


def zero_rows_after(out_MN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``out_MN`` with its rows from ``offsets_E[-1]`` on set to zero, in place where a kernel runs
    (CUDA tensors, or CPU ones under TRITON_INTERPRET=1): it reads the end on the device (no host
    sync) and writes only those rows. Elsewhere, ``torch.where`` into a new tensor."""
    if triton is None or not (out_MN.is_cuda or _interpreted()):
        real_M1 = (torch.arange(out_MN.shape[0], device=out_MN.device) < offsets_E[-1]).unsqueeze(1)
        return torch.where(real_M1, out_MN, 0)
    rows, cols = out_MN.shape
    if rows and cols:
        block_r, block_c = _ZERO_TILE[0], min(_ZERO_TILE[1], triton.next_power_of_2(cols))
        with on_device(out_MN):
            _zero_rows_after_kernel[(triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))](
                as_bits(out_MN), offsets_E[-1:], rows, cols, out_MN.stride(0), BLOCK_R=block_r, BLOCK_C=block_c
            )
    return out_MN


if triton is not None:

    @triton.jit
    def _zero_rows_after_kernel(out_ptr, end_ptr, rows, cols, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # A program whose rows all come before the end stops after one scalar load.
        end = tl.load(end_ptr)
        first = tl.program_id(0) * BLOCK_R
        if first + BLOCK_R > end:
            r = first + tl.arange(0, BLOCK_R)
            c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            mask = ((r >= end) & (r < rows))[:, None] & (c < cols)[None, :]
            zeros = tl.zeros((BLOCK_R, BLOCK_C), out_ptr.dtype.element_ty)
            tl.store(out_ptr + r.to(tl.int64)[:, None] * stride + c[None, :], zeros, mask=mask)

    @triton.jit
    def _blocked_group_scales_kernel(
        src_ptr,
        out_ptr,
        offsets_ptr,
        num_experts,
        cols,
        cols_p,
        stride_r,
        stride_c,
        BLOCK_E: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # Expert e owns padded tiles [tiles_end[e] - tiles[e], tiles_end[e]), tiles[e] = cdiv(rows_e, 128):
        # its scale rows start at a multiple of 128, so a tile never holds two experts' rows.
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        ends = tl.load(offsets_ptr + e, mask=e < num_experts, other=0)
        starts = tl.load(offsets_ptr + e - 1, mask=(e > 0) & (e < num_experts), other=0)
        tiles = tl.where(e < num_experts, (ends - starts + 127) // 128, 0)
        tiles_end = tl.cumsum(tiles, 0)
        expert = tl.sum((tiles_end <= t).to(tl.int32), 0)
        mine = e == expert  # no expert past the last tile: every row of the tile is padding
        first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
        size = tl.sum(tl.where(mine, ends - starts, 0), 0)
        j = tl.arange(0, 128)
        i = (t - first_tile) * 128 + j  # row within the expert's group
        row_ok = i < size  # size 0 past the last expert's tiles
        src_row = (tl.sum(tl.where(mine, starts, 0), 0) + i).to(tl.int64)
        # Within a tile, row j = 32 a + b and column c sit at byte (c // 4) * 512 + 16 b + 4 a + c % 4.
        row_byte = (j % 32) * 16 + (j // 32) * 4
        base = out_ptr + t.to(tl.int64) * 128 * cols_p
        for c0 in range(0, cols_p, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (c < cols)[None, :]
            value = tl.load(src_ptr + src_row[:, None] * stride_r + c[None, :] * stride_c, mask=mask, other=0)
            byte = row_byte[:, None] + ((c // 4) * 512 + c % 4)[None, :]
            tl.store(base + byte, value, mask=(c < cols_p)[None, :] & (j < 128)[:, None])

    def _interpreted() -> bool:
        """Whether the kernel was defined under TRITON_INTERPRET=1 (and so runs on CPU tensors)."""
        return not isinstance(_zero_rows_after_kernel, triton.runtime.JITFunction)
