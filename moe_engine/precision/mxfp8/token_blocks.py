"""MXFP8 operands blocked along the token axis, one expert's rows at a time: the operands of the experts'
weight gradients, which reduce over tokens (``dW[e] = dY[rows of e]^T @ X[rows of e]``).

An expert's rows start anywhere and are not a multiple of 32, and a block must not mix two experts'
rows (its scale would be shared across two products). So a block of 32 rows starts at each expert's
first row, and the expert's last block holds the rest: in value a block zero-padded to 32, which changes
no block's maximum (``quantize`` along axis 0 of the expert's rows, padded, gives the same bytes). The
rows stay where they are; only the blocks' numbering is per expert: expert e's blocks are numbered
from ``block_ends_E[e - 1]`` (0 for e = 0) on. Of the scales, the ``max_blocks(N, E)`` rows that N rows
can need at most are kept, so that nothing is read on the host. torch's ``scaled_grouped_mm`` and
torchao's recipe copy each expert's rows into a buffer padded to multiples of 32 instead; here the
GEMM (``moe_engine.precision.mxfp8.wgrad``) masks the rows past an expert's end.

Rows at or past the last offset (an expert-parallel buffer's padding) belong to no block: the GEMM never
reads them, the Triton kernel leaves their codes unwritten (no pass over the whole operand to clear them),
and ``TokenBlocked.dequantize`` gives 0 for them whatever they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_engine.kernels.storage import on_device
from moe_engine.precision.mxfp8.blocks import BLOCK, E4M3_MAX, E8M0_NAN, ScaleRounding, shared_exponents
from moe_engine.precision.mxfp8.kernels import mx_blocks

_INPUT_DTYPES = (torch.float32, torch.bfloat16)


def max_blocks(rows: int, experts: int) -> int:
    """Blocks that ``rows`` rows split among ``experts`` experts need at most: each expert's
    ceil(rows_e / 32) sum to at most ceil(rows / 32) + experts - 1."""
    return -(-rows // BLOCK) + max(experts - 1, 0)


def block_ends(offsets_E: torch.Tensor) -> torch.Tensor:
    """int32 cumulative block ends of the experts whose rows end at ``offsets_E``."""
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return torch.cumsum(torch.div(counts_E + (BLOCK - 1), BLOCK, rounding_mode="floor"), 0).to(torch.int32)


def row_blocks(offsets_E: torch.Tensor, block_ends_E: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) int64 block of each row; ``max_blocks(rows, E)`` (one past the last) for rows at or past the
    last offset."""
    experts = offsets_E.shape[0]
    t_N = torch.arange(rows, device=offsets_E.device, dtype=torch.int32)
    if experts == 0:
        return torch.full((rows,), max_blocks(rows, 0), dtype=torch.int64, device=offsets_E.device)
    e_N = torch.searchsorted(offsets_E, t_N, right=True)  # the first expert whose rows end after t
    owned_N = e_N < experts
    e_N = e_N.clamp(max=experts - 1)
    starts_E = F.pad(offsets_E[:-1], (1, 0))
    first_blocks_E = F.pad(block_ends_E[:-1], (1, 0))
    block_N = first_blocks_E[e_N].long() + torch.div(t_N - starts_E[e_N], BLOCK, rounding_mode="floor")
    return torch.where(owned_N, block_N, max_blocks(rows, experts))


@dataclass
class TokenBlocked:
    """An (N, K) tensor in MXFP8 with blocks of 32 rows within each expert's rows (the module docstring)."""

    data_NK: torch.Tensor
    """float8_e4m3fn codes, where the rows were; rows past the last offset hold anything (the torch
    composition writes 0 there, the Triton kernel nothing)."""
    scales_BK: torch.Tensor
    """float8_e8m0fnu scales, (max_blocks(N, E), K): block b's scale of each column."""
    offsets_E: torch.Tensor
    """int32 cumulative row ends of the experts."""
    block_ends_E: torch.Tensor
    """int32 cumulative block ends of the experts (``block_ends``)."""

    @property
    def shape(self) -> torch.Size:
        return self.data_NK.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) values the codes stand for: code * 2^(scale - 127), NaN where the scale is NaN; 0 for
        rows past the last offset."""
        rows = self.data_NK.shape[0]
        block_N = row_blocks(self.offsets_E, self.block_ends_E, rows)
        # One more scale row for the rows no block owns, which come out as 0 whatever their codes hold.
        biased_BK = F.pad(self.scales_BK.view(torch.uint8), (0, 0, 0, 1), value=127)
        biased_NK = biased_BK.index_select(0, block_N)
        scale_NK = torch.where(biased_NK == E8M0_NAN, float("nan"), torch.exp2(biased_NK.float() - 127))
        owned_N1 = (block_N < self.scales_BK.shape[0]).unsqueeze(1)
        return torch.where(owned_N1, self.data_NK.float() * scale_NK, 0.0).to(dtype)


@torch.profiler.record_function("mxfp8.quantize")
def quantize_token_blocks(
    t_NK: torch.Tensor, offsets_E: torch.Tensor, rounding: ScaleRounding = ScaleRounding.FLOOR
) -> TokenBlocked:
    """``t_NK`` (fp32 or bf16) in MXFP8, blocked along its rows within each expert's: one Triton kernel on
    CUDA, the torch composition elsewhere; the same bytes either way."""
    if t_NK.dim() != 2 or offsets_E.dim() != 1 or offsets_E.dtype != torch.int32:
        raise ValueError(
            f"quantize_token_blocks takes an (N, K) tensor and 1-D int32 offsets, got {t_NK.dim()}-D and "
            f"{offsets_E.dim()}-D {offsets_E.dtype}"
        )
    if t_NK.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize_token_blocks takes float32 or bfloat16, not {t_NK.dtype}")
    if t_NK.is_cuda:
        return quantize_token_blocks_triton(t_NK, offsets_E, rounding)
    return quantize_token_blocks_reference(t_NK, offsets_E, rounding)


def quantize_token_blocks_reference(
    t_NK: torch.Tensor, offsets_E: torch.Tensor, rounding: ScaleRounding = ScaleRounding.FLOOR
) -> TokenBlocked:
    """The torch composition: ``blocks.quantize``'s arithmetic on blocks gathered by index."""
    # First, a copy of the operand: the projection prices the region as a pass reading its first op's input.
    x_NK = t_NK.to(torch.float32, copy=True)
    rows, cols = t_NK.shape
    ends_E = block_ends(offsets_E)
    num_blocks = max_blocks(rows, offsets_E.shape[0])
    block_N = row_blocks(offsets_E, ends_E, rows)
    owned_N1 = (block_N < num_blocks).unsqueeze(1)
    x_NK = torch.where(owned_N1, x_NK, 0.0)
    index_NK = block_N.unsqueeze(1).expand(rows, cols)
    # One more block, the scratch block of the rows no expert owns (all zeros by now).
    amax_BK = x_NK.new_zeros(num_blocks + 1, cols).scatter_reduce_(0, index_NK, x_NK.abs(), "amax")
    # A NaN makes its block's maximum NaN, as the maximum over a block does in blocks.quantize.
    nan_BK = torch.zeros_like(amax_BK).scatter_reduce_(0, index_NK, x_NK.isnan().float(), "amax")
    amax_BK = torch.where(nan_BK > 0, float("nan"), amax_BK)
    shared_BK = shared_exponents(amax_BK, rounding)
    scaled_NK = x_NK * torch.exp2(-shared_BK.index_select(0, block_N).float())
    data_NK = scaled_NK.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    biased_BK = torch.where(torch.isfinite(amax_BK), shared_BK + 127, E8M0_NAN).to(torch.uint8)
    scales_BK = biased_BK[:num_blocks].contiguous().view(torch.float8_e8m0fnu)
    return TokenBlocked(data_NK, scales_BK, offsets_E, ends_E)


