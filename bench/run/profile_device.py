"""``moe-bench profile-device``: measure this device's curves and write a device profile (``devices/*.yaml``).

What is measured, on the device given (``cpu``, or ``cuda``/``cuda:N``), with ``torch.set_num_threads``
set to the threads one real rank uses (``threads``; the project's 2-rank CPU runs use one each):

- ``gemm`` (bf16, fp32): ``torch.mm(a_MK, b_KN)`` for square shapes and a grid of rectangles;
  work = 2 M N K FLOPs, seconds = one call. Shape recorded: (M, N, K). Also ``torch.bmm`` of the
  combine's batched products, shape (B, M, N, K), work 2 B M N K.
- ``grouped_gemm`` (bf16, fp32): the experts' ``moe_engine.moe.grouped_gemm.grouped_mm(x, w, offsets)``,
  x (E * rows, K) @ w (E, K, N) (w stored (E, N, K) and transposed, as ``experts.py`` passes
  ``gate_up_EHD.transpose(1, 2)``), int32 offsets, every group ``rows`` rows; swept over rows per group
  for a few (N, K) and expert counts. work = 2 rows N K (ONE group), seconds = one call / E, as
  ``bench.predict.pricing`` prices a grouped GEMM group by group. Shape recorded: (E, rows, N, K).
- ``attention`` (bf16, fp32): ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (B, H, S, d)
  tensors, d = 64, with autograd on (as in training). Forward points: work = 4 B H S S d / 2 (causal),
  seconds = the forward; backward points: work = 2.5 x the forward FLOPs, seconds = ``out.backward``
  alone (the forward of each backward is run outside the timed region, so this is fwd+bwd minus fwd
  without the noise of a subtraction). The backward points are a curve of their own,
  ``attention_backward``: a CPU's backward runs several times slower per FLOP than its forward.
  Shape recorded: (B, H, S, d).
- ``memory`` (bf16, fp32): ``torch.mul(a, b)`` out of place on tensors of 1 KB to 256 MB each, so the
  small end is per-op overhead and the large end includes the first touch of the freshly allocated
  output, as the engine's own out-of-place ops pay it. work = 3 x numel x element size. bf16 has a
  curve of its own: a CPU computes it through fp32 and moves half the bytes per element.
- Every curve's operands are cold: each call takes the next of several copies filling
  ``Sweep.pool_bytes`` (256 MB by default), as a training step's ops read tensors written long before.
- ``hbm_gbps`` (CPU): the DRAM bandwidth of ``torch.add(a, b, out=c)`` into a preallocated output at
  the two largest memory sizes (no page faults), the better of the two; ``efficiency.memory`` is the
  out-of-place curve's largest point as a fraction of it.
- ``efficiency``: gemm, grouped_gemm, attention = the bf16 curve's largest point against the dense
  peak of the cores the measurement ran on (CPU: peak x threads / cores); launch_overhead_us = the
  smallest memory op; free_op_us (CPU) = a kernel-less ``x.view(-1)`` dispatched from Python;
  host_op_us (CPU) = a tiny engine model's training step divided by the ops it dispatches (the
  host's cost around each op: Python, autograd, the engine's code).
- peaks (CPU): lscpu's cores x clock x FLOPs/cycle of the widest units its flags show (AMX-BF16: 1024
  bf16 FLOPs/cycle/core; AVX-512: 2 FMA units x 16 fp32 lanes x 2). A KVM guest often shows no
  "CPU max MHz"; then the clock is /proc/cpuinfo's, raised to the lowest clock the measured GEMMs
  need when one of their points beats it (a lower bound of the real turbo clock, said so in ``sources``). No FP8
  units on a CPU: fp8 and mxfp8 get the bf16 figure.
- network (CPU): gloo between ``ranks`` local processes (``bench.validate.proxy_check.calibrate_network``,
  alpha from small all-reduces / all-to-alls, bandwidth from the large-minus-small slope), or the
  ``base`` profile's network when one is given.

On a GPU the peaks, ``hbm_gbps``, network and their sources come from an existing profile
(``base``, e.g. ``h200-sxm``); the curves and efficiencies are measured; timings synchronize the
device around each timed batch.

Timing: each point is warmed up (2 calls), then timed ``time.perf_counter`` around batches of calls
(a batch lasts about 1 ms so that a microsecond op is not all timer), median over repeats within a
per-point budget. The default CPU sweep runs in about a minute or two on a 2-core machine. ``--quick``
on a GPU times ``cuda_quick_sweep`` (its seconds by ``estimate_seconds``: bench/gpu-check.sh's header).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from bench.predict.device import DEVICES_DIR, load_profile, profile_from_dict

__all__ = [
    "Sweep",
    "cpu_sweep",
    "cuda_quick_sweep",
    "cuda_sweep",
    "estimate_seconds",
    "profile_device",
    "profile_device_command",
    "timed_points",
    "tiny_sweep",
    "write_profile",
]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


QUICK = {"point_seconds": 0.02, "min_repeats": 3, "max_repeats": 10}
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


def _timed_fp32(sweep: Sweep, dtype: str, flops: float) -> bool:
    return dtype != "fp32" or flops <= sweep.fp32_max_flops


def _grouped_shapes(sweep: Sweep) -> list[tuple[int, int, int, int]]:
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
        size = _DTYPES[dtype].itemsize
        for m, n, k in sweep.gemm_shapes:
            if _timed_fp32(sweep, dtype, 2 * m * n * k):
                out.append(("gemm", dtype, (m, n, k), 2 * m * n * k, (m * k + k * n + m * n) * size))
        for b, m, n, k in sweep.bmm_shapes:
            if _timed_fp32(sweep, dtype, 2 * b * m * n * k):
                out.append(("gemm", dtype, (b, m, n, k), 2 * b * m * n * k, b * (m * k + k * n + m * n) * size))
    for dtype in sweep.dtypes:
        size = _DTYPES[dtype].itemsize
        for e, rows, n, k in _grouped_shapes(sweep):
            if _timed_fp32(sweep, dtype, 2 * e * rows * n * k):
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
        size = _DTYPES[dtype].itemsize
        for s in sweep.attention_seq:
            forward = 2 * b * h * s * s * d
            if _timed_fp32(sweep, dtype, 3.5 * forward):
                out.append(("attention", dtype, (b, h, s, d), forward, 4 * b * h * s * d * size))
                out.append(("attention_backward", dtype, (b, h, s, d), 3.5 * forward, 12 * b * h * s * d * size))
    for dtype in sweep.dtypes:
        out.extend(("memory", dtype, (n,), 0.0, 3 * n * _DTYPES[dtype].itemsize) for n in sweep.memory_numel)
    out.extend(("stream", "fp32", (n,), 0.0, 12 * n) for n in sorted(sweep.memory_numel)[-2:])
    return out


H200_ESTIMATE = {"bf16": 990e12, "fp32": 67e12, "bytes": 4.8e12, "launch_s": 5e-6, "point_overhead_s": 0.01}
"""Rates for sizing a GPU sweep before one has run it: estimates, not measurements. One H200's dense
bf16 tensor-core peak (989 TFLOP/s), its fp32 peak without tensor cores (67 TFLOP/s; the engine leaves
TF32 off), HBM3e bandwidth (4.8 TB/s), a kernel launch (5 us), and per point the making of its operand
copies (up to 256 sets, a few launches each at about 10 us) and Python around the timed batches."""


def estimate_seconds(sweep: Sweep, rates: dict[str, float] = H200_ESTIMATE) -> float:
    """Seconds ``profile_device`` spends timing ``sweep``'s points at ``rates``, as ``_Timer.median``
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


