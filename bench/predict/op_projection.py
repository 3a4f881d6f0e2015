"""A rank's traced step, priced op by op on a device profile, assembled into a projected step.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.predict.collectives import Collective, Network, collective_seconds
from bench.predict.dispatch_rows import DispatchShape, expected_rows_per_token, node_groups, resolve_rows, side_bytes
from bench.predict.ops import TracedOp
from bench.predict.overlap import ExpertOverlap, MicrobatchOverlap, PairedPipeline, Pairs, Program, Segment, SyncBucket
from bench.predict.pricing import PricedOp, is_stand_in
from bench.predict.projection import Projection, RankTiming, Schedule, project_step
from bench.predict.skew import SkewModel

__all__ = [
    "ONCE_PER_STEP",
    "PER_MICROBATCH_ACCOUNTS",
    "StepPrices",
    "collective_account",
    "expert_overlap",
    "project_priced_step",
    "runs_every_microbatch",
    "step_prices",
]

PER_MICROBATCH_ACCOUNTS = ("expert", "pipeline", "fsdp")
"""Accounts of collectives that every microbatch issues (``collective_account``)."""

WEIGHT_MATMULS = ("gemm", "grouped_gemm", "mx_gemm")
"""Kinds of the ops that multiply by a weight (attention's score and context products are "attention")."""

ONCE_PER_STEP = frozenset({("@accumulate_grad", "aten.div_"), ("@grad_sync", "aten.div_")})
"""(location, ATen packet) of the forward and backward ops that run once per step: a gradient bucket's
scaling by 1/dp as its reduction launches (``moe_engine.parallel.data_parallel``), in the gradient
buffers' hooks of the last backward or in the sync that finishes them."""


def runs_every_microbatch(op: TracedOp) -> bool:
    """Whether ``op`` runs once per microbatch (a forward or backward op that is not ``ONCE_PER_STEP``);
    the rest of a step runs once."""
    return op.stage in ("forward", "backward") and (op.location, op.packet) not in ONCE_PER_STEP


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
    expert_overlap: list[ExpertOverlap] = dataclasses.field(default_factory=list)
    """The chunked expert all-to-alls of a microbatch by direction (none when not chunked)."""
    once_per_step_s: float = 0.0
    """Seconds of the forward and backward ops that run once per step (``ONCE_PER_STEP``), in optimizer_s."""
    stand_ins: int = 0
    """Ops of the trace that stand in for the proxy's simulated peers, priced at 0."""
    programs: dict[str, TracedProgram] = dataclasses.field(default_factory=dict)
    """One microbatch's forward and backward cut at its expert all-to-alls (``traced_programs``)."""


CHAINED = "chained"
"""Key of a traced collective record (``engine_dispatch``'s): true where the exchange follows the one
before it with no compute between, in one chain that hands over once (``bench.predict.overlap``)."""


@dataclass(frozen=True)
class TracedSegment:
    """``bench.predict.overlap.Segment`` before the network prices its all-to-alls."""

    compute_s: float
    """Compute before the all-to-all, seconds."""
    exchanges: tuple[Collective, ...]
    """The all-to-all, or a chain's, in issue order."""
    hands_over: bool = True
    """False: routing counts, waited for at once."""


@dataclass(frozen=True)
class TracedProgram:
    """``bench.predict.overlap.Program`` before the network prices its all-to-alls."""

    segments: tuple[TracedSegment, ...]
    """In issue order."""
    tail_s: float
    """Compute after the last all-to-all, seconds."""

    def priced(self, rank: int, net: Network) -> Program:
        return Program(
            tuple(
                Segment(s.compute_s, sum(collective_seconds(c, rank, net) for c in s.exchanges), s.hands_over)
                for s in self.segments
            ),
            self.tail_s,
        )


def is_counts(op: TracedOp) -> bool:
    """Whether an expert all-to-all exchanges routing counts (integers) rather than rows."""
    return bool(op.inputs) and not op.inputs[0].dtype.startswith(("torch.float", "torch.bfloat"))


def traced_programs(
    priced: Sequence[PricedOp], microbatches_traced: int, group_phases: dict[str, str]
) -> dict[str, TracedProgram]:
    """One microbatch's forward and backward as the overlapped step interleaves them (docs/projection-formulas.md):
    the compute of the ops that run every microbatch, cut at each expert all-to-all (rows: one segment
    per exchange, or per chain of them, ``CHAINED``; routing counts: a segment waited for at once),
    each segment the mean over the traced microbatches, the tail the last one's; none for a direction
    whose segments do not split evenly over them."""
    points: dict[str, list[tuple[float, list[Collective], bool]]] = {"forward": [], "backward": []}
    since = {"forward": 0.0, "backward": 0.0}
    total = {"forward": 0.0, "backward": 0.0}
    for p in priced:
        stage = p.op.stage
        if stage not in points or not runs_every_microbatch(p.op):
            continue
        if p.work.kind != "collective":
            since[stage] += p.seconds
            total[stage] += p.seconds
            continue
        phase, account = collective_account(p.op, group_phases)
        if account != "expert" or p.op.collective is None or p.op.collective["op"] != "all_to_all":
            continue
        exchange = _collective(p.op, phase)
        if p.op.collective.get(CHAINED):
            if not points[stage] or since[stage] or not points[stage][-1][2]:
                raise ValueError(f"traced op {p.op.name}: chained to no exchange of rows just before it")
            points[stage][-1][1].append(exchange)
            continue
        points[stage].append((since[stage], [exchange], not is_counts(p.op)))
        since[stage] = 0.0
    programs = {}
    for stage, found in points.items():
        if len(found) % microbatches_traced:
            continue
        k = len(found) // microbatches_traced
        if k == 0:
            programs[stage] = TracedProgram((), total[stage] / microbatches_traced)
            continue
        # The compute after a microbatch's last all-to-all counts into the next one's first segment;
        # the last microbatch's shows it alone (every microbatch runs the same ops).
        tail = since[stage]
        segments = []
        for j in range(k):
            at = [found[i * k + j] for i in range(microbatches_traced)]
            if len({(len(chain), hands_over) for _, chain, hands_over in at}) > 1:
                break  # the microbatches do not issue the same all-to-alls
            before = [c - (tail if j == 0 and i > 0 else 0.0) for i, (c, _, _) in enumerate(at)]
            chain = tuple(
                dataclasses.replace(first, nbytes=round(statistics.fmean(c[n].nbytes for _, c, _ in at)))
                for n, first in enumerate(at[0][1])
            )
            segments.append(TracedSegment(max(0.0, statistics.fmean(before)), chain, at[0][2]))
        else:
            programs[stage] = TracedProgram(tuple(segments), tail)
    return programs


def _collective(op, phase: str) -> Collective:
    c = op.collective
    return Collective(c["op"], tuple(c["ranks"]), int(c["nbytes"]), phase)


def collective_account(op, group_phases: dict[str, str]) -> tuple[str, str]:
    """(phase, account) of a traced collective (docs/projection-formulas.md): its phase from its group (an FSDP
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


def step_prices(
    priced: Sequence[PricedOp],
    microbatches_traced: int,
    group_phases: dict[str, str],
    chunks: int | None = None,
    levels: int = 1,
) -> StepPrices:
    """Fold a priced trace (docs/projection-formulas.md); ``chunks``, ``levels``: ``expert_overlap``'s."""
    compute = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
    forward_matmuls = 0.0
    by_kind: dict[str, float] = {}
    flops = 0.0
    once_per_step = 0.0
    stand_ins = 0
    for p in priced:
        if p.work.kind == "collective":
            continue
        stand_ins += is_stand_in(p.op)
        if p.op.stage in ("forward", "backward") and not runs_every_microbatch(p.op):
            once_per_step += p.seconds
        else:
            compute[p.op.stage] += p.seconds
            if p.op.stage == "forward" and p.work.kind in WEIGHT_MATMULS:
                forward_matmuls += p.seconds
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
        optimizer_s=compute["optimizer"] + compute["other"] + once_per_step,
        forward_s=compute["forward"] / microbatches_traced,
        weight_grad_s=min(forward_matmuls, compute["backward"]) / microbatches_traced,
    )
    overlap = expert_overlap(priced, microbatches_traced, group_phases, chunks, levels)
    return StepPrices(
        timing,
        per_microbatch,
        step_entries,
        grad_buckets,
        gather_buckets,
        by_kind,
        flops,
        overlap,
        once_per_step,
        stand_ins,
        traced_programs(priced, microbatches_traced, group_phases),
    )


