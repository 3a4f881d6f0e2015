"""Overlap: the collectives that run while the rank computes, and what of them the compute hides. The
gradient reductions and ZeRO-1 gathers of a step queue on one link by bucket (``SyncBucket``,
``simulate_sync``); a microbatch's chunked expert all-to-alls run under its experts (``ExpertOverlap``,
``chunked_exposed_s``, ``expert_hidden_s``), or under another microbatch's compute
(``Program``, ``interleaved_exposed_s``, ``MicrobatchOverlap``, ``overlapped_pairs``). There a program
hands over once per exchange of rows, or once per chain of them (exchanges with no compute between,
run back to back: the per-node dispatch's two levels, one ``Segment``), and waits at once for its
routing counts (a segment that does not hand over).

Formulas: ``bench.predict.projection``'s docstring, sections "Overlapped syncs" and "Overlapped expert all-to-alls". Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from bench.predict.collectives import Collective, Network, collective_seconds, is_int, is_number

__all__ = [
    "NOTHING",
    "ExpertOverlap",
    "MicrobatchOverlap",
    "PairedPipeline",
    "Pairs",
    "Program",
    "Segment",
    "SyncBucket",
    "SyncTimes",
    "chunked_exposed_s",
    "expert_hidden_s",
    "interleaved_exposed_s",
    "overlapped_pairs",
    "simulate_sync",
    "sliced",
    "without_compute",
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
    direction: str = ""
    """forward or backward (empty: not said)."""

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


def expert_hidden_s(overlaps: Iterable[ExpertOverlap], rank: int, net: Network, direction: str = "") -> float:
    """c_exp_hidden: the expert all-to-all seconds of one microbatch that its experts hide (``direction``:
    only that direction's)."""
    hidden = 0.0
    for o in overlaps:
        if direction and o.direction != direction:
            continue
        a = sum(collective_seconds(c, rank, net) for c in o.exchanges) / o.passes
        hidden += o.passes * (a - chunked_exposed_s(a, o.compute_s / o.passes, o.chunks))
    return hidden


class Segment(NamedTuple):
    """A program's compute up to one expert all-to-all (or chain of them), and how it waits there."""

    compute_s: float
    """Compute before the all-to-all, seconds."""
    alltoall_s: float
    """The all-to-all's seconds; a chain's: its exchanges' summed (back to back on the link)."""
    hands_over: bool = True
    """Whether the program hands over as it starts it; False: waited for at once (routing counts)."""


@dataclass(frozen=True)
class Program:
    """One direction (forward or backward) of one microbatch as the overlapped step interleaves it: its
    compute cut at each expert all-to-all (or chain of them) it issues."""

    segments: tuple[Segment, ...]
    """In issue order; a plain (compute, all-to-all) pair is a segment that hands over."""
    tail_s: float
    """Compute after its last all-to-all, seconds."""

    def __post_init__(self) -> None:
        segments = tuple(Segment(float(s[0]), float(s[1]), *(bool(h) for h in s[2:])) for s in self.segments)
        object.__setattr__(self, "segments", segments)
        for c, a, _ in segments:
            if not c >= 0 or not a >= 0:
                raise ValueError(f"program.segments: seconds must be >= 0, got ({c}, {a})")
        if not is_number(self.tail_s) or not self.tail_s >= 0:
            raise ValueError(f"program.tail_s: must be a number >= 0, got {self.tail_s!r}")

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s for s in self.segments) + self.tail_s

    @property
    def alltoall_s(self) -> float:
        return sum(s.alltoall_s for s in self.segments)

    @property
    def waited_s(self) -> float:
        """Seconds of the all-to-alls it waits for at once (routing counts), among ``alltoall_s``."""
        return sum(s.alltoall_s for s in self.segments if not s.hands_over)


NOTHING = Program((), 0.0)
"""A partner with no work: a program beside it waits for each of its all-to-alls at once."""


def interleaved_exposed_s(first: Program, second: Program) -> float:
    """Seconds the compute waits when ``first`` and ``second`` run as the overlapped step runs them
    (the rule in ``bench.predict.projection``'s docstring, "Expert all-to-alls overlapped across
    microbatches"): one computes at a time; each starts its all-to-all (a chain's exchanges back to
    back), hands over, and waits for it when the other has started its own next one (or finished);
    routing counts are waited for at once, no hand-over, and count among the seconds returned; the
    all-to-alls queue on one link."""
    programs = (first, second)
    position, in_flight, done = [0, 0], [0.0, 0.0], [False, False]
    clock = link = 0.0
    running = 0
    while not all(done):
        program = programs[running]
        # Resuming: its all-to-all in flight must have arrived.
        clock = max(clock, in_flight[running])
        segments = program.segments
        # Routing counts: behind what is in flight on the link, and the program waits for them there.
        while position[running] < len(segments) and not segments[position[running]].hands_over:
            compute, alltoall, _ = segments[position[running]]
            position[running] += 1
            link = clock = max(clock + compute, link) + alltoall
        if position[running] < len(segments):
            compute, alltoall, _ = segments[position[running]]
            position[running] += 1
            clock += compute
            link = max(clock, link) + alltoall
            in_flight[running] = link
        else:
            clock += program.tail_s
            done[running] = True
        if not done[1 - running]:
            running = 1 - running
    return clock - first.compute_s - second.compute_s