# ---------------------------------------------------------------------------------------- timing


@dataclass
class _Timer:
    device: torch.device
    sweep: Sweep

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[Any], Any], setup: Callable[[], Any] | None = None) -> float:
        """Median seconds of one ``fn(setup())`` (``setup`` untimed), after warm-up."""
        setup = setup or (lambda: None)
        for _ in range(2):
            fn(setup())
        self.sync()
        arg = setup()
        self.sync()
        start = time.perf_counter()
        fn(arg)
        self.sync()
        single = max(time.perf_counter() - start, 1e-9)
        batch = max(1, int(self.sweep.batch_seconds / single))
        repeats = int(self.sweep.point_seconds / (single * batch))
        repeats = min(self.sweep.max_repeats, max(self.sweep.min_repeats, repeats))
        times = []
        for _ in range(repeats):
            args = [setup() for _ in range(batch)]
            self.sync()
            start = time.perf_counter()
            for a in args:
                fn(a)
            self.sync()
            times.append((time.perf_counter() - start) / batch)
            del args
        return statistics.median(times)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _point(work: float, seconds: float, shape: Sequence[int], **extra: Any) -> dict[str, Any]:
    return {"work": work, "seconds": _sig(seconds), "shape": [int(s) for s in shape], **extra}


def _sorted(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(points, key=lambda p: (p["work"], p["shape"]))


def _cold(timer: _Timer, make: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A setup that hands out operand sets in turn from copies filling ``sweep.pool_bytes`` (at least 2)."""
    first = make()
    each = sum(t.numel() * t.element_size() for t in first)
    pool = [first] + [make() for _ in range(max(1, min(255, timer.sweep.pool_bytes // max(each, 1))))]
    turn = itertools.count()
    return lambda: pool[next(turn) % len(pool)]


# ---------------------------------------------------------------------------------------- curves


def gemm_points(timer: _Timer, dtype: str, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    points = []
    for m, n, k in timer.sweep.gemm_shapes:
        if not _timed_fp32(timer.sweep, dtype, 2 * m * n * k):
            continue
        operands = _cold(
            timer,
            lambda: (
                torch.randn(m, k, dtype=_DTYPES[dtype], device=timer.device),
                torch.randn(k, n, dtype=_DTYPES[dtype], device=timer.device),
            ),
        )
        seconds = timer.median(lambda ab: torch.mm(*ab), setup=operands)
        work = 2 * m * n * k
        points.append(_point(work, seconds, (m, n, k)))
        progress(f"  gemm {dtype} {m}x{n}x{k}: {seconds * 1e6:.1f} us, {work / seconds / 1e12:.3f} TFLOP/s")
    for batch, m, n, k in timer.sweep.bmm_shapes:
        if not _timed_fp32(timer.sweep, dtype, 2 * batch * m * n * k):
            continue
        operands = _cold(
            timer,
            lambda: (
                torch.randn(batch, m, k, dtype=_DTYPES[dtype], device=timer.device),
                torch.randn(batch, k, n, dtype=_DTYPES[dtype], device=timer.device),
            ),
        )
        seconds = timer.median(lambda ab: torch.bmm(*ab), setup=operands)
        work = 2 * batch * m * n * k
        points.append(_point(work, seconds, (batch, m, n, k)))
        progress(f"  bmm {dtype} {batch}x{m}x{n}x{k}: {seconds * 1e6:.1f} us")
    return _sorted(points)


def grouped_gemm_points(timer: _Timer, dtype: str, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    from moe_engine.moe.grouped_gemm import grouped_mm

    sweep = timer.sweep
    points = []
    for experts, rows, n, k in _grouped_shapes(sweep):
        if not _timed_fp32(sweep, dtype, 2 * experts * rows * n * k):
            continue
        offsets = torch.arange(1, experts + 1, dtype=torch.int32, device=timer.device) * rows
        operands = _cold(
            timer,
            lambda: (
                torch.randn(experts * rows, k, dtype=_DTYPES[dtype], device=timer.device),
                torch.randn(experts, n, k, dtype=_DTYPES[dtype], device=timer.device).transpose(1, 2),
            ),
        )
        seconds = timer.median(lambda xw, o=offsets: grouped_mm(*xw, o), setup=operands) / experts
        work = 2 * rows * n * k
        points.append(_point(work, seconds, (experts, rows, n, k)))
        progress(
            f"  grouped_gemm {dtype} E={experts} rows={rows} N={n} K={k}: "
            f"{seconds * 1e6:.1f} us/group, {work / seconds / 1e12:.3f} TFLOP/s"
        )
    return _sorted(points)


def attention_points(
    timer: _Timer, dtype: str, progress: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The forward curve and the backward curve (a CPU's backward runs several times slower per FLOP)."""
    sweep = timer.sweep
    b, h = sweep.attention_batch_heads
    d = sweep.attention_head_dim
    forward_points, backward_points = [], []
    for s in sweep.attention_seq:
        if not _timed_fp32(sweep, dtype, 3.5 * 2 * b * h * s * s * d):
            continue
        grad = torch.randn(b, h, s, d, dtype=_DTYPES[dtype], device=timer.device)
        qkv = _cold(
            timer, lambda: tuple(torch.randn(b, h, s, d, dtype=_DTYPES[dtype], device=timer.device) for _ in range(3))
        )

        def leaves():
            return [t.detach().requires_grad_() for t in qkv()]

        def forward(args):
            return F.scaled_dot_product_attention(*args, is_causal=True)

        with torch.enable_grad():
            fwd_s = timer.median(forward, setup=leaves)
            bwd_s = timer.median(lambda out, g=grad: out.backward(g), setup=lambda: forward(leaves()))
        fwd_work = 2 * b * h * s * s * d  # 4 B H S S d, halved by the causal mask
        bwd_work = 5 * fwd_work // 2  # 2.5 x the forward
        forward_points.append(_point(fwd_work, fwd_s, (b, h, s, d)))
        backward_points.append(_point(bwd_work, bwd_s, (b, h, s, d)))
        progress(
            f"  attention {dtype} B={b} H={h} S={s} d={d}: fwd {fwd_s * 1e6:.1f} us "
            f"({fwd_work / fwd_s / 1e12:.3f} TFLOP/s), bwd {bwd_s * 1e6:.1f} us "
            f"({bwd_work / bwd_s / 1e12:.3f} TFLOP/s)"
        )
    return _sorted(forward_points), _sorted(backward_points)


def memory_points(timer: _Timer, dtype: str, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Out-of-place ``torch.mul`` of two operands of each size, cold (``_cold``), in ``dtype``."""
    points = []
    for numel in timer.sweep.memory_numel:
        operands = _cold(
            timer,
            lambda: (
                torch.randn(numel, dtype=_DTYPES[dtype], device=timer.device),
                torch.randn(numel, dtype=_DTYPES[dtype], device=timer.device),
            ),
        )
        seconds = timer.median(lambda ab: torch.mul(*ab), setup=operands)
        work = 3 * numel * _DTYPES[dtype].itemsize
        points.append(_point(work, seconds, (numel,)))
        progress(
            f"  memory mul {dtype} {numel} elements ({work} bytes): {seconds * 1e6:.2f} us, "
            f"{work / seconds / 1e9:.2f} GB/s"
        )
    return _sorted(points)


def stream_gbps(timer: _Timer, progress: Callable[[str], None]) -> tuple[float, int]:
    """Bandwidth of ``torch.add(a, b, out=c)`` (preallocated) at the two largest memory sizes: the best, its numel."""
    best = (0.0, 0)
    for numel in sorted(timer.sweep.memory_numel)[-2:]:
        a, b, c = (torch.randn(numel, device=timer.device) for _ in range(3))
        seconds = timer.median(lambda _, a=a, b=b, c=c: torch.add(a, b, out=c))
        gbps = 3 * numel * a.element_size() / seconds / 1e9
        progress(f"  memory add out= {numel} elements: {gbps:.2f} GB/s")
        best = max(best, (gbps, numel))
    return best


def free_op_seconds(timer: _Timer) -> float:
    """Median seconds of ``x.view(-1)`` (no kernel), from batches of calls."""
    x = torch.randn(16, 16, device=timer.device)
    calls = timer.sweep.free_op_calls
    batch = max(1, calls // 10)
    for _ in range(batch):
        x.view(-1)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(batch):
            x.view(-1)
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def host_op_seconds(timer: _Timer, steps: int = 30) -> tuple[float, int]:
    """Seconds per dispatched op of a training step of a tiny model of the engine (one process): what a
    host spends around each op (Python, autograd, the engine's own code) when the kernels cost nothing.

    Returns (median step seconds / ops, ops per step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
    from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    config = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        seq_len=16,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=16),
    )
    parallel = ParallelConfig()
    trainer = ParallelTrainer(build_rank_model(config, parallel, None, timer.device, 0), parallel, None)
    tokens = torch.randint(0, 64, (2, 16), device=timer.device)
    for _ in range(3):
        trainer.step(tokens, tokens)
    count = Count()
    with count:
        trainer.step(tokens, tokens)
    times = []
    for _ in range(steps):
        timer.sync()
        start = time.perf_counter()
        trainer.step(tokens, tokens)
        timer.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / count.ops, count.ops


# ---------------------------------------------------------------------------------------- this CPU


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(
            ["lscpu"], check=False, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"), timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            out[key.strip()] = value.strip()
    return out


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if ":" in line:
                key, value = line.split(":", 1)
                out.setdefault(key.strip(), value.strip())
    except OSError:
        return {}  # no /proc here: the caller falls back to what platform reports
    return out


@dataclass
class CpuSpec:
    """What lscpu says about this CPU, and the FLOPs/cycle per core its flags imply."""

    model: str
    cores: int
    ghz: float
    ghz_source: str
    flops_per_cycle: dict[str, int]
    units: dict[str, str]
    memory_gb: float
    notes: list[str] = field(default_factory=list)


def cpu_spec() -> CpuSpec:
    info, proc = _lscpu(), _cpuinfo()
    model = info.get("Model name") or proc.get("model name") or platform.processor() or platform.machine()
    try:
        cores = int(info["Core(s) per socket"]) * int(info.get("Socket(s)", "1"))
    except (KeyError, ValueError):
        cores = os.cpu_count() or 1
    flags = set((info.get("Flags") or proc.get("flags") or "").split())
    if info.get("CPU max MHz"):
        ghz, ghz_source = float(info["CPU max MHz"]) / 1000, f"lscpu 'CPU max MHz' {info['CPU max MHz']}"
    elif m := re.search(r"@\s*([\d.]+)\s*GHz", model):
        ghz, ghz_source = float(m.group(1)), f"the model name's '@ {m.group(1)}GHz' (lscpu shows no 'CPU max MHz')"
    elif proc.get("cpu MHz"):
        ghz = float(proc["cpu MHz"]) / 1000
        ghz_source = (
            f"/proc/cpuinfo 'cpu MHz' {proc['cpu MHz']} (lscpu shows no 'CPU max MHz'; likely the nominal/TSC clock)"
        )
    else:
        ghz, ghz_source = 1.0, "no clock found (lscpu, /proc/cpuinfo); 1 GHz assumed"
    if "avx512f" in flags:
        fp32, fp32_unit = 64, "avx512f: 2 FMA units x 16 fp32 lanes x 2 FLOPs"
    elif "avx2" in flags and "fma" in flags:
        fp32, fp32_unit = 32, "avx2+fma: 2 FMA units x 8 fp32 lanes x 2 FLOPs"
    elif "avx" in flags:
        fp32, fp32_unit = 16, "avx: 8 fp32 lanes x (1 add + 1 mul)"
    else:
        fp32, fp32_unit = 8, "sse: 4 fp32 lanes x (1 add + 1 mul)"
    if "amx_bf16" in flags:
        bf16, bf16_unit = 1024, "amx_bf16: one AMX TMUL per core, TDPBF16PS 16x16x32 (16384 FLOPs) every 16 cycles"
    elif "avx512_bf16" in flags:
        bf16, bf16_unit = 128, "avx512_bf16: 2 units x VDPBF16PS 16 lanes x 2 pairs x 2 FLOPs"
    else:
        bf16, bf16_unit = fp32, "no bf16 units in the flags: bf16 runs at the fp32 rate"
    memory_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gb = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        memory_gb = 0.0  # no /proc/meminfo: sysconf below
    if memory_gb <= 0:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return CpuSpec(
        model, cores, ghz, ghz_source, {"fp32": fp32, "bf16": bf16}, {"fp32": fp32_unit, "bf16": bf16_unit}, memory_gb
    )


# ---------------------------------------------------------------------------------------- profile


def _rate(point: dict[str, Any]) -> float:
    return point["work"] / point["seconds"]


def _largest(points: list[dict[str, Any]]) -> dict[str, Any]:
    return max(points, key=lambda p: (p["work"], -p["seconds"]))


def _neighbour(threads: int, stop) -> None:
    """Another rank's load on a shared host: training steps of a CPU-sized model of the engine (the
    smoke suite's 8-expert model, 1024 tokens a step), until told to stop."""
    torch.set_num_threads(threads)
    from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, Precision
    from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

    config = ModelConfig(
        vocab_size=1024,
        d_model=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=256,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=128),
        dtype=Precision.BF16,
    )
    parallel = ParallelConfig()
    trainer = ParallelTrainer(build_rank_model(config, parallel, None, torch.device("cpu"), 1), parallel, None)
    tokens = torch.randint(0, 1024, (4, 256))
    while not stop.is_set():
        trainer.step(tokens, tokens)


class _Neighbours:
    """``count`` processes loading the host as the other ranks of a CPU run would, while it is measured."""

    def __init__(self, count: int, threads: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.processes = [
            context.Process(target=_neighbour, args=(threads, self.stop), daemon=True) for _ in range(count)
        ]

    def __enter__(self) -> _Neighbours:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _base_network(base: Any, sources: dict[str, str]) -> dict[str, float]:
    """The network of the ``base`` profile, its sources added to ``sources``."""
    for k in base.network:
        sources[f"network.{k}"] = f"copied from {base.name}: {base.sources[f'network.{k}']}"
    return dict(base.network)


def _fraction(value: float) -> float:
    return _sig(min(1.0, max(value, 1e-6)), 3)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def profile_device(
    device: str = "cpu",
    threads: int = 1,
    name: str | None = None,
    progress: Callable[[str], None] = print,
    base: str | None = None,
    ranks: int = 2,
    sweep: Sweep | None = None,
    network: dict[str, float] | None = None,
    command: str | None = None,
    load: bool = True,
    quick: bool = False,
) -> dict[str, Any]:
    """Measure ``device`` and return its profile as a dict (``bench.predict.device.profile_from_dict`` form).

    ``threads``: ``torch.set_num_threads`` during the measurement (the threads one rank uses; restored
    after). ``name``: the profile's name (default ``cpu-<cores>core``, or ``<base>-measured``).
    ``base``: an existing profile (name or path) whose network is copied with its sources, on a GPU
    its peaks and hbm_gbps too; required on a GPU; on a CPU it stands in for the gloo calibration.
    ``ranks``: processes one host runs (network.gpus_per_node; the gloo calibration runs that many).
    ``sweep``: sizes (default ``cpu_sweep``/``cuda_sweep``).
    ``network``: an already measured ``calibrate_network`` result ({"latency_us", "gbps"}) instead of
    measuring one. ``command``: what to record as ``measured.command``. ``load``: on a CPU, run the
    measurement while ``ranks - 1`` neighbour processes load the host (``_neighbour``), as a rank of a
    multi-rank CPU run shares it. ``quick``: ``QUICK``'s timing instead of the sweep's; on a GPU the default
    sweep is then ``cuda_quick_sweep``.
    """
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"profile-device: device must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and base is None:
        raise ValueError("profile-device: on a GPU give base=<profile> (e.g. h200-sxm) for the peaks and network")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    base_profile = load_profile(base) if base else None
    if sweep is None:
        sweep = cpu_sweep() if dev.type == "cpu" else cuda_quick_sweep() if quick else cuda_sweep()
    if quick:
        sweep = dataclasses.replace(sweep, **QUICK)
    timer = _Timer(dev, sweep)
    started = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # On a CPU host the other ranks share the cores' caches and memory bandwidth: measure under their load.
    neighbours = _Neighbours(ranks - 1 if dev.type == "cpu" and load else 0, threads)
    try:
        neighbours.__enter__()
        progress(
            f"profile-device: {dev}, {threads} thread(s), {len(neighbours.processes)} neighbour rank(s) loading the host"
        )
        curves: dict[str, dict[str, list]] = {
            "gemm": {},
            "grouped_gemm": {},
            "attention": {},
            "attention_backward": {},
            "memory": {},
        }
        for dtype in sweep.dtypes:
            progress(f"gemm {dtype}")
            curves["gemm"][dtype] = gemm_points(timer, dtype, progress)
        for dtype in sweep.dtypes:
            progress(f"grouped_gemm {dtype}")
            curves["grouped_gemm"][dtype] = grouped_gemm_points(timer, dtype, progress)
        for dtype in sweep.dtypes:
            progress(f"attention {dtype}")
            curves["attention"][dtype], curves["attention_backward"][dtype] = attention_points(timer, dtype, progress)
        progress("memory")
        for dtype in sweep.dtypes:
            curves["memory"][dtype] = memory_points(timer, dtype, progress)
        stream, stream_numel = stream_gbps(timer, progress)
        if dev.type == "cpu":  # a GPU profile prices neither: its host queues kernels ahead of the device
            free_us = free_op_seconds(timer) * 1e6
            progress(f"free op x.view(-1): {free_us:.3f} us")
            host_s, host_ops = host_op_seconds(timer)
            progress(f"host time per op of a tiny training step ({host_ops} ops): {host_s * 1e6:.2f} us")
    finally:
        neighbours.__exit__()
        torch.set_num_threads(old_threads)
    # A sweep's fp32 cap can leave a curve without points; the profile has no such curve then.
    curves = {kind: {d: points for d, points in by_dtype.items() if points} for kind, by_dtype in curves.items()}
    if network is None and base_profile is None:
        from bench.validate.proxy_check import calibrate_network

        progress(f"network: gloo between {ranks} local processes")
        network = calibrate_network(ranks, progress)
        network_source = f"gloo between {ranks} local processes (bench.validate.netcal via calibrate_network)"
    else:
        network_source = "the gloo calibration passed in (a bench.validate.netcal result)"
    elapsed = time.perf_counter() - started

    today = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    stamp = f"measured by moe-bench profile-device on {today}"
    torch_version = str(torch.__version__)
    main_dtype = "bf16" if "bf16" in sweep.dtypes else sweep.dtypes[0]
    sources: dict[str, str] = {}

    if dev.type == "cpu":
        spec = cpu_spec()
        used = min(threads, spec.cores)
        # The clock: lscpu's, unless the measured GEMMs need a faster one (a guest that shows only its
        # nominal clock); then the lowest clock that explains them.
        best = {
            d: max((p for k in ("gemm", "grouped_gemm") for p in curves[k].get(d, [])), key=_rate) for d in sweep.dtypes
        }
        needed = {d: _rate(best[d]) / (used * spec.flops_per_cycle[d] * 1e9) for d in sweep.dtypes}
        ghz, ghz_note = spec.ghz, spec.ghz_source
        fastest = max(needed, key=needed.get)
        if needed[fastest] > ghz:
            ghz = needed[fastest]
            ghz_note = (
                f"{spec.ghz_source}, raised to {ghz:.3f} GHz: the fastest measured {fastest} GEMM point "
                f"(shape {best[fastest]['shape']}, {_rate(best[fastest]) / 1e12:.4f} TFLOP/s on {used} "
                f"thread(s)) needs at least that clock at {spec.flops_per_cycle[fastest]} FLOPs/cycle/core, "
                f"so this is a lower bound of the running (turbo) clock"
            )
        peak = {d: spec.cores * ghz * spec.flops_per_cycle[d] / 1e3 for d in ("fp32", "bf16")}
        peak_tflops = {
            "fp32": _sig(peak["fp32"]),
            "bf16": _sig(peak["bf16"]),
            "fp8": _sig(peak["bf16"]),
            "mxfp8": _sig(peak["bf16"]),
        }
        for d in ("fp32", "bf16"):
            sources[f"peak_tflops.{d}"] = (
                f"lscpu: {spec.cores} cores x {ghz:.3f} GHz x {spec.flops_per_cycle[d]} {d} FLOPs/cycle/core "
                f"({spec.units[d]}); clock: {ghz_note}"
                + (
                    ". The FMA-unit count is not in the flags; 2 is assumed (server Xeon/EPYC cores)"
                    if spec.flops_per_cycle[d] == spec.flops_per_cycle["fp32"]
                    else ""
                )
            )
        for d in ("fp8", "mxfp8"):
            sources[f"peak_tflops.{d}"] = (
                "lscpu: this CPU has no FP8 units (no FP8 AMX/AVX flags); FP8/MXFP8 "
                "GEMMs run dequantized, so the bf16 figure is given"
            )
        scale = used / spec.cores  # the measurement ran on `used` of the cores
        memory_gb = _sig(spec.memory_gb)
        sources["memory_gb"] = (
            f"/proc/meminfo: MemTotal {spec.memory_gb * 1e9 / 1024:.0f} kB x 1024 bytes / 1e9, the "
            "physical RAM the kernel sees"
        )
        hbm = _sig(stream)
        sources["hbm_gbps"] = (
            f"{stamp}: DRAM bandwidth of torch.add(a, b, out=c) into a preallocated fp32 "
            f"output, {stream_numel} elements per operand (the best of the two largest memory "
            f"sizes), 3 x numel x 4 bytes / median seconds, {threads} thread(s)"
        )
        if network is None:  # a base was given and no calibration: its network, as on a GPU
            net = _base_network(base_profile, sources)
        else:
            net = {
                "gpus_per_node": int(ranks),
                "intra_node_gbps": _sig(network["gbps"]),
                "inter_node_gbps": _sig(network["gbps"]),
                "latency_us": _sig(network["latency_us"]),
            }
            sources["network.gpus_per_node"] = f"the ranks one host runs here ({ranks}, one process per rank)"
            sources["network.intra_node_gbps"] = (
                f"{stamp}: {network_source}: bandwidth from the slope between "
                "1 KB and 16 MB all-reduces and all-to-alls"
            )
            sources["network.inter_node_gbps"] = f"no second host: the same gloo figure as intra_node_gbps ({stamp})"
            sources["network.latency_us"] = f"{stamp}: {network_source}: alpha from 1 KB all-reduces and all-to-alls"
        description = (
            f"{spec.model}, {spec.cores} cores, {memory_gb} GB RAM (measured with {threads} "
            f"thread(s) per rank, {ranks} ranks per host)"
        )
        machine = {"cpu": spec.model, "cores": spec.cores, "torch": torch_version, "platform": platform.platform()}
        kind = "cpu"
        default_name = f"cpu-{spec.cores}core"
    else:
        props = torch.cuda.get_device_properties(dev)
        peak_tflops = dict(base_profile.peak_tflops)
        scale = 1.0
        for key, text in base_profile.sources.items():
            sources[key] = text
        for d in peak_tflops:
            sources[f"peak_tflops.{d}"] = f"copied from {base_profile.name}: {base_profile.sources[f'peak_tflops.{d}']}"
        memory_gb = _sig(props.total_memory / 1e9)
        sources["memory_gb"] = f"{stamp}: torch.cuda.get_device_properties({dev}).total_memory / 1e9"
        hbm = base_profile.hbm_gbps
        sources["hbm_gbps"] = (
            f"copied from {base_profile.name}: {base_profile.sources['hbm_gbps']} (measured here: "
            f"{stream:.0f} GB/s by torch.add out= at {stream_numel} elements)"
        )
        net = _base_network(base_profile, sources)
        description = f"{props.name}, {memory_gb} GB (curves measured; peaks and network from {base_profile.name})"
        machine = {
            "gpu": props.name,
            "cpu": cpu_spec().model,
            "cores": os.cpu_count(),
            "torch": torch_version,
            "cuda": torch.version.cuda,
        }
        kind = "gpu"
        default_name = f"{base_profile.name}-measured"

    efficiency: dict[str, float] = {}
    for curve_kind in ("gemm", "grouped_gemm", "attention"):
        top = _largest(curves[curve_kind][main_dtype])
        reference = peak_tflops[main_dtype] * 1e12 * scale
        fraction = _rate(top) / reference
        efficiency[curve_kind] = _fraction(fraction)
        others = ", ".join(
            f"{d} {_rate(_largest(curves[curve_kind][d])) / (peak_tflops[d] * 1e12 * scale):.3f}"
            for d in sweep.dtypes
            if d != main_dtype and d in curves[curve_kind]
        )
        capped = " (capped at 1)" if fraction > 1 else ""
        sources[f"efficiency.{curve_kind}"] = (
            f"{stamp}: the {main_dtype} {curve_kind} curve's largest point, shape {top['shape']}, "
            f"{_rate(top) / 1e12:.4f} TFLOP/s against peak_tflops.{main_dtype} x {scale:g} (the cores the "
            f"{threads} thread(s) ran on) = {fraction:.3f}{capped}" + (f"; other dtypes: {others}" if others else "")
        )
    top_mem = _largest(curves["memory"]["fp32"])
    mem_fraction = _rate(top_mem) / (hbm * 1e9)
    efficiency["memory"] = _fraction(mem_fraction)
    sources["efficiency.memory"] = (
        f"{stamp}: out-of-place torch.mul at the fp32 memory curve's largest point ({top_mem['shape'][0]} fp32 elements "
        f"per operand, {_rate(top_mem) / 1e9:.2f} GB/s, including the first touch of its fresh output) against "
        f"hbm_gbps = {mem_fraction:.3f}" + (" (capped at 1)" if mem_fraction > 1 else "")
    )
    smallest_mem = min(curves["memory"]["fp32"], key=lambda p: p["work"])
    efficiency["launch_overhead_us"] = _sig(smallest_mem["seconds"] * 1e6)
    sources["efficiency.launch_overhead_us"] = (
        f"{stamp}: the smallest memory op, out-of-place torch.mul of {smallest_mem['shape'][0]} fp32 elements "
        f"per operand ({smallest_mem['work']} bytes moved), median over batches of calls"
    )
    if kind == "cpu":
        efficiency["free_op_us"] = _sig(free_us)
        sources["efficiency.free_op_us"] = (
            f"{stamp}: x.view(-1) (no kernel) dispatched from Python, median "
            f"over batches of {max(1, sweep.free_op_calls // 10)} calls"
        )
        efficiency["host_op_us"] = _sig(host_s * 1e6)
        sources["efficiency.host_op_us"] = (
            f"{stamp}: median wall time of a training step of a tiny model of the engine (d_model 32, 2 MoE "
            f"layers of 8 experts, 32 tokens, one process) divided by the {host_ops} ops it dispatches"
        )
    sources["curves"] = (
        f"{stamp} on {dev}, {threads} thread(s): medians of time.perf_counter around batches of calls after 2 "
        "warm-up calls (bench/run/profile_device.py docstring: what each kind's work and seconds are)"
    )
    if dev.type == "cuda":
        sources["curves"] += (
            f"; fp32 GEMMs with torch.backends.cuda.matmul.allow_tf32 = "
            f"{torch.backends.cuda.matmul.allow_tf32}, as the engine runs them (it leaves torch's "
            "default, off)"
        )
    if math.isfinite(sweep.fp32_max_flops):
        sources["curves"] += (
            f"; fp32 gemm, grouped_gemm and attention points above {sweep.fp32_max_flops:.4g} "
            "FLOPs a call not timed (a larger fp32 op is priced at the throughput of the nearest "
            "measured one)"
        )

    name = name or default_name
    threads_flag = f" --threads {threads}" if kind == "cpu" else ""
    command = command or (
        f"moe-bench profile-device --device {device}{threads_flag} --name {name}"
        + (f" --base {base}" if base else "")
        + (f" --ranks {ranks}" if kind == "cpu" else "")
        + (" --quick" if quick else "")
    )
    return {
        "schema_version": 1,
        "name": name,
        "description": description,
        "kind": kind,
        "memory_gb": memory_gb,
        "peak_tflops": peak_tflops,
        "hbm_gbps": hbm,
        "network": net,
        "efficiency": efficiency,
        "measured": {
            "date": today,
            "command": command,
            "machine": machine,
            "threads": threads,
            "neighbours": len(neighbours.processes),
            "device": str(dev),
            "seconds": round(elapsed, 1),
            "method": (
                "median seconds over repeated batches of calls (time.perf_counter, device synchronized "
                "around each batch), after 2 warm-up calls; per-point budget "
                f"{sweep.point_seconds} s, {sweep.min_repeats}-{sweep.max_repeats} repeats; operands cold "
                f"(rotating copies of {sweep.pool_bytes >> 20} MiB); {len(neighbours.processes)} neighbour "
                "process(es) loading the host meanwhile with training steps of the engine's CPU-sized "
                "8-expert model, as the other ranks of a CPU run do"
            ),
        },
        "sources": sources,
        "curves": curves,
    }


class _FlowMap(dict):
    """A curve point, written on one line."""


class _Dumper(yaml.SafeDumper):
    """A SafeDumper of its own, so that the one-line representer below does not change PyYAML's."""


_Dumper.add_representer(
    _FlowMap, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", dict(data), flow_style=True)
)


def write_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """Validate ``profile`` (``profile_from_dict``) and write it as YAML to ``path``; returns the path."""
    path = Path(path)
    profile_from_dict(profile, str(path))
    data = dict(profile)
    if data.get("curves"):
        data["curves"] = {
            kind: {dtype: [_FlowMap(p) for p in points] for dtype, points in by_dtype.items()}
            for kind, by_dtype in data["curves"].items()
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Written by moe-bench profile-device ({profile.get('measured', {}).get('command', '')}).\n"
    path.write_text(header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True))
    return path


def profile_device_command(
    device: str = "cpu",
    threads: int = 1,
    name: str | None = None,
    base: str | None = None,
    ranks: int = 2,
    out: str | Path | None = None,
    progress: Callable[[str], None] = print,
    quick: bool = False,
    tiny: bool = False,
) -> Path:
    """What ``moe-bench profile-device`` runs: measure, then write ``out`` (default ``devices/<name>.yaml``).
    ``tiny``: time ``tiny_sweep`` (seconds on a CPU: bench/gpu-check.sh --dry-run)."""
    profile = profile_device(
        device=device,
        threads=threads,
        name=name,
        progress=progress,
        base=base,
        ranks=ranks,
        quick=quick,
        sweep=tiny_sweep() if tiny else None,
    )
    if tiny:
        profile["measured"]["command"] += " --tiny"
    path = write_profile(profile, out or DEVICES_DIR / f"{profile['name']}.yaml")
    progress(f"profile-device: wrote {path} in {profile['measured']['seconds']} s")
    return path