def engine_dispatch(
    priced: Sequence[PricedOp],
    group_phases: dict[str, str],
    kind: str,
    shape: DispatchShape,
    sync: bool,
    rank: int,
) -> tuple[list[PricedOp], dict[str, str]]:
    """A trace of per-expert rows (what a proxy rank's dispatcher runs) as the engine's ``kind`` rows
    run it at ``rank`` (docs/projection-formulas.md, "Dispatch rows"): each row exchange of the expert group
    carries D / k of its rows (D = the expected distinct destinations, ``expected_rows_per_token``),
    each with its side buffer; per-node's two levels replace it in the order the engine runs them
    (rows out to the experts: inter-node then intra-node; back: intra-node then inter-node;
    ``returning_rows``), the second marked ``CHAINED`` to the first; a routing-counts exchange stays
    (one per level) under sync dispatch and goes under no-sync (the dedup buffers carry no counts).
    Returns the ops and the group phases with the levels' groups."""
    kind = resolve_rows(kind, shape)
    if kind == "per-expert":
        return list(priced), group_phases
    rows = expected_rows_per_token(shape)
    returning = returning_rows(priced, group_phases)
    per_rank = shape.experts // shape.ep
    phases = dict(group_phases)
    out: list[PricedOp] = []
    for i, p in enumerate(priced):
        call = p.op.collective
        if p.work.kind != "collective" or call is None or call["op"] != "all_to_all":
            out.append(p)
            continue
        if collective_account(p.op, group_phases)[1] != "expert":
            out.append(p)
            continue
        ranks = tuple(call["ranks"])
        levels: list[tuple[str, tuple[int, ...], float, int]] = [("", ranks, rows.ranks, per_rank)]
        if kind == "per-node" and shape.nodes > 1:
            across, inside = node_groups(shape, rank, min(ranks))
            levels = [
                ("inter", across, rows.nodes, per_rank * shape.node_ranks),
                ("intra", inside, rows.ranks, per_rank),
            ]
        counts = is_counts(p.op)
        if counts and not sync:
            continue
        if i in returning:
            levels.reverse()
        for n, (level, group, per_token, level_experts) in enumerate(levels):
            name = call["group_name"] + (f":{level}" if level else "")
            phases[name] = "expert"
            nbytes = int(call["nbytes"])
            if not counts:
                # The send buffer's rows: its bytes over one row's (the buffers' trailing sizes).
                spec = p.op.inputs[0]
                row_bytes = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else 0
                traced_rows = nbytes / row_bytes if row_bytes else 0.0
                nbytes = round(traced_rows * per_token / shape.top_k * (row_bytes + side_bytes(shape, level_experts)))
            collective = {**call, "ranks": list(group), "group_name": name, "nbytes": nbytes}
            if n and not counts:
                collective[CHAINED] = True
            out.append(dataclasses.replace(p, op=dataclasses.replace(p.op, collective=collective)))
    return out, phases


