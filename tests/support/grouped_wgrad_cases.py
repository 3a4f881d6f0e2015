"""Inputs and the plain reference of ``moe_engine::grouped_wgrad_accumulate``, shared by its unit tests and
its Triton-interpreter test."""

from __future__ import annotations

import torch


def wgrad_case(
    counts: list[int], m: int, k: int, dtype: torch.dtype, seed: int, padding: int, a_width: int | None = None
):
    """(a_NM, b_NK, offsets_E, out_EMK): ``padding`` NaN rows after the last offset (any that is read
    shows), a non-zero fp32 out; with ``a_width`` > m, a_NM is a column slice of wider rows."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    a_storage = torch.randn(n + padding, a_width or m, generator=g)
    b_NK = torch.randn(n + padding, k, generator=g)
    a_storage[n:], b_NK[n:] = float("nan"), float("nan")
    offsets_E = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    out_EMK = torch.randn(len(counts), m, k, generator=g) * 4
    return a_storage.to(dtype)[:, :m], b_NK.to(dtype), offsets_E, out_EMK


def wgrad_loop(a_NM: torch.Tensor, b_NK: torch.Tensor, counts: list[int], out_EMK: torch.Tensor) -> torch.Tensor:
    """out + each group's a^T b, one group at a time in fp64."""
    want = out_EMK.double().cpu().clone()
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        want[e] += a_NM[rows].double().cpu().t() @ b_NK[rows].double().cpu()
        start += count
    return want