@triton.jit
def _quantize_token_blocks_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    offsets_ptr,
    block_ends_ptr,
    num_experts,
    num_rows,
    cols,
    BLOCK: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    # Program (block b, column tile): the block's rows [first, min(first + 32, end)) of its expert,
    # loaded as [32, I] (each thread reads consecutive columns of a row), reduced on the transpose.
    b = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    e = tl.arange(0, BLOCK_E)
    live = e < num_experts
    ends = tl.load(block_ends_ptr + e, mask=live, other=0)
    expert = tl.sum((live & (ends <= b)).to(tl.int32), 0)
    mine = e == expert
    before = live & (e > 0)
    # The selected expert's entries, as masked sums (a gather from a block by a scalar index).
    first_block = tl.sum(tl.where(mine, tl.load(block_ends_ptr + e - 1, mask=before, other=0), 0), 0)
    row_start = tl.sum(tl.where(mine, tl.load(offsets_ptr + e - 1, mask=before, other=0), 0), 0)
    # Clamped to the operand's rows: an offset past them cannot make the kernel touch memory past them.
    row_end = tl.minimum(tl.sum(tl.where(mine, tl.load(offsets_ptr + e, mask=live, other=0), 0), 0), num_rows)
    # A block past the last expert's (expert == num_experts, no entry selected: row_end 0) gets no rows:
    # all zeros, scale code 0.
    rows = row_start + (b - first_block) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < row_end
    offsets = rows.to(tl.int64)[:, None] * cols + i[None, :]
    mask = row_ok[:, None] & (i < cols)[None, :]
    if BF16_BITS:
        bits = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    codes, scale_code = mx_blocks(tl.trans(bits), CEIL)  # [I, 32], [I]
    tl.store(data_ptr + offsets, tl.trans(codes).to(tl.uint8), mask=mask)
    tl.store(scales_ptr + b.to(tl.int64) * cols + i, scale_code.to(tl.uint8), mask=i < cols)


def quantize_token_blocks_triton(
    t_NK: torch.Tensor, offsets_E: torch.Tensor, rounding: ScaleRounding = ScaleRounding.FLOOR
) -> TokenBlocked:
    """The Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1): the reference's bytes."""
    rows, cols = t_NK.shape
    experts = offsets_E.shape[0]
    ends_E = block_ends(offsets_E)
    num_blocks = max_blocks(rows, experts)
    # The rows past the last offset are no block's: no program writes them.
    data = torch.empty(rows, cols, dtype=torch.uint8, device=t_NK.device)
    scales = torch.empty(num_blocks, cols, dtype=torch.uint8, device=t_NK.device)
    if num_blocks and cols and experts:
        bf16 = t_NK.dtype == torch.bfloat16
        x = t_NK.contiguous()
        block_i = min(triton.next_power_of_2(cols), 128)
        with on_device(x):
            _quantize_token_blocks_kernel[(num_blocks, triton.cdiv(cols, block_i))](
                x.view(torch.int16) if bf16 else x,
                data,
                scales,
                offsets_E.contiguous(),
                ends_E,
                experts,
                rows,
                cols,
                BLOCK=BLOCK,
                BLOCK_I=block_i,
                BLOCK_E=max(triton.next_power_of_2(experts), 2),
                CEIL=ScaleRounding(rounding) is ScaleRounding.CEIL,
                BF16_BITS=bf16,
            )
    elif num_blocks:
        scales.zero_()
    return TokenBlocked(data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), offsets_E, ends_E)
