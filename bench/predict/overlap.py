"""Overlap: the collectives that run while the rank computes, and what of them the compute hides. The
gradient reductions and ZeRO-1 gathers of a step queue on one link by bucket (``SyncBucket``,
``simulate_sync``); a microbatch's chunked expert all-to-alls run under its experts (``ExpertOverlap``,
``chunked_exposed_s``, ``expert_hidden_s``), or under another microbatch's compute
(``microbatch_exposed_s``).

Formulas: ``bench.predict.projection``'s docstring, sections "Overlapped syncs" and "Overlapped expert all-to-alls". Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from bench.predict.collectives import Collective, Network, collective_seconds, is_int, is_number

__all__ = [
    "ExpertOverlap",
    "SyncBucket",
    "SyncTimes",
    "chunked_exposed_s",
    "expert_hidden_s",
    "microbatch_exposed_s",
    "simulate_sync",
]


@dataclass(frozen=True)
class SyncBucket:
    """One bucket's collective of an overlapped sync, and the compute it can hide under."""

    collective: Collective
    """Its reduction (all_reduce, or reduce_scatter under ZeRO-1) or its ZeRO-1 all_gather; phase grad."""
    window_s: float
    """The rank's compute still to run when it launches, seconds: the last backward's rest for a
    reduction, the optimizer updates' rest for a gather."""

    def __post_init__(self) -> None:
        if not isinstance(self.collective, Collective):
            raise ValueError(f"sync_bucket.collective: expected a Collective, got {type(self.collective).__name__}")
        if not is_number(self.window_s) or not self.window_s >= 0:
            raise ValueError(f"sync_bucket.window_s: must be a number >= 0, got {self.window_s!r}")


@dataclass(frozen=True)
class ExpertOverlap:
    """One direction (forward or backward) of a microbatch's chunked expert all-to-alls, and the expert
    compute they run under (``bench.predict.projection``'s docstring)."""

    chunks: int
    """C: the chunks each MoE layer pass sends its rows out and back in."""
    passes: float
    """P: MoE layer passes of this direction in one microbatch."""
    exchanges: tuple[Collective, ...]
    """Their row all-to-alls (phase expert; ``count``: calls in one microbatch)."""
    compute_s: float
    """X: seconds of the experts' own ops in these passes, one microbatch."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "exchanges", tuple(self.exchanges))
        if not is_int(self.chunks) or self.chunks < 1:
            raise ValueError(f"expert_overlap.chunks: must be an integer >= 1, got {self.chunks!r}")
        if not is_number(self.passes) or not self.passes > 0:
            raise ValueError(f"expert_overlap.passes: must be a number > 0, got {self.passes!r}")
        if not is_number(self.compute_s) or not self.compute_s >= 0:
            raise ValueError(f"expert_overlap.compute_s: must be a number >= 0, got {self.compute_s!r}")
        for i, c in enumerate(self.exchanges):
            if not isinstance(c, Collective) or c.phase != "expert" or c.op != "all_to_all":
                raise ValueError(f"expert_overlap.exchanges[{i}]: expected an expert all_to_all, got {c!r}")


def chunked_exposed_s(alltoall_s: float, compute_s: float, chunks: int) -> float:
    """Seconds of one MoE layer pass's all-to-alls (``alltoall_s``, out and back) that its experts
    (``compute_s``) do not hide, in ``chunks`` chunks (the rule in ``bench.predict.projection``'s docstring)."""
    if chunks == 1:
        return alltoall_s
    half = alltoall_s / (2 * chunks)
    expert = compute_s / chunks
    link = half
    arrived = [link]
    computed = 0.0
    for k in range(chunks):
        if k + 1 < chunks:
            link += half
            arrived.append(link)
        computed = max(arrived[k], computed) + expert
        link = max(link, computed) + half
    # Never more than the all-to-alls themselves (the difference above rounds).
    return min(link - compute_s, alltoall_s)


def expert_hidden_s(overlaps: Iterable[ExpertOverlap], rank: int, net: Network) -> float:
    """c_exp_hidden: the expert all-to-all seconds of one microbatch that its experts hide."""
    hidden = 0.0
    for o in overlaps:
        a = sum(collective_seconds(c, rank, net) for c in o.exchanges) / o.passes
        hidden += o.passes * (a - chunked_exposed_s(a, o.compute_s / o.passes, o.chunks))
    return hidden


def microbatch_exposed_s(alltoall_s: float, compute_s: float, microbatches: int) -> float:
    """Seconds of a step's expert all-to-alls that the compute does not hide when each microbatch's run
    beside another microbatch's compute (``ExpertOverlap.MICROBATCHES``): m - 1 overlapped pairs, each
    exposing what its all-to-alls (``alltoall_s``, one microbatch's) outlast its compute (``compute_s``,
    one microbatch's), and the first forward's and the last backward's all-to-alls, which have no
    partner, whole (the rule in ``bench.predict.projection``'s docstring)."""
    if not is_int(microbatches) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    for name, value in (("alltoall_s", alltoall_s), ("compute_s", compute_s)):
        if not is_number(value) or not value >= 0:
            raise ValueError(f"{name}: must be a number >= 0, got {value!r}")
    return (microbatches - 1) * max(0.0, alltoall_s - compute_s) + alltoall_s


@dataclass(frozen=True)
class SyncTimes:
    """What an overlapped sync costs the step."""

    total_s: float
    """Every bucket's collective priced on its own, summed."""
    exposed_s: float
    """How long the link stays busy after the compute ends: the step waits for it."""

    @property
    def hidden_s(self) -> float:
        return self.total_s - self.exposed_s


def simulate_sync(buckets: Iterable[SyncBucket], rank: int, net: Network) -> SyncTimes:
    """Buckets in launch order queued on one link, each starting at its launch (-window) or when the
    one before it ends (formulas in ``bench.predict.projection``'s docstring)."""
    end, total = -math.inf, 0.0
    for bucket in buckets:
        cost = collective_seconds(bucket.collective, rank, net)
        end = max(-bucket.window_s, end) + cost
        total += cost
    return SyncTimes(total_s=total, exposed_s=max(0.0, end))
