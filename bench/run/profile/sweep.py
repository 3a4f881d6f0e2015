"""What ``moe-bench profile-device`` measures: the sweeps of sizes (``Sweep``: the CPU, GPU, quick and tiny
ones), every point a sweep times (``timed_points``), and how long timing them takes (``estimate_seconds``).

Arithmetic on sizes only; the timing is ``bench.run.profile.curves``, what each point's work and seconds are
is in docs/proxies-and-projections.md ("What profile-device measures").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

import torch

__all__ = [
    "DTYPES",
    "H200_ESTIMATE",
    "QUICK",
    "Sweep",
    "cpu_sweep",
    "cuda_quick_sweep",
    "cuda_sweep",
    "estimate_seconds",
    "grouped_shapes",
    "timed_fp32",
    "timed_points",
    "tiny_sweep",
]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The dtypes a sweep may name, by the name profiles use."""


@dataclass(frozen=True)
class Sweep:
    """What sizes are measured, and how long each point may take."""

    gemm_shapes: tuple[tuple[int, int, int], ...]
    """(M, N, K) of ``torch.mm(a_MK, b_KN)``."""
    grouped_rows: tuple[int, ...]
    """Rows per group."""
    grouped_nk: tuple[tuple[int, int], ...]
    """(N, K) of the experts' weights."""
    grouped_experts: tuple[int, ...]
    """Expert (group) counts."""
    grouped_max_rows: int
    """Skip a point whose E x rows exceeds this (keeps the sweep short)."""
    attention_seq: tuple[int, ...]
    """Sequence lengths S."""
    bmm_shapes: tuple[tuple[int, int, int, int], ...] = ()
    """(B, M, N, K) of ``torch.bmm`` points, recorded in the gemm curve with their four sizes."""
    attention_batch_heads: tuple[int, int] = (2, 4)
    """(B, H)."""
    attention_head_dim: int = 64
    memory_numel: tuple[int, ...] = ()
    """Elements of each operand of the memory curves' ``torch.mul``."""
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    point_seconds: float = 0.25
    """Timing budget of one point (after warm-up); at least ``min_repeats`` repeats whatever it costs."""
    min_repeats: int = 3
    max_repeats: int = 30
    batch_seconds: float = 1e-3
    """Calls are timed in batches lasting about this long."""
    free_op_calls: int = 20000
    """Calls of ``x.view(-1)`` timed for free_op_us."""
    pool_bytes: int = 256 << 20
    """Operands rotate through copies filling at least this many bytes, so each call finds them out of
    the caches, as a training step does (its tensors are written long before they are read again)."""
    fp32_max_flops: float = math.inf
    """fp32 gemm, grouped_gemm and attention points whose call exceeds this many FLOPs (attention: its
    forward and backward) are not timed; a curve left without points is left out of the profile."""


def _pow2(lo: int, hi: int, step: int = 1) -> tuple[int, ...]:
    return tuple(1 << k for k in range(lo, hi + 1, step))


def cpu_sweep() -> Sweep:
    """The default sweep for a small CPU (about a minute or two with one thread)."""
    squares = tuple((n, n, n) for n in _pow2(4, 11))  # 16 .. 2048
    # A grid of rectangles: a training step's GEMMs are skinny (a router's N = E, a head's N = V,
    # weight gradients' K = tokens), and pricing takes the throughput of the nearest shape.
    grid = tuple(
        (m, n, k) for m in (8, 64, 256, 1024, 4096) for n in (8, 64, 256, 1024, 4096) for k in (64, 256, 1024, 4096)
    )
    # The combine's batched products: per token, its k expert outputs weighted (1 x k @ k x D), and
    # the two products of its backward.
    batched = tuple(
        (b, m, n, k)
        for b in (1024, 4096, 16384)
        for m, n, k in ((1, 256, 2), (1, 2, 256), (2, 256, 1), (1, 1024, 8), (1, 8, 1024), (8, 1024, 1))
    )
    return Sweep(
        gemm_shapes=squares + tuple(s for s in grid if s not in squares),
        bmm_shapes=batched,
        grouped_rows=_pow2(3, 12),  # 8 .. 4096 rows per group
        grouped_nk=((256, 256), (512, 1024)),
        grouped_experts=(4, 16),
        grouped_max_rows=16384,
        attention_seq=_pow2(6, 11),  # 64 .. 2048
        memory_numel=_pow2(8, 26),  # 1 KB .. 256 MB per fp32 operand
        point_seconds=0.5,
        min_repeats=5,
    )


