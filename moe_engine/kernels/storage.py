"""Loads and stores for the Triton kernels that are exact for fp32 and bf16, compiled or interpreted.

Every kernel computes in fp32 and rounds to the storage dtype where the eager composition it
replaces rounds, so that both give the same bits wherever their arithmetic agrees. Triton's
interpreter (3.9, seen on a 2-core CPU machine) rounds fp32 -> bf16 toward zero instead of to
nearest even; so bf16 tensors are handed to the kernels as their int16 bit patterns (``as_bits``) and
converted here with integer operations: widening is a shift, narrowing rounds to nearest even as
torch does (NaN becomes torch's quiet NaN 0x7FC0). On a GPU this costs a few integer operations per
element of kernels bound by memory traffic.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """What a kernel gets for ``t``: bf16 as its int16 bit patterns (same strides), fp32 as is."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@triton.jit
def load_f32(ptr, offsets, mask, BF16: tl.constexpr):
    """Values at ``ptr + offsets`` as fp32 (0 where masked)."""
    if BF16:
        bits = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def round_f32(x, BF16: tl.constexpr):
    """fp32 ``x`` rounded to the storage dtype (to nearest even), still held as fp32."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        rounded = tl.where(x != x, 0x7FC00000, rounded)
        return rounded.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def store_f32(ptr, offsets, x, mask, BF16: tl.constexpr):
    """Store fp32 ``x`` rounded to the storage dtype."""
    if BF16:
        bits = round_f32(x, BF16).to(tl.int32, bitcast=True) >> 16
        tl.store(ptr + offsets, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offsets, x, mask=mask)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on ``t``'s GPU (Triton launches on the current device, which need not be the tensor's)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def programs_for(rows: int, device: torch.device) -> int:
    """Programs for a kernel that walks rows in contiguous runs: a few per streaming multiprocessor on
    CUDA (enough to fill the GPU, few partial sums to add); a handful on CPU under the interpreter."""
    if device.type == "cuda":
        cap = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = 4
    return max(1, min(rows, cap))


def warps_for(block: int) -> int:
    """Warps for a program whose widest vector has ``block`` elements (8 fp32 values per thread), up
    to a block's 32: at 16 warps RMSNorm's backward on rows of 8,192 spilled on sm_90a (64 registers
    a thread), at 32 it uses 44 (``bench.validate.kernel_compile``)."""
    return int(min(32, max(1, triton.next_power_of_2(block // 256))))
