"""Inputs and plain references of the MXFP8 weight gradients (``moe_engine.precision.mxfp8.token_blocks``
and ``wgrad``), shared by their unit tests and their Triton-interpreter test.

The references read the specification the engine's layout stands for, one expert at a time: an expert's
rows, zero-padded to a multiple of 32, quantized along axis 0 by ``blocks.quantize`` (blocks of 32
consecutive rows of that expert only); the GEMM as an fp64 product of the dequantized rows."""

from __future__ import annotations

import torch

from moe_engine.precision.mxfp8.blocks import dequantize, quantize

# name: rows per expert (empty experts, one row, several blocks, an exact multiple of 32), padding rows,
# width, and the width of a weight gradient's other operand (X of an (E, X, width) gradient)
CASES = {
    "uneven": ([5, 0, 37, 64, 1, 0], 6, 48, 40),
    "first-empty-wide": ([0, 70, 33], 3, 96, 40),
    "one-expert": ([40], 0, 32, 40),
    "all-empty": ([0, 0, 0], 5, 16, 40),
    # Wider than a column tile of the quantizer (128) and than an output tile of the GEMM (128 x 128),
    # with experts whose first rows are not on 32-row boundaries.
    "tiles": ([45, 0, 150, 19], 2, 160, 136),
}


def token_operand(counts: list[int], padding: int, width: int, dtype: torch.dtype, seed: int):
    """(t_NK, offsets_E): rows of very different ranges per column and per expert (so that blocks get
    different scales), a zero row, a row past 448 times its block's scale, NaN padding rows."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    t_NK = torch.randn(n + padding, width, generator=g) * torch.logspace(-3, 3, width)
    t_NK[:n] *= torch.logspace(-2, 2, max(n, 1))[:n].unsqueeze(1)
    if n > 2:
        t_NK[1] = 0.0
        t_NK[2] *= 1e4
    t_NK[n:] = float("nan")
    offsets_E = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return t_NK.to(dtype), offsets_E


def _padded_experts(t_NK: torch.Tensor, counts: list[int]):
    start = 0
    for count in counts:
        rows = t_NK[start : start + count].float()
        yield start, count, torch.cat([rows, rows.new_zeros(-count % 32, rows.shape[1])])
        start += count


def expert_blocks(t_NK: torch.Tensor, counts: list[int]):
    """Per expert, (codes of its rows, its scales): its rows zero-padded to a multiple of 32, quantized
    along axis 0 by ``blocks.quantize``."""
    out = []
    for _, count, padded in _padded_experts(t_NK, counts):
        data, scales = quantize(padded, axis=0)
        out.append((data[:count], scales))
    return out


def dequantized_per_expert(t_NK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(N, K) fp64 values of the per-expert quantization (rows past the experts': 0)."""
    values = torch.zeros(t_NK.shape, dtype=torch.float64)
    for start, count, padded in _padded_experts(t_NK, counts):
        values[start : start + count] = dequantize(*quantize(padded, axis=0), axis=0)[:count].double()
    return values


def wgrad_loop(a_NX: torch.Tensor, b_NY: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(E, X, Y) fp64: each expert's dequantized a^T b, one expert at a time."""
    a, b = dequantized_per_expert(a_NX, counts), dequantized_per_expert(b_NY, counts)
    out, start = [], 0
    for count in counts:
        rows = slice(start, start + count)
        out.append(a[rows].t() @ b[rows])
        start += count
    return torch.stack(out)