def cuda_sweep() -> Sweep:
    """The default sweep for a datacenter GPU."""
    squares = tuple((n, n, n) for n in _pow2(5, 14))  # 32 .. 16384
    return Sweep(
        gemm_shapes=squares
        + tuple(
            (m, n, k)
            for m in (128, 1024, 8192, 32768)
            for n in (8, 128, 1024, 4096, 16384)
            for k in (128, 1024, 4096, 16384)
        ),
        bmm_shapes=tuple(
            (b, m, n, k)
            for b in (16384, 65536)
            for m, n, k in ((1, 4096, 4), (1, 4, 4096), (4, 4096, 1), (1, 8192, 8), (1, 8, 8192), (8, 8192, 1))
        ),
        grouped_rows=_pow2(3, 14),  # 8 .. 16384
        grouped_nk=((2048, 7168), (7168, 2048), (1024, 1024)),
        grouped_experts=(8, 32, 128),
        grouped_max_rows=1 << 18,
        attention_seq=_pow2(7, 13),  # 128 .. 8192
        attention_batch_heads=(4, 16),
        memory_numel=_pow2(8, 28),  # 1 KB .. 1 GB per operand
        point_seconds=0.2,
        max_repeats=50,
        free_op_calls=5000,
    )


class _Timing(TypedDict):
    """``Sweep``'s timing fields, typed so that ``**QUICK`` checks against them."""

    point_seconds: float
    min_repeats: int
    max_repeats: int


QUICK: _Timing = {"point_seconds": 0.02, "min_repeats": 3, "max_repeats": 10}
"""``--quick``'s timing: a check within a fixed device budget (bench/gpu-check.sh)."""


def cuda_quick_sweep() -> Sweep:
    """``--quick`` on a GPU: sized by ``estimate_seconds`` to fit bench/gpu-check.sh's profile step.

    What the projection of the gpu suite prices on the curves (``bench.predict.pricing``): bf16 GEMMs
    of 32,768-token microbatches (M or K = 32,768; the others 512 to 50,304), the combine's batched
    products, bf16 grouped GEMMs of 8 experts at 16,384 rows and 128 at 1,024 (N, K of 1,024 and
    2,048), attention over 8 x 16 heads of 4,096 tokens (550 GFLOP forward) and memory passes of
    every size. Its only fp32 GEMMs are the router's (32,768 x E x 2,048 and its two gradients,
    17.2 GFLOP at E = 128); the engine leaves TF32 off, so they run on the CUDA cores (about 67
    TFLOP/s), where the larger fp32 products of the full sweep take seconds and price nothing the
    suite runs: fp32 stops at 2^36 FLOPs (1 ms there), past the router's shapes and their grid
    neighbours. fp32 memory passes stay (the optimizer's, and ``efficiency.memory``). The nearest
    measured shape prices the rest, at its throughput.
    """
    squares = tuple((n, n, n) for n in _pow2(6, 14, 2))  # 64 .. 16384
    sizes = (8, 128, 512, 2048, 32768)
    grid = tuple((m, n, k) for m in sizes for n in sizes for k in sizes)
    return Sweep(
        gemm_shapes=squares + tuple(s for s in grid if s not in squares),
        bmm_shapes=tuple((32768, m, n, k) for m, n, k in ((1, 2048, 4), (1, 4, 2048), (4, 2048, 1))),
        grouped_rows=_pow2(4, 14, 2),  # 16 .. 16384
        grouped_nk=((2048, 2048), (1024, 2048), (2048, 1024)),
        grouped_experts=(8, 128),
        grouped_max_rows=1 << 17,
        attention_seq=_pow2(7, 13),  # 128 .. 8192
        attention_batch_heads=(4, 16),
        memory_numel=_pow2(8, 28),  # 1 KB .. 1 GB per fp32 operand
        free_op_calls=5000,
        fp32_max_flops=2.0**36,
        **QUICK,
    )


def tiny_sweep() -> Sweep:
    """A sweep of a few seconds, for tests."""
    return Sweep(
        gemm_shapes=((16, 16, 16), (32, 64, 48), (64, 32, 128)),
        bmm_shapes=((64, 1, 32, 2),),
        grouped_rows=(8, 32),
        grouped_nk=((32, 64),),
        grouped_experts=(2, 4),
        grouped_max_rows=1024,
        attention_seq=(32, 64),
        attention_batch_heads=(1, 2),
        attention_head_dim=16,
        memory_numel=(256, 4096, 65536),
        point_seconds=0.01,
        min_repeats=2,
        max_repeats=5,
        batch_seconds=2e-4,
        free_op_calls=500,
        pool_bytes=1 << 20,
    )


