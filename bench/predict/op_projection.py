"""A rank's traced step, priced op by op on a device profile, assembled into a projected step.

Inputs: the ops of a traced step (``bench.run.trace``: m_t microbatches of the scenario's own size,
then the optimizer), the seconds of each on a profile (``bench.predict.pricing``), and the layout.

    microbatch_s = (seconds of the forward and backward ops) / m_t
    optimizer_s  = seconds of the optimizer ops + the once-per-step rest (zeroing gradient buffers)
    collectives  = the traced c10d ops (bytes from the traced tensors): expert (ep group) and pipeline
                   (pp group) ones per microbatch, their count / m_t, and so are FSDP's parameter
                   gathers (dp-group all-gathers in the forward and backward); gradient-group ones issued in the
                   backward are the overlapped reduction buckets, each with the window w = the seconds
                   of the backward ops traced after it; those issued in the optimizer are the ZeRO-1
                   gather buckets, w = the optimizer ops' seconds after it; the rest are per step
    step         = ``bench.predict.projection.project_step`` over the scenario's m microbatches and
                   schedule, on the profile's network, plus the rank-skew waits (below)

A traced step of m_t < m microbatches stands for m: every microbatch of a step runs the same ops
(only the routes differ), and the last one is where the buckets launch, in the trace too.

Rank skew (``SkewModel``): a collective waits for the slowest rank of its group. With ranks whose
compute between two collectives varies with a coefficient of variation c, independently, the
expected wait of a group of n is c * z_n times the segment's compute, z_n = E[max of n standard
normals] (z_2 = 1/sqrt(pi)). Summed over a microbatch's segments that is c * z_n of its compute.
The wait is added per microbatch (``skew`` in the breakdown) for layouts whose microbatches hold
collectives (ep > 1 or pp > 1), and once per step before the gradient sync otherwise; c comes from
the per-rank step-time spread real multi-rank runs record.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.predict.pricing import PricedOp
from bench.predict.projection import (
    Collective,
    Network,
    Projection,
    RankTiming,
    Schedule,
    SyncBucket,
    project_step,
)

__all__ = ["SkewModel", "StepPrices", "expected_max_normal", "project_priced_step", "step_prices"]


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals], by numerical integration (z_1 = 0, z_2 = 1/sqrt(pi))."""
    if n <= 1:
        return 0.0

    def pdf(x: float) -> float:
        return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    # E[max] = integral of x * n * pdf(x) * cdf(x)^(n-1) dx, over [-10, 10] by Simpson's rule.
    steps, lo, hi = 4000, -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * x * n * pdf(x) * cdf(x) ** (n - 1)
    return total * h / 3


@dataclass(frozen=True)
class SkewModel:
    """How much ranks' compute varies between collectives."""

    cv: float
    """Coefficient of variation of a rank's compute between two collectives (0: no skew)."""
    source: str
    """Where cv comes from, in words."""

    def wait_fraction(self, group_size: int) -> float:
        """Expected wait for the slowest of ``group_size`` ranks, as a fraction of the compute."""
        return self.cv * expected_max_normal(group_size)


@dataclass(frozen=True)
class StepPrices:
    """A priced trace folded into what ``project_step`` takes."""

    timing: RankTiming
    per_microbatch: list[Collective]
    per_step: list[Collective]
    grad_buckets: list[SyncBucket]
    gather_buckets: list[SyncBucket]
    seconds_by_kind: dict[str, float]
    """Seconds of the step's ops by kind (gemm, grouped_gemm, mx_gemm, attention, memory, free)."""
    flops_traced: float
    """FLOPs of the traced step's matmul-like ops (gemm, grouped_gemm, mx_gemm, attention)."""


def _collective(op, phase: str) -> Collective:
    c = op.collective
    return Collective(c["op"], tuple(c["ranks"]), int(c["nbytes"]), phase)


