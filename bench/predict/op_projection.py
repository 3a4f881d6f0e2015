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
                   schedule, on the profile's network, with its rank-skew waits

A traced step of m_t < m microbatches stands for m: every microbatch of a step runs the same ops
(only the routes differ), and the last one is where the buckets launch, in the trace too.

The rank-skew waits are ``bench.predict.projection``'s (``SkewModel``), from the traced collectives.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.predict.pricing import PricedOp
from bench.predict.projection import (
    Collective,
    Network,
    Projection,
    RankTiming,
    Schedule,
    SkewModel,
    SyncBucket,
    project_step,
)

__all__ = ["PER_MICROBATCH_ACCOUNTS", "StepPrices", "collective_account", "project_priced_step", "step_prices"]

PER_MICROBATCH_ACCOUNTS = ("expert", "pipeline", "fsdp")
"""Accounts of collectives that every microbatch issues (``collective_account``)."""


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


def collective_account(op, group_phases: dict[str, str]) -> tuple[str, str]:
    """(phase, account) of a traced collective (module docstring): its phase from its group (an FSDP
    parameter gather: fsdp), and where the step counts it: expert, pipeline, fsdp (per microbatch),
    grad_sync (the reductions, bucketed in the backward or not), param_gather (ZeRO-1's gathers in
    the optimizer) or other."""
    phase = group_phases.get(op.collective["group_name"], "other")
    if phase == "grad" and op.collective["op"] == "all_gather" and op.stage in ("forward", "backward"):
        # FSDP's parameter gathers: every microbatch's forward and backward gathers each unit again.
        return "fsdp", "fsdp"
    if phase in ("expert", "pipeline"):
        return phase, phase
    if phase == "grad":
        return phase, "param_gather" if op.stage == "optimizer" else "grad_sync"
    return phase, "other"


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
        phase, account = collective_account(p.op, group_phases)
        c = _collective(p.op, phase)
        if account in PER_MICROBATCH_ACCOUNTS:
            per_mb.setdefault((c.op, c.ranks, phase), []).append(c.nbytes)
        elif account == "grad_sync" and p.op.stage == "backward":
            grad_buckets.append(SyncBucket(c, after[i]))
        elif account == "param_gather":
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


def project_priced_step(
    prices: StepPrices,
    rank: int,
    schedule: Schedule,
    net: Network,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    skew: SkewModel | None = None,
) -> Projection:
    """The projected step of a priced trace (module docstring)."""
    return project_step(
        rank, prices.timing, prices.per_microbatch, prices.per_step, schedule, net, tokens_per_step,
        world_size, flops_per_token, prices.grad_buckets, prices.gather_buckets, skew,
    )