def returning_rows(priced: Sequence[PricedOp], group_phases: dict[str, str]) -> set[int]:
    """Indices in ``priced`` of the expert row all-to-alls that carry rows back from the experts (a
    combine, or the backward's gradients of a dispatch); the others carry rows out to them. By position
    in a MoE layer pass: a forward pass (a routing-counts exchange, then 2 C row exchanges, C = the
    forward's row exchanges / (2 * its count exchanges)) runs out, out, back, out, back, ..., back
    (chunk k + 1's dispatch before chunk k's combine: d0, d1, c0, d2, c1, ..., c(C-1)); a backward
    pass (2 C row exchanges with no count exchange before them: a recomputed forward's have one) runs
    the same in reverse, each the other way (a combine's gradients go out). Where C does not come out
    whole, every exchange is taken as going out."""
    exchanges = []
    for i, p in enumerate(priced):
        call = p.op.collective
        if p.work.kind != "collective" or call is None or call["op"] != "all_to_all":
            continue
        if collective_account(p.op, group_phases)[1] == "expert" and p.op.stage in ("forward", "backward"):
            exchanges.append((i, p.op.stage, is_counts(p.op)))
    forward_counts = sum(1 for _, stage, counts in exchanges if stage == "forward" and counts)
    forward_rows = sum(1 for _, stage, counts in exchanges if stage == "forward" and not counts)
    if not forward_counts or forward_rows % (2 * forward_counts):
        return set()
    chunks = forward_rows // (2 * forward_counts)
    forward = [False] + [back for k in range(chunks) for back in ([False, True] if k + 1 < chunks else [True])]
    backward = [not back for back in reversed(forward)]
    returning: set[int] = set()
    pending: dict[str, list[bool]] = {"forward": [], "backward": []}
    reversed_seen = {"forward": 0, "backward": 0}
    for i, stage, counts in exchanges:
        if counts:
            pending[stage] = list(forward)
            continue
        if pending[stage]:
            back = pending[stage].pop(0)
        else:
            back = backward[reversed_seen[stage] % len(backward)]
            reversed_seen[stage] += 1
        if back:
            returning.add(i)
    return returning


def _in_experts(location: str) -> bool:
    return any(part.partition(">")[0] == "GroupedExperts" for part in location.split("/"))