def step_prices(priced: Sequence[PricedOp], microbatches_traced: int, group_phases: dict[str, str]) -> StepPrices:
    """Fold a priced trace (module docstring)."""
    compute = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
    by_kind: dict[str, float] = {}
    flops = 0.0
    for p in priced:
        if p.work.kind == "collective":
            continue
        compute[p.op.stage] += p.seconds
        by_kind[p.work.kind] = by_kind.get(p.work.kind, 0.0) + p.seconds
        if p.work.kind in ("gemm", "grouped_gemm", "mx_gemm", "attention"):
            flops += p.work.flops

    # Windows: the seconds of same-stage compute traced after each collective.
    after = [0.0] * len(priced)
    remaining = {"backward": 0.0, "optimizer": 0.0}
    for i in range(len(priced) - 1, -1, -1):
        p = priced[i]
        after[i] = remaining.get(p.op.stage, 0.0)
        if p.work.kind != "collective" and p.op.stage in remaining:
            remaining[p.op.stage] += p.seconds

    per_mb: dict[tuple, list[int]] = {}
    per_step: dict[tuple, list[int]] = {}
    grad_buckets, gather_buckets = [], []
    for i, p in enumerate(priced):
        if p.work.kind != "collective":
            continue
        phase = group_phases.get(p.op.collective["group_name"], "other")
        c = _collective(p.op, phase)
        if phase == "grad" and c.op == "all_gather" and p.op.stage in ("forward", "backward"):
            # FSDP's parameter gathers: every microbatch's forward and backward gathers each unit again.
            c = Collective(c.op, c.ranks, c.nbytes, "fsdp")
            phase = "fsdp"
        if phase in ("expert", "pipeline", "fsdp"):
            per_mb.setdefault((c.op, c.ranks, phase), []).append(c.nbytes)
        elif phase == "grad" and p.op.stage == "backward":
            grad_buckets.append(SyncBucket(c, after[i]))
        elif phase == "grad" and p.op.stage == "optimizer":
            gather_buckets.append(SyncBucket(c, after[i]))
        else:
            per_step.setdefault((c.op, c.ranks, phase), []).append(c.nbytes)
    per_microbatch = []
    for (op, ranks, phase), sizes in per_mb.items():
        count = len(sizes) / microbatches_traced
        per_microbatch.append(Collective(op, ranks, round(statistics.fmean(sizes)), phase, max(1, round(count))))
    step_entries = [
        Collective(op, ranks, round(statistics.fmean(sizes)), phase, len(sizes))
        for (op, ranks, phase), sizes in per_step.items()
    ]
    timing = RankTiming(
        microbatch_s=(compute["forward"] + compute["backward"]) / microbatches_traced,
        optimizer_s=compute["optimizer"] + compute["other"],
    )
    return StepPrices(timing, per_microbatch, step_entries, grad_buckets, gather_buckets, by_kind, flops)


def _skew_group(prices: StepPrices, schedule: Schedule) -> int:
    sizes = [len(c.ranks) for c in prices.per_microbatch if c.phase == "expert"]
    if schedule.pp > 1:
        sizes.append(2)
    return max(sizes, default=0)


def project_priced_step(
    prices: StepPrices,
    rank: int,
    schedule: Schedule,
    net: Network,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    skew: SkewModel | None = None,
) -> tuple[Projection, dict[str, Any]]:
    """The projected step, with the rank-skew waits added (module docstring); and what was assumed."""
    base = project_step(
        rank, prices.timing, prices.per_microbatch, prices.per_step, schedule, net, tokens_per_step,
        world_size, flops_per_token, prices.grad_buckets, prices.gather_buckets,
    )
    group = _skew_group(prices, schedule)
    dp_group = max((len(b.collective.ranks) for b in prices.grad_buckets), default=1)
    wait = 0.0
    note = "rank skew: not modelled (no skew model given)"
    if skew is not None:
        if group:
            wait = skew.wait_fraction(group) * schedule.microbatches * prices.timing.microbatch_s
            where = f"per microbatch, groups of {group} ranks (expert all-to-alls or stage messages)"
        else:
            wait = skew.wait_fraction(dp_group) * schedule.microbatches * prices.timing.microbatch_s
            where = f"once per step, before the gradient sync of {dp_group} ranks"
        note = (f"rank skew: compute between collectives varies across ranks with cv = {skew.cv:.4g} "
                f"({skew.source}); a collective waits for the slowest rank, cv * z_n of the compute, "
                f"{where}: {wait:.4g} s per step")
    breakdown = dict(base.breakdown_s, skew=wait)
    step = base.step_s + wait
    projection = Projection(
        step_s=step,
        tokens_per_s_per_gpu=tokens_per_step / step / world_size,
        tflops_per_gpu=flops_per_token * tokens_per_step / step / world_size / 1e12,
        breakdown_s=breakdown,
        assumptions=[*base.assumptions, note],
    )
    return projection, {"skew_s": wait, "skew_group": group or dp_group}