@dataclass(frozen=True)
class MicrobatchOverlap:
    """A step's microbatches overlapped pairwise (``moe_engine.config.ExpertOverlap.MICROBATCHES``):
    one microbatch's programs, and how many of them run beside a partner and how many alone."""

    forward: Program
    """One microbatch's forward."""
    backward: Program
    """One microbatch's backward."""
    pairs: float
    """Microbatches whose forward runs beside another's backward, per step."""
    alone_forward: float
    """Microbatch forwards that run alone, per step."""
    alone_backward: float
    """Microbatch backwards (full or input) that run alone, per step."""
    input_beside_weight: float = 0.0
    """Microbatch input backwards with an earlier one's weight backward beside them, per step."""
    backward_beside_weight: float = 0.0
    """Microbatch full backwards with an earlier one's weight backward beside them, per step."""
    pipeline: PairedPipeline | None = None
    """Under pp > 1, the paired plan the pairs come from: the bubble is the rank's idle time in its
    replay (``bench.predict.pipeline_replay``); None: pp = 1."""
    weight_s: float = 0.0
    """One microbatch's weight backward, seconds (its share of ``backward``'s compute)."""

    def __post_init__(self) -> None:
        for name in ("pairs", "alone_forward", "alone_backward", "input_beside_weight", "backward_beside_weight"):
            value = getattr(self, name)
            if not is_number(value) or not value >= 0:
                raise ValueError(f"microbatch_overlap.{name}: must be a number >= 0, got {value!r}")
        if not is_number(self.weight_s) or not 0 <= self.weight_s <= self.backward.compute_s:
            raise ValueError(
                f"microbatch_overlap.weight_s: must be a number in [0, {self.backward.compute_s}], got {self.weight_s!r}"
            )

    @property
    def input_backward(self) -> Program:
        """One microbatch's input backward: the backward less its weight gradients, spread over its
        segments in proportion to their compute."""
        return without_compute(self.backward, self.weight_s)

    @property
    def weight_slices(self) -> Program:
        """One microbatch's weight backward as it runs beside a backward: one slice at each of that
        backward's hand-overs."""
        return sliced(self.weight_s, sum(s.hands_over for s in self.backward.segments))

    def exposed_s(self, alone_hidden_forward_s: float = 0.0, alone_hidden_backward_s: float = 0.0) -> float:
        """The step's exposed all-to-all seconds, the routing counts' waits included; ``alone_hidden_*``:
        what a direction that runs alone hides by itself (its layers' chunked dispatch), per microbatch."""
        paired = interleaved_exposed_s(self.forward, self.backward)
        alone_f = interleaved_exposed_s(self.forward, NOTHING) - alone_hidden_forward_s
        alone_b = interleaved_exposed_s(self.backward, NOTHING) - alone_hidden_backward_s
        beside_weight = self.input_beside_weight * interleaved_exposed_s(
            self.input_backward, self.weight_slices
        ) + self.backward_beside_weight * interleaved_exposed_s(self.backward, self.weight_slices)
        return self.pairs * paired + self.alone_forward * alone_f + self.alone_backward * alone_b + beside_weight


def without_compute(program: Program, seconds: float) -> Program:
    """``program`` less ``seconds`` of its compute, taken from each segment and the tail in proportion."""
    if not program.compute_s:
        return program
    keep = max(0.0, 1 - seconds / program.compute_s)
    return Program(
        tuple(Segment(s.compute_s * keep, s.alltoall_s, s.hands_over) for s in program.segments),
        program.tail_s * keep,
    )


def sliced(seconds: float, slices: int) -> Program:
    """Compute with no all-to-all of its own, run in ``slices`` equal slices beside another program: one
    at each of that program's hand-overs (a segment with no all-to-all hands straight back), the last as
    the tail."""
    n = max(1, slices)
    return Program(tuple(Segment(seconds / n, 0.0) for _ in range(n - 1)), seconds / n)


@dataclass(frozen=True)
class PairedPipeline:
    """A layout's paired pipeline plan (``moe_engine.parallel.paired_plan``), and the rank measured."""

    kind: str
    """The schedule (interleaved1f1b or dualpipev)."""
    pp: int
    """Pipeline ranks."""
    virtual_stages: int
    """Stages per rank (dualpipev: 2)."""
    microbatches: int
    """Microbatches per step."""
    pipeline_rank: int
    """The measured rank's place in the pipeline."""


class Pairs(NamedTuple):
    """One rank's step as the microbatches overlap runs it, in microbatches (``MicrobatchOverlap``'s fields)."""

    pairs: float
    alone_forward: float
    alone_backward: float
    input_beside_weight: float = 0.0
    backward_beside_weight: float = 0.0


def overlapped_pairs(kind: str, pp: int, pipeline_rank: int, microbatches: int, virtual_stages: int = 1) -> Pairs:
    """One rank's pairs: pp = 1, the overlapped data-parallel step pairs microbatch i's forward with
    i - 1's backward (m - 1 pairs, the first forward and the last backward alone); pp > 1, the actions
    of the rank's paired plan (``moe_engine.parallel.paired_plan``), each a stage chunk (1 / v of a
    microbatch of the rank's blocks; dualpipev: v = 2)."""
    m = microbatches
    if pp == 1:
        return Pairs(float(m - 1), 1.0, 1.0)
    # heavy: torch's pipelining schedules, only for a pipeline; the rest of the arithmetic runs without it.
    from moe_engine.parallel.paired_plan import PAIRED_SCHEDULES, pair_counts, paired_plan, torch_plan

    if kind not in PAIRED_SCHEDULES:
        raise ValueError(
            f"overlap: microbatches overlap with pp > 1 runs under {' or '.join(PAIRED_SCHEDULES)}, got {kind}"
        )
    v = 2 if kind == "dualpipev" else virtual_stages
    counts = pair_counts(paired_plan(kind, torch_plan(kind, pp, v, m, pipeline_rank)))
    return Pairs(
        counts.pairs / v,
        counts.forward_alone / v,
        counts.backward_alone / v,
        counts.input_beside_weight / v,
        counts.backward_beside_weight / v,
    )


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