def expert_overlap(
    priced: Sequence[PricedOp],
    microbatches_traced: int,
    group_phases: dict[str, str],
    chunks: int | None = None,
    levels: int = 1,
) -> list[ExpertOverlap]:
    """The chunked expert all-to-alls of one microbatch, forward and backward (docs/projection-formulas.md):
    ``chunks`` given (a layout's ``a2a_chunks``) or read from the routing-counts exchanges; ``levels``:
    the row exchanges one chunk's dispatch makes (per-node: 2)."""
    exchanges: dict[str, dict[tuple[int, ...], list[int]]] = {"forward": {}, "backward": {}}
    counts = {"forward": 0, "backward": 0}
    compute = {"forward": 0.0, "backward": 0.0}
    for p in priced:
        stage = p.op.stage
        if stage not in compute:
            continue
        if p.work.kind != "collective":
            if _in_experts(p.op.location):
                compute[stage] += p.seconds
            continue
        call = p.op.collective
        if call is None:
            raise ValueError(f"traced op {p.op.name} is priced as a collective but has no collective record")
        _, account = collective_account(p.op, group_phases)
        if account != "expert" or call["op"] != "all_to_all":
            continue
        if is_counts(p.op):
            counts[stage] += 1  # the routing counts, once per forward pass
            continue
        exchanges[stage].setdefault(tuple(call["ranks"]), []).append(int(call["nbytes"]))
    rows = {stage: sum(map(len, by_group.values())) for stage, by_group in exchanges.items()}
    if chunks is None:
        if not counts["forward"] or rows["forward"] % (2 * counts["forward"] * levels):
            return []
        chunks = rows["forward"] // (2 * counts["forward"] * levels)
    overlaps = []
    for stage, by_group in exchanges.items():
        if not rows[stage] or rows[stage] % (2 * chunks * levels):
            continue
        calls = tuple(
            Collective(
                "all_to_all",
                ranks,
                round(statistics.fmean(sizes)),
                "expert",
                max(1, round(len(sizes) / microbatches_traced)),
            )
            for ranks, sizes in by_group.items()
        )
        passes = rows[stage] / (2 * chunks * levels) / microbatches_traced
        overlaps.append(ExpertOverlap(chunks, passes, calls, compute[stage] / microbatches_traced, stage))
    return overlaps


def project_priced_step(
    prices: StepPrices,
    rank: int,
    schedule: Schedule,
    net: Network,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    skew: SkewModel | None = None,
    overlap: str = "chunks",
    pairs: Pairs | None = None,
    pipeline: PairedPipeline | None = None,
) -> Projection:
    """The projected step of a priced trace (docs/projection-formulas.md); ``overlap``: ``project_step``'s;
    ``pairs``: under the microbatches overlap, the rank's pairs and actions alone
    (``bench.predict.overlap.overlapped_pairs``); ``pipeline``: under pp > 1, the paired plan they come from."""
    microbatch_overlap = None
    if overlap == "microbatches":
        if pairs is None:
            raise ValueError("pairs: the microbatches overlap needs the rank's pairs")
        if set(prices.programs) != {"forward", "backward"}:
            raise ValueError(
                "trace: the expert all-to-alls of a direction do not split evenly over the traced microbatches; "
                "the microbatches overlap cannot be priced"
            )
        backward = prices.programs["backward"].priced(rank, net)
        microbatch_overlap = MicrobatchOverlap(
            prices.programs["forward"].priced(rank, net),
            backward,
            *pairs,
            pipeline=pipeline,
            weight_s=min(prices.timing.weight_grad_s or 0.0, backward.compute_s),
        )
    projection = project_step(
        rank,
        prices.timing,
        prices.per_microbatch,
        prices.per_step,
        schedule,
        net,
        tokens_per_step,
        world_size,
        flops_per_token,
        prices.grad_buckets,
        prices.gather_buckets,
        skew,
        prices.expert_overlap,
        overlap,
        microbatch_overlap,
    )
    projection.assumptions.extend(_trace_assumptions(prices))
    return projection


def _trace_assumptions(prices: StepPrices) -> list[str]:
    return [
        (
            f"the proxy's stand-ins for its simulated peers ({prices.stand_ins} traced ops: fabricated received "
            "rows, counts and stage messages, the peers' routers replayed) cost 0: a real rank runs none of them, "
            "it receives those tensors through the collectives priced on the network"
        ),
        (
            f"ops that run once per step inside the forward or backward (a gradient bucket's 1/dp scaling as its "
            f"reduction launches: {prices.once_per_step_s * 1e3:.3f} ms) count once per step, with the optimizer, "
            "not once per microbatch"
        ),
    ]