def timed_fp32(sweep: Sweep, dtype: str, flops: float) -> bool:
    return dtype != "fp32" or flops <= sweep.fp32_max_flops


def grouped_shapes(sweep: Sweep) -> list[tuple[int, int, int, int]]:
    """(E, rows, N, K) of the grouped GEMM points, in the order they are timed."""
    return [
        (e, rows, n, k)
        for n, k in sweep.grouped_nk
        for e in sweep.grouped_experts
        for rows in sweep.grouped_rows
        if e * rows <= sweep.grouped_max_rows
    ]


def timed_points(sweep: Sweep) -> list[tuple[str, str, tuple[int, ...], float, float]]:
    """Every point ``profile_device`` times with ``sweep``, in order: (kind, dtype, shape, FLOPs, bytes)
    of one timed call (an attention backward's FLOPs include the forward each call needs first)."""
    out: list[tuple[str, str, tuple[int, ...], float, float]] = []
    for dtype in sweep.dtypes:
        size = DTYPES[dtype].itemsize
        for m, n, k in sweep.gemm_shapes:
            if timed_fp32(sweep, dtype, 2 * m * n * k):
                out.append(("gemm", dtype, (m, n, k), 2 * m * n * k, (m * k + k * n + m * n) * size))
        for b, m, n, k in sweep.bmm_shapes:
            if timed_fp32(sweep, dtype, 2 * b * m * n * k):
                out.append(("gemm", dtype, (b, m, n, k), 2 * b * m * n * k, b * (m * k + k * n + m * n) * size))
    for dtype in sweep.dtypes:
        size = DTYPES[dtype].itemsize
        for e, rows, n, k in grouped_shapes(sweep):
            if timed_fp32(sweep, dtype, 2 * e * rows * n * k):
                out.append(
                    (
                        "grouped_gemm",
                        dtype,
                        (e, rows, n, k),
                        2 * e * rows * n * k,
                        e * (rows * k + n * k + rows * n) * size,
                    )
                )
    b, h = sweep.attention_batch_heads
    d = sweep.attention_head_dim
    for dtype in sweep.dtypes:
        size = DTYPES[dtype].itemsize
        for s in sweep.attention_seq:
            forward = 2 * b * h * s * s * d
            if timed_fp32(sweep, dtype, 3.5 * forward):
                out.append(("attention", dtype, (b, h, s, d), forward, 4 * b * h * s * d * size))
                out.append(("attention_backward", dtype, (b, h, s, d), 3.5 * forward, 12 * b * h * s * d * size))
    for dtype in sweep.dtypes:
        out.extend(("memory", dtype, (n,), 0.0, 3 * n * DTYPES[dtype].itemsize) for n in sweep.memory_numel)
    out.extend(("stream", "fp32", (n,), 0.0, 12 * n) for n in sorted(sweep.memory_numel)[-2:])
    return out


H200_ESTIMATE = {"bf16": 990e12, "fp32": 67e12, "bytes": 4.8e12, "launch_s": 5e-6, "point_overhead_s": 0.01}
"""Rates for sizing a GPU sweep before one has run it: estimates, not measurements. One H200's dense
bf16 tensor-core peak (989 TFLOP/s), its fp32 peak without tensor cores (67 TFLOP/s; the engine leaves
TF32 off), HBM3e bandwidth (4.8 TB/s), a kernel launch (5 us), and per point the making of its operand
copies (up to 256 sets, a few launches each at about 10 us) and Python around the timed batches."""


def estimate_seconds(sweep: Sweep, rates: dict[str, float] = H200_ESTIMATE) -> float:
    """Seconds ``profile_device`` spends timing ``sweep``'s points at ``rates``, as ``bench.run.profile.curves.Timer.median``
    spends them: each call at its FLOPs or bytes at peak (at least a launch), 3 calls of warm-up and
    sizing, then repeats of batches of about ``batch_seconds`` within ``point_seconds``, clamped to
    ``min_repeats``..``max_repeats``."""
    total = 0.0
    for _kind, dtype, _shape, flops, nbytes in timed_points(sweep):
        call = max(flops / rates[dtype], nbytes / rates["bytes"], rates["launch_s"])
        batch = max(call, sweep.batch_seconds)
        timed = min(max(sweep.point_seconds, sweep.min_repeats * batch), sweep.max_repeats * batch)
        total += 3 * call + timed + rates["point_overhead_s"]
    return total
