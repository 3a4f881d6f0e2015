"""``moe-bench profile-device``'s measurements: the timer (``Timer``: warm-up, batches of calls, the median),
cold operands, and each curve's points (GEMM, grouped GEMM, attention, memory), the DRAM stream bandwidth,
a free op and the host's time per op of a tiny training step.

What each point's work and seconds are: docs/proxies-and-projections.md, "What profile-device measures".
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench.run.profile.sweep import DTYPES, Sweep, grouped_shapes, timed_fp32
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.moe.grouped_gemm import grouped_mm
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

logger = logging.getLogger(__name__)

__all__ = [
    "Timer",
    "attention_points",
    "free_op_seconds",
    "gemm_points",
    "grouped_gemm_points",
    "host_op_seconds",
    "memory_points",
    "round_significant",
    "stream_gbps",
]


@dataclass
class Timer:
    """Times calls on ``device`` within ``sweep``'s budget per point."""

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


def round_significant(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits, as a profile records its figures."""
    return float(f"{x:.{digits}g}")


def _point(work: float, seconds: float, shape: Sequence[int], **extra: Any) -> dict[str, Any]:
    return {"work": work, "seconds": round_significant(seconds), "shape": [int(s) for s in shape], **extra}


def _sorted(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(points, key=lambda p: (p["work"], p["shape"]))


def _cold(timer: Timer, make: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A setup that hands out operand sets in turn from copies filling ``sweep.pool_bytes`` (at least 2)."""
    first = make()
    each = sum(t.numel() * t.element_size() for t in first)
    pool = [first] + [make() for _ in range(max(1, min(255, timer.sweep.pool_bytes // max(each, 1))))]
    turn = itertools.count()
    return lambda: pool[next(turn) % len(pool)]


def gemm_points(timer: Timer, dtype: str) -> list[dict[str, Any]]:
    points = []
    for m, n, k in timer.sweep.gemm_shapes:
        if not timed_fp32(timer.sweep, dtype, 2 * m * n * k):
            continue
        operands = _cold(
            timer,
            lambda: (
                torch.randn(m, k, dtype=DTYPES[dtype], device=timer.device),
                torch.randn(k, n, dtype=DTYPES[dtype], device=timer.device),
            ),
        )
        seconds = timer.median(lambda ab: torch.mm(*ab), setup=operands)
        work = 2 * m * n * k
        points.append(_point(work, seconds, (m, n, k)))
        logger.info(f"  gemm {dtype} {m}x{n}x{k}: {seconds * 1e6:.1f} us, {work / seconds / 1e12:.3f} TFLOP/s")
    for batch, m, n, k in timer.sweep.bmm_shapes:
        if not timed_fp32(timer.sweep, dtype, 2 * batch * m * n * k):
            continue
        operands = _cold(
            timer,
            lambda: (
                torch.randn(batch, m, k, dtype=DTYPES[dtype], device=timer.device),
                torch.randn(batch, k, n, dtype=DTYPES[dtype], device=timer.device),
            ),
        )
        seconds = timer.median(lambda ab: torch.bmm(*ab), setup=operands)
        work = 2 * batch * m * n * k
        points.append(_point(work, seconds, (batch, m, n, k)))
        logger.info(f"  bmm {dtype} {batch}x{m}x{n}x{k}: {seconds * 1e6:.1f} us")
    return _sorted(points)


def grouped_gemm_points(timer: Timer, dtype: str) -> list[dict[str, Any]]:
    sweep = timer.sweep
    points = []
    for experts, rows, n, k in grouped_shapes(sweep):
        if not timed_fp32(sweep, dtype, 2 * experts * rows * n * k):
            continue
        offsets = torch.arange(1, experts + 1, dtype=torch.int32, device=timer.device) * rows
        operands = _cold(
            timer,
            lambda: (
                torch.randn(experts * rows, k, dtype=DTYPES[dtype], device=timer.device),
                torch.randn(experts, n, k, dtype=DTYPES[dtype], device=timer.device).transpose(1, 2),
            ),
        )

        def grouped(xw: tuple[torch.Tensor, ...], o: torch.Tensor = offsets) -> torch.Tensor:
            x, w = xw
            return grouped_mm(x, w, o)

        seconds = timer.median(grouped, setup=operands) / experts
        work = 2 * rows * n * k
        points.append(_point(work, seconds, (experts, rows, n, k)))
        logger.info(
            f"  grouped_gemm {dtype} E={experts} rows={rows} N={n} K={k}: "
            f"{seconds * 1e6:.1f} us/group, {work / seconds / 1e12:.3f} TFLOP/s"
        )
    return _sorted(points)


def attention_points(timer: Timer, dtype: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The forward curve and the backward curve (a CPU's backward runs several times slower per FLOP)."""
    sweep = timer.sweep
    b, h = sweep.attention_batch_heads
    d = sweep.attention_head_dim
    forward_points, backward_points = [], []
    for s in sweep.attention_seq:
        if not timed_fp32(sweep, dtype, 3.5 * 2 * b * h * s * s * d):
            continue
        grad = torch.randn(b, h, s, d, dtype=DTYPES[dtype], device=timer.device)
        qkv = _cold(
            timer, lambda: tuple(torch.randn(b, h, s, d, dtype=DTYPES[dtype], device=timer.device) for _ in range(3))
        )

        def leaves() -> list[torch.Tensor]:
            return [t.detach().requires_grad_() for t in qkv()]

        def forward(args: list[torch.Tensor]) -> torch.Tensor:
            q, k, v = args
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def backward(out: torch.Tensor, g: torch.Tensor = grad) -> None:
            out.backward(g)

        with torch.enable_grad():
            fwd_s = timer.median(forward, setup=leaves)
            bwd_s = timer.median(backward, setup=lambda: forward(leaves()))
        fwd_work = 2 * b * h * s * s * d  # 4 B H S S d, halved by the causal mask
        bwd_work = 5 * fwd_work // 2  # 2.5 x the forward
        forward_points.append(_point(fwd_work, fwd_s, (b, h, s, d)))
        backward_points.append(_point(bwd_work, bwd_s, (b, h, s, d)))
        logger.info(
            f"  attention {dtype} B={b} H={h} S={s} d={d}: fwd {fwd_s * 1e6:.1f} us "
            f"({fwd_work / fwd_s / 1e12:.3f} TFLOP/s), bwd {bwd_s * 1e6:.1f} us "
            f"({bwd_work / bwd_s / 1e12:.3f} TFLOP/s)"
        )
    return _sorted(forward_points), _sorted(backward_points)


def memory_points(timer: Timer, dtype: str) -> list[dict[str, Any]]:
    """Out-of-place ``torch.mul`` of two operands of each size, cold (``_cold``), in ``dtype``."""
    points = []
    for numel in timer.sweep.memory_numel:
        operands = _cold(
            timer,
            lambda: (
                torch.randn(numel, dtype=DTYPES[dtype], device=timer.device),
                torch.randn(numel, dtype=DTYPES[dtype], device=timer.device),
            ),
        )
        seconds = timer.median(lambda ab: torch.mul(*ab), setup=operands)
        work = 3 * numel * DTYPES[dtype].itemsize
        points.append(_point(work, seconds, (numel,)))
        logger.info(
            f"  memory mul {dtype} {numel} elements ({work} bytes): {seconds * 1e6:.2f} us, "
            f"{work / seconds / 1e9:.2f} GB/s"
        )
    return _sorted(points)


def stream_gbps(timer: Timer) -> tuple[float, int]:
    """Bandwidth of ``torch.add(a, b, out=c)`` (preallocated) at the two largest memory sizes: the best, its numel."""
    best = (0.0, 0)
    for numel in sorted(timer.sweep.memory_numel)[-2:]:
        a, b, c = (torch.randn(numel, device=timer.device) for _ in range(3))

        def add(_: object, a: torch.Tensor = a, b: torch.Tensor = b, c: torch.Tensor = c) -> torch.Tensor:
            return torch.add(a, b, out=c)

        seconds = timer.median(add)
        gbps = 3 * numel * a.element_size() / seconds / 1e9
        logger.info(f"  memory add out= {numel} elements: {gbps:.2f} GB/s")
        best = max(best, (gbps, numel))
    return best


def free_op_seconds(timer: Timer) -> float:
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


def host_op_seconds(timer: Timer, steps: int = 30) -> tuple[float, int]:
    """Seconds per dispatched op of a training step of a tiny model of the engine (one process): what a
    host spends around each op (Python, autograd, the engine's own code) when the kernels cost nothing.

    Returns (median step seconds / ops, ops per step)."""

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
