"""Projection: one rank's measured compute and collectives priced as a step time on a whole cluster.

A run on a few ranks measures how long one rank computes a microbatch and records every collective it
issued with its byte size. The projection prices those collectives on a target network with an
alpha-beta model (a fixed cost per message plus bytes over bandwidth) and assembles the step the
pipeline schedule would run. Pure arithmetic on the standard library: nothing here needs torch.

Notation: B = bytes of a collective (see ``Collective.nbytes`` for which buffer), n = ranks in its group,
g = gpus_per_node, alpha = latency_us * 1e-6 s, bw_intra / bw_inter = intra_node_gbps / inter_node_gbps
* 1e9 bytes/s, m = microbatches, v = virtual_stages.

Network
    Rank r sits on node r // g. A group spans nodes when its ranks are not all on one node; it is then
    priced at bw_inter, else at bw_intra (beta below). Bandwidths are per GPU, each direction.

Collectives (seconds of one call, times ``count``; every op but send/recv costs 0 when n = 1)
    all_to_all:      (n-1) alpha + max(B (l-1)/n / bw_intra, B (n-l)/n / bw_inter)
                     l = the group's ranks on the projected rank's node (itself included); the (l-1)/n of
                     the buffer that stays on the node and the (n-l)/n that leaves it move in parallel
    all_reduce:      2 (n-1) alpha + 2 (n-1)/n B / beta                 (ring: reduce-scatter + all-gather)
    reduce_scatter:  (n-1) alpha + (n-1)/n B / beta                     (ring; B = the whole input)
    all_gather:      (n-1) alpha + (n-1)/n B / beta                     (ring; B = the whole output)
    broadcast:       (n-1) alpha + B / beta                             (pipelined ring)
    barrier:         2 ceil(log2 n) alpha                               (dissemination, no payload)
    send, recv:      alpha + B / beta                                   (beta from whether the pair shares a node)
    A send and its matching recv are recorded by the two ranks for different messages, so each entry is
    priced on its own.

Overlapped syncs (the gradient reductions under the last microbatch's backward, the ZeRO-1 parameter
gathers under the optimizer's updates)
    The engine launches one collective per bucket as soon as the bucket is ready, in a fixed order,
    while the rank still computes: a reduction once its parameters have their last gradient (during
    the last microbatch's backward, whatever m and pp), a gather once its update is written (during
    the next buckets' updates). Buckets i = 1..N in launch order; c_i = the price of bucket i's
    collective (formulas above); w_i = its window, the rank's compute still to run when it launches,
    the compute ending at time 0, so it launches at -w_i. The collectives queue on one link, in launch
    order (dense and expert groups share the GPU's NIC):
        s_i = max(-w_i, e_(i-1))   (e_0 = -inf)       start of bucket i's collective
        e_i = s_i + c_i                               its end
        exposed = max(0, e_N)                         what the step waits for after the compute
        hidden  = sum_i c_i - exposed
    Windows hold compute only: the expert all-to-alls and stage messages of the backward still to run
    use the same link, so their time hides nothing. Per-step "grad" entries not given as buckets
    (collectives with no known launch time) launch when the backward ends (w = 0), after the buckets.

Overlap windows of a scaled-down run (``bench.predict.proxy_projection.scaled_sync_buckets``)
    A proxy measures each bucket on a run of fewer blocks and tokens than the scenario's: R =
    block_ratio, s = token_ratio (``bench.run.proxy.scale.ProxyScale``), C = ceil(R) copies of the run's
    blocks. The compute a window holds is split as measured into a (block phases), r (rest: what no
    phase times), e (embedding) and g (later buckets' launches, scaling each by 1/dp), with the
    proxy's fabrication of peers' data left out. a scales as the blocks' compute does, by s R; e
    and g do not grow with the tokens (the embedding's backward makes a whole V x D gradient, a
    launch scales a bucket); nor does r, which after the first launch is the trainer's own code
    around the end of the backward (the final norm's backward on the last stage is the only token
    work in it, and it is small). A = the blocks' backward of one microbatch in the run. A bucket of block parameters only that filled up (reached ``bucket_elements``)
    stands for C buckets at full scale, one per copy of the blocks (copy k = 0 .. C-1 in backward
    order), each with R / C of its bytes; any other bucket (embedding, LM head, final norm, one that
    mixes them with block parameters, or one left open to the end of the walk, which at full scale
    would collect the later copies' parameters as well and launch as late) stays one bucket, its
    bytes (1 - f + f R) times the run's, f = the block share of its parameters.
        reduction, block bucket, copy k:  w = (a + (C - 1 - k) A) s R / C + r + e + g
        reduction, other bucket:          w = a s R + r + e + g
    that is, after copy k the later copies' blocks still run; their launches and rest are not
    counted (slightly pessimistic). A gather hides under the updates still to run after its own;
    u_l = bucket l's measured update, which follows its share's bytes:
        gather, block bucket j, copy k:   w = (U_j + (C - 1 - k) U_b) R / C + V_j
        gather, other bucket j:           w = U_j R + V_j
        U_j = sum of u_l over the block buckets after j, U_b = over all block buckets,
        V_j = sum of u_l (1 - f_l + f_l R) over the other buckets after j
    The buckets queue in the order of their windows, the longest first: the engine's fixed launch
    order. At the run's own scale (R = s = C = 1) the windows are the measured ones.

Overlapped expert all-to-alls (chunked dispatch: ``parallel.a2a_chunks`` = C > 1, ``ExpertOverlap``)
    Each MoE layer pass (a forward, a backward, a recomputed forward) sends its rows out and back in
    C chunks: chunk k+1's dispatch travels while chunk k's experts compute, chunk k's combine while
    chunk k+1's do (``moe_engine.moe.dispatch``). Per direction (forward, backward) of one microbatch:
    P = its MoE layer passes, A = the seconds of their row all-to-alls (formulas above), X = the
    seconds of the experts' own ops; each pass has 1/P of both. A pass's link carries its messages one
    at a time in the order the engine issues them, d_0, d_1, c_0, d_2, c_1, ..., d_(C-1), c_(C-2),
    c_(C-1), each dispatch d_k and combine c_k of a/(2C) seconds (a = A/P: out and back move the same
    rows); chunk k's experts (x/C, x = X/P) start when d_k has arrived and chunk k-1's are done; c_k
    starts when chunk k's experts are done and the link is free:
        e_k     = max(end(d_k), e_(k-1)) + x/C                 (e_(-1) = 0; d_0 starts at 0)
        exposed = end(c_(C-1)) - x,   hidden = a - exposed     (per pass; C = 1: exposed = a)
    With compute to spare only the first chunk's dispatch and the last chunk's combine show (a/C);
    with none, all of a. The backward is priced by the same rule (its engine order differs: every
    combine's gradient leaves first, then each chunk's dispatch gradient after its experts).
    c_exp_hidden = the sum over directions of P * hidden. Compute and the all-to-alls do not slow
    each other (no contention for SMs or memory bandwidth is modelled).

Expert all-to-alls overlapped across microbatches (``ExpertOverlap.MICROBATCHES``: pp = 1 with m >= 2,
or dualpipev)
    The engine runs a microbatch's forward beside another's backward as two programs, one computing at
    a time: the running one starts an exchange of rows (a chunk's included), hands over; the other
    runs until it has started its own next one (or finished), hands back; the first then waits for
    its exchange (``moe_engine.parallel.overlap``). Exchanges with no compute between form a chain
    (per-node rows: the dispatch's inter-node then intra-node level, the combine's intra then inter):
    it hands over once, as it starts, its exchanges back to back on the link. Routing counts (an
    integer all-to-all) are waited for at once: no hand-over. A program is its compute cut at its
    all-to-alls, segments (x_j, a_j) then a tail (``bench.predict.op_projection.traced_programs``: the
    mean over the traced microbatches; a chain is one segment, a_j its exchanges' seconds summed, as
    ``engine_dispatch`` marks it). Simulated with the all-to-alls queued on one link:
        on resuming:   clock = max(clock, end of its all-to-all in flight)
        counts:        clock = link = max(clock + x_j, link) + a_j; go on (its group's collectives run
                       in issue order: it waits behind what is in flight)
        a segment:     clock += x_j; link = max(clock, link) + a_j; its all-to-all ends at link; hand over
        the tail:      clock += tail; done (the other runs on alone, waiting for each of its own)
        exposed(F, B) = clock at the end - the compute of both (the counts' waits included)
    So each exchange of rows hides behind the other program's compute segment, bounded segment by
    segment; a program alone (partner NOTHING) waits for each of its all-to-alls: exposed = its all-to-alls. Per
    step: p pairs, u_f forwards and u_b backwards alone (microbatches):
        pp = 1:     p = m - 1, u_f = u_b = 1 (the first forward, the last backward)
        dualpipev:  p = OVERLAP_F_B actions of the rank in torch's ScheduleDualPipeV plan / 2 (an action
                    pairs two stage chunks, half a microbatch of the rank's blocks), u_f = u_b = (2m - 2p) / 2
        exposed_step = p exposed(F, B) + u_f (A_F - h_F) + u_b (A_B - h_B)
    A_F, A_B = a direction's all-to-alls, h_F, h_B = what its chunks hide alone (the chunked rule above);
    c_exp - c_exp_hidden = exposed_step / m.

Dispatch rows (``bench.predict.dispatch_rows``; what a row carries: ``DispatchRows``)
    A token picks k of E experts without replacement; a rank holds L = E / ep consecutive experts, a
    node g L (g = ranks_per_node; None: the profile's gpus_per_node where g < ep). Random routing's
    expected distinct destinations (hypergeometric):
        D_r = ep (1 - C(E - L, k) / C(E, k))        D_n = N (1 - C(E - gL, k) / C(E, k)),  N = ep / g
    measured routing: the counts over the drawn routes. Rows per token: per-expert k, per-rank D_r;
    per-node D_n across nodes (to the rank with the same local index there: a group of N ranks, one a
    node, so (N - 1)/N of the bytes leave the node) and then D_r inside the node (a group of g ranks:
    (g - 1)/g of the bytes move over NVLink), one level after the other; each row also carries 8 min(k,
    experts a destination holds) bytes of router weights and expert ids. Each is an all_to_all priced
    as above. A traced proxy rank sends per-expert rows (B bytes, sync dispatch's from the replayed
    routes, no-sync's capacity buffers); ``bench.predict.op_projection.engine_dispatch`` prices the
    engine's exchanges from them: B / row bytes * D / k rows (no-sync: the engine sizes its buffers by
    the same expectation times capacity_factor), routing counts per level under sync, none under no-sync;
    per-node's levels in the engine's order (rows out: inter-node first; back: intra-node first), one chain.

Step (times in seconds; c_exp, c_pipe, c_fsdp = summed seconds of one microbatch's "expert", "pipeline"
and "fsdp" entries)
    t_mb      = microbatch_s + c_exp - c_exp_hidden + c_pipe + max(0, c_fsdp - microbatch_s)
                (dispatch all-to-alls and stage messages sit on the critical path: no overlap with
                 compute is assumed but the chunked dispatch's or the microbatches' above; FSDP's
                 parameter gathers are prefetched, each unit's under the compute of the unit
                 before, so only what outlasts the microbatch's compute shows)
    bubble    = 0                          pp = 1
                (pp - 1) t_mb              gpipe, 1f1b   (pipeline time (m + pp - 1) t_mb)
                (pp - 1) t_mb / v          interleaved1f1b
                zero-bubble schedules, from F (forward), B (input gradients) and W (weight gradients)
                of one microbatch: t_mb split in the proportions of its compute (F = forward_s, W =
                weight_grad_s, B = the rest), a chunk 1/v of each (v = 2 for zbv and dualpipev):
                (pp - 1) max(0, F + B - W) / v       interleaved-zb (ZB1P: (pp-1)(F + B_full - 2W),
                                                     B_full = B + W; Qi et al., Zero Bubble Pipeline
                                                     Parallelism, 2024; torch's ScheduleInterleavedZeroBubble)
                (pp - 1) max(0, F + B - 2W) / 2      zbv (ZB-V: zero when F = B = W; same paper, section 6)
                (pp - 1) max(0, F + 2B - W) / 2      dualpipev ((PP/2 - 1)(F&B + B_full - 3W) of the DeepSeek-V3
                                                     report over its 2 pp stages, F&B = F + B_full: the pair's
                                                     all-to-alls hidden)
    pipeline  = m t_mb + bubble            (every stage is assumed as slow as the measured rank)
    grad      = the overlapped-sync simulation of the reduction buckets, then the unbucketed per-step
                "grad" entries at w = 0: grad_sync_exposed, grad_sync_hidden
    gather    = the overlapped-sync simulation of the gather buckets: param_gather_exposed,
                param_gather_hidden
    other     = summed seconds of the per-step "other" entries (never hidden)
    step      = pipeline + grad_sync_exposed + optimizer_s + param_gather_exposed + other + skew

Breakdown (sums to the step)
    compute = m microbatch_s, expert_comm = m (c_exp - c_exp_hidden), pipeline_comm = m c_pipe,
    fsdp_gather_exposed = m max(0, c_fsdp - microbatch_s), bubble, grad_sync_exposed, optimizer,
    param_gather_exposed, other_comm, skew; beside them, not part of the sum: grad_sync_hidden,
    grad_sync_total (= hidden + exposed), param_gather_hidden, param_gather_total, fsdp_gather_total =
    m c_fsdp, expert_comm_hidden = m c_exp_hidden, expert_comm_total = m c_exp.

Rank skew (``SkewModel``; the ``skew`` entry of the breakdown, 0 without a model)
    A collective completes when the slowest rank of its group reaches it. Ranks' compute between two
    consecutive blocking collectives (a segment) varies by independent noise; the step has S of them,
    and the wait at each is E[max of n] - mean = z_n sigma_seg (z_n = E[max of n standard normals],
    z_2 = 1/sqrt(pi)). With sigma_step^2 = S sigma_seg^2 the variance of a rank's step and
    cv = sigma_step / step (the step-time spread real multi-rank runs record):
        skew = z_n sqrt(S) cv compute
    S = m * (the per-microbatch collectives' calls) + the per-step "other" calls + 1 (the step's end,
    where the gradient sync completes); n = the largest group among them. The assumption: the noise
    is independent between segments and ranks; shared slowdowns (the whole machine) count in cv too,
    which makes this an upper estimate where they dominate.

Throughput
    tokens_per_s_per_gpu = tokens_per_step / step / world_size
    tflops_per_gpu       = flops_per_token * tokens_per_step / step / world_size / 1e12

The modules: the network and each collective's price (``bench.predict.collectives``), the overlapped syncs
and chunked expert all-to-alls (``bench.predict.overlap``), the rank-skew waits (``bench.predict.skew``);
this one holds the schedule, the rank's compute and the step they assemble (``project_step``), and the
formulas of all four above.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.predict.collectives import (
    Collective,
    Network,
    collective_seconds,
    is_int,
    is_number,
)
from bench.predict.overlap import ExpertOverlap, MicrobatchOverlap, SyncBucket, expert_hidden_s, simulate_sync
from bench.predict.skew import SkewModel, skew_seconds, sync_points

__all__ = [
    "BESIDE_KEYS",
    "BREAKDOWN_KEYS",
    "KINDS",
    "OVERLAPS",
    "STEP_KEYS",
    "ZERO_BUBBLE",
    "Projection",
    "RankTiming",
    "Schedule",
    "bubble_s",
    "project_step",
]

PER_MICROBATCH_PHASES = ("expert", "pipeline", "fsdp")
PER_STEP_PHASES = ("grad", "other")
KINDS = ("gpipe", "1f1b", "interleaved1f1b", "interleaved-zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
"""Schedules whose ranks hold two stages each, in a V (stage r and 2 pp - 1 - r)."""
ZERO_BUBBLE = ("interleaved-zb", *V_SHAPED)
"""Schedules that run weight gradients apart from input gradients, in the bubble."""
OVERLAPS = ("none", "chunks", "microbatches")
"""How a microbatch's expert all-to-alls overlap compute (``moe_engine.config.ExpertOverlap``, resolved)."""
STEP_KEYS = (
    "compute",
    "expert_comm",
    "pipeline_comm",
    "fsdp_gather_exposed",
    "bubble",
    "grad_sync_exposed",
    "optimizer",
    "param_gather_exposed",
    "other_comm",
    "skew",
)
"""Keys of ``Projection.breakdown_s`` that add up to the step."""
BESIDE_KEYS = (
    "grad_sync_hidden",
    "grad_sync_total",
    "param_gather_hidden",
    "param_gather_total",
    "fsdp_gather_total",
    "expert_comm_hidden",
    "expert_comm_total",
)
"""Keys of ``Projection.breakdown_s`` reported beside the sum (hidden time overlaps the compute)."""
BREAKDOWN_KEYS = STEP_KEYS + BESIDE_KEYS
"""Keys of ``Projection.breakdown_s``."""


@dataclass(frozen=True)
class Schedule:
    """The pipeline schedule the step runs."""

    pp: int
    """Pipeline stages (ranks in a pipeline)."""
    virtual_stages: int
    """Model chunks per pipeline rank (more than one needs interleaved1f1b or interleaved-zb; zbv and
    dualpipev always hold two, given as 1 or 2)."""
    microbatches: int
    """Microbatches per optimizer step on each data-parallel rank."""
    kind: str
    """One of ``KINDS``; ignored when pp == 1."""

    def __post_init__(self) -> None:
        for name in ("pp", "virtual_stages", "microbatches"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"schedule.{name}: must be an integer >= 1, got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"schedule.kind: unknown schedule {self.kind!r}; expected one of {', '.join(KINDS)}")
        # The engine refuses this layout too (ParallelConfig.validate); the bubble formula would not apply.
        if self.kind in V_SHAPED:
            if self.virtual_stages > 2:
                raise ValueError(
                    f"schedule.virtual_stages: {self.kind} holds two stages per rank, got {self.virtual_stages}"
                )
        elif self.virtual_stages > 1 and self.kind not in ("interleaved1f1b", "interleaved-zb"):
            raise ValueError(
                f"schedule.virtual_stages: {self.virtual_stages} stages per rank needs kind interleaved1f1b or "
                f"interleaved-zb, got {self.kind}"
            )

    @property
    def chunks(self) -> int:
        """Stages a rank holds: 2 for the V-shaped schedules, else virtual_stages."""
        return 2 if self.kind in V_SHAPED else self.virtual_stages


@dataclass(frozen=True)
class RankTiming:
    """Compute of the projected rank, per the projection's scale."""

    microbatch_s: float
    """Forward + backward compute of one microbatch on this rank (all its stages), seconds."""
    optimizer_s: float
    """Optimizer step, once per step, seconds (its updates are what ZeRO-1 gathers hide under)."""
    forward_s: float | None = None
    """The forward's share of microbatch_s (F), seconds; the zero-bubble schedules' bubble needs it."""
    weight_grad_s: float | None = None
    """The backward's weight gradients in microbatch_s (W), seconds; the zero-bubble schedules' bubble needs it."""

    def __post_init__(self) -> None:
        for name in ("microbatch_s", "optimizer_s"):
            value = getattr(self, name)
            if not is_number(value) or not value >= 0:
                raise ValueError(f"timing.{name}: must be a number >= 0, got {value!r}")
        for name in ("forward_s", "weight_grad_s"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not value >= 0):
                raise ValueError(f"timing.{name}: must be a number >= 0 or None, got {value!r}")
        if (self.forward_s or 0.0) + (self.weight_grad_s or 0.0) > self.microbatch_s * (1 + 1e-9):
            raise ValueError(
                f"timing: forward_s + weight_grad_s ({self.forward_s} + {self.weight_grad_s}) exceed microbatch_s "
                f"({self.microbatch_s})"
            )


@dataclass(frozen=True)
class Projection:
    """The projected step of one rank on the target cluster."""

    step_s: float
    """Projected optimizer step time, seconds."""
    tokens_per_s_per_gpu: float
    """tokens_per_step / step_s / world_size."""
    tflops_per_gpu: float
    """flops_per_token * tokens_per_step / step_s / world_size / 1e12."""
    breakdown_s: dict[str, float]
    """Seconds by cause (``BREAKDOWN_KEYS``); those of ``STEP_KEYS`` add up to step_s."""
    assumptions: list[str]
    """Every modelling assumption behind the numbers, in plain sentences with the formulas used."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return {
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "breakdown_s": dict(self.breakdown_s),
            "assumptions": list(self.assumptions),
        }


def _check_entries(name: str, items: list[Collective], phases: tuple[str, ...], world_size: int, rank: int) -> None:
    elsewhere = "per_step (once per step)" if name == "per_microbatch" else "per_microbatch (one microbatch's)"
    for i, c in enumerate(items):
        if not isinstance(c, Collective):
            raise ValueError(f"{name}[{i}]: expected a Collective, got {type(c).__name__}")
        if c.phase not in phases:
            raise ValueError(
                f"{name}[{i}]: phase {c.phase!r} belongs in {elsewhere}; {name} takes {' and '.join(phases)}"
            )
        if max(c.ranks) >= world_size:
            raise ValueError(f"{name}[{i}]: {c.op} group {c.ranks!r} names a rank >= world_size={world_size}")
        if rank not in c.ranks:
            raise ValueError(f"{name}[{i}]: rank {rank} is not in the {c.op} group {c.ranks!r}")


def _seconds(items: list[Collective], phase: str, rank: int, net: Network) -> float:
    return sum(collective_seconds(c, rank, net) for c in items if c.phase == phase)


def bubble_s(schedule: Schedule, t_mb: float, timing: RankTiming) -> float:
    """The pipeline's idle time of one step (the formulas in the module docstring, section "Step")."""
    pp, v = schedule.pp, schedule.chunks
    if pp == 1:
        return 0.0
    if schedule.kind not in ZERO_BUBBLE:
        # Warm-up and drain run chunk-sized pieces of a microbatch, 1/v of one each (v = 1: whole ones).
        return (pp - 1) * t_mb / v
    if timing.forward_s is None or timing.weight_grad_s is None:
        raise ValueError(f"timing: the {schedule.kind} schedule's bubble needs forward_s and weight_grad_s")
    # F, B (input gradients) and W of one microbatch, with its exposed communication spread over them
    # in proportion; a chunk holds 1/v of each.
    scale = t_mb / timing.microbatch_s if timing.microbatch_s else 0.0
    f, w = timing.forward_s * scale, timing.weight_grad_s * scale
    b = t_mb - f - w
    if schedule.kind == "interleaved-zb":
        per_chunk = f + b - w  # ZB1P: (p - 1)(F + B_full - 2W), B_full = B + W
    elif schedule.kind == "zbv":
        per_chunk = f + b - 2 * w  # ZB-V: zero when F = B = W
    else:
        per_chunk = f + 2 * b - w  # DualPipeV: (p - 1)(F&B + B_full - 3W), F&B = F + B_full
    return (pp - 1) * max(0.0, per_chunk) / v


def _overlap_assumption(overlaps: list[ExpertOverlap], overlap: str) -> str:
    if overlap == "microbatches":
        return (
            "expert all-to-alls overlapped across microbatches: a microbatch's forward runs beside another's "
            "backward, one computing at a time, handing over at each exchange of rows it starts (a chain of "
            "them with no compute between, per-node's two levels, once) and waiting for it when the other has "
            "started its next (or finished); routing counts are waited for at once, exposed; the all-to-alls "
            "queue on one link; forwards "
            "and backwards with no partner (the first and last of pp = 1, dualpipev's lone actions) wait for "
            "theirs, less what their chunks hide; no contention between the all-to-alls and compute"
        )
    chunked = [o for o in overlaps if o.chunks > 1] if overlap == "chunks" else []
    if not chunked:
        return (
            "expert all-to-alls (where the layout has them): each layer's rows out and back whole, on the "
            "critical path, not overlapped with compute"
        )
    return (
        f"expert all-to-alls in {chunked[0].chunks} chunks per MoE layer pass (parallel.a2a_chunks): chunk "
        "k+1's dispatch moves while chunk k's experts compute, chunk k's combine while chunk k+1's do; per "
        "pass, its dispatches and combines (half of its all-to-all time each) queue on one link in the "
        "engine's order d0, d1, c0, d2, c1, ..., c(C-1), each chunk's experts (the experts' traced seconds / "
        "(passes * C)) start when its dispatch arrived and the chunk before is done, its combine when they "
        "are done; exposed = the pass's end - its expert compute, at least the first dispatch and the last "
        "combine; the backward by the same rule; no contention between the all-to-alls and compute"
    )


def _assumptions(schedule: Schedule, net: Network, grad_buckets: int, gather_buckets: int) -> list[str]:
    pp, v = schedule.pp, schedule.chunks
    if pp == 1:
        pipeline = "no pipeline (pp = 1): the step runs m microbatches back to back, m * t_mb, no bubble"
    elif schedule.kind in ZERO_BUBBLE:
        rule = {
            "interleaved-zb": "ZB1P: (pp - 1) * max(0, F + B - W) / v",
            "zbv": "ZB-V: (pp - 1) * max(0, F + B - 2W) / 2",
            "dualpipev": "DualPipeV: (pp - 1) * max(0, F + 2B - W) / 2",
        }[schedule.kind]
        pipeline = (
            f"{schedule.kind} over pp = {pp} stages, {v} chunks per rank: pipeline time m * t_mb + bubble, "
            f"bubble = {rule}, F, B (input gradients), W (weight gradients) of one microbatch's t_mb in the "
            "proportions of its compute; every stage is as slow as the measured rank"
        )
    elif schedule.kind == "interleaved1f1b":
        pipeline = (
            f"interleaved 1F1B over pp = {pp} stages with v = {v} chunks per rank: pipeline time "
            "m * t_mb + (pp - 1) * t_mb / v; every stage is as slow as the measured rank"
        )
    else:
        pipeline = (
            f"{schedule.kind} over pp = {pp} stages: pipeline time (m + pp - 1) * t_mb; every stage is "
            "as slow as the measured rank"
        )
    if grad_buckets:
        grad = (
            f"gradient sync: {grad_buckets} bucket reductions launch during the last microbatch's backward, "
            "each w_i seconds of compute before it ends; they queue on one link in launch order, "
            "s_i = max(-w_i, e_(i-1)), e_i = s_i + c_i, exposed = max(0, e_N), hidden = sum c_i - exposed; "
            "gradient collectives without a launch time start when the backward ends"
        )
    else:
        grad = "gradient sync: no bucket launch times given, every gradient collective starts when the backward ends"
    if gather_buckets:
        gather = (
            f"ZeRO-1 parameter gathers: {gather_buckets} buckets launch as their update is written, w_i "
            "seconds of updates before the optimizer ends; same queue on one link"
        )
    else:
        gather = "no overlapped parameter gathers"
    return [
        f"network: {net.gpus_per_node} GPUs per node (rank r on node r // {net.gpus_per_node}), "
        f"{net.intra_node_gbps:g} GB/s per GPU inside a node, {net.inter_node_gbps:g} GB/s per GPU between "
        f"nodes (1 GB = 1e9 bytes), alpha = {net.latency_us:g} us per message",
        "alpha-beta model: a group spanning nodes moves bytes at the inter-node bandwidth, else at the "
        "intra-node one (beta); no contention between concurrent collectives, no protocol overheads",
        "all_to_all: (n-1) * alpha + max(B * (l-1)/n / intra, B * (n-l)/n / inter), l = the group's ranks "
        "on this rank's node, B = this rank's send buffer; the on-node and off-node shares move in parallel",
        "all_reduce (ring): 2 * (n-1) * alpha + 2 * (n-1)/n * B / beta",
        "reduce_scatter and all_gather (ring): (n-1) * alpha + (n-1)/n * B / beta, B = the whole input or output",
        "broadcast (pipelined ring): (n-1) * alpha + B / beta",
        "barrier: 2 * ceil(log2 n) * alpha",
        "send and recv: alpha + B / beta, each recorded message priced on its own",
        "a single-rank group costs nothing (except send and recv)",
        "t_mb = microbatch compute + its expert all-to-alls (less what chunked dispatch hides) + its pipeline "
        "messages: communication inside a microbatch is on the critical path, not overlapped with compute "
        "otherwise; FSDP parameter gathers are prefetched under the compute, only max(0, gathers - compute) "
        "of a microbatch is exposed",
        pipeline,
        grad,
        gather,
        "overlap windows hold compute only (the all-to-alls and stage messages still to run use the link "
        "themselves); a later pipeline stage's sync could also hide under the drain it idles through: not counted",
        "other once-per-step collectives are fully exposed; the optimizer step runs once, after the gradient sync",
        "step = pipeline time + exposed gradient sync + optimizer + exposed parameter gather + other collectives",
    ]


def _skew_assumption(skew: SkewModel | None) -> str:
    if skew is None:
        return "rank skew: not modelled (no measured step-time spread given): ranks reach each collective together"
    return (
        f"rank skew: each blocking collective waits for the slowest rank; skew = z_n * sqrt(S) * cv * compute "
        f"with cv = {skew.cv:.4g} ({skew.source}), S = the step's blocking collectives, n = their largest group; "
        "independent noise between segments and ranks assumed"
    )


def project_step(
    rank: int,
    timing: RankTiming,
    per_microbatch: list[Collective],
    per_step: list[Collective],
    schedule: Schedule,
    net: Network,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    grad_buckets: Iterable[SyncBucket] = (),
    gather_buckets: Iterable[SyncBucket] = (),
    skew: SkewModel | None = None,
    expert_overlap: Iterable[ExpertOverlap] = (),
    overlap: str = "chunks",
    microbatch_overlap: MicrobatchOverlap | None = None,
) -> Projection:
    """The projected step of ``rank`` (formulas in the module docstring).

    ``per_microbatch`` holds the collectives of one microbatch (phases expert and pipeline), ``per_step``
    those issued once per step (phases grad and other) that no bucket stands for; ``tokens_per_step``
    is global. ``grad_buckets`` (the gradient reductions) and ``gather_buckets`` (the ZeRO-1 gathers),
    in launch order, are the overlapped syncs. ``skew``: the rank-skew waits' model (none: 0).
    ``expert_overlap``: the chunked expert all-to-alls of a microbatch, by direction (they are among
    ``per_microbatch``'s expert entries too; none: nothing overlapped). ``overlap``: how the expert
    all-to-alls overlap compute, one of ``OVERLAPS``: none (all exposed), chunks (``expert_overlap``'s
    chunked rule) or microbatches (behind another microbatch's compute: ``microbatch_overlap`` holds
    the interleaved programs and the pairs; a direction that runs alone still hides what its chunks do).
    """
    grad_buckets, gather_buckets, expert_overlap = list(grad_buckets), list(gather_buckets), list(expert_overlap)
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap: unknown overlap {overlap!r}; expected one of {', '.join(OVERLAPS)}")
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size: must be an integer >= 1, got {world_size!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank: must be an integer in [0, {world_size}), got {rank!r}")
    if not is_int(tokens_per_step) or tokens_per_step < 1:
        raise ValueError(f"tokens_per_step: must be an integer >= 1, got {tokens_per_step!r}")
    if not is_number(flops_per_token) or not flops_per_token >= 0:
        raise ValueError(f"flops_per_token: must be a number >= 0, got {flops_per_token!r}")
    if schedule.pp > world_size:
        raise ValueError(f"schedule.pp: {schedule.pp} stages exceed world_size={world_size}")
    _check_entries("per_microbatch", per_microbatch, PER_MICROBATCH_PHASES, world_size, rank)
    _check_entries("per_step", per_step, PER_STEP_PHASES, world_size, rank)
    for name, buckets in (("grad_buckets", grad_buckets), ("gather_buckets", gather_buckets)):
        for i, bucket in enumerate(buckets):
            if not isinstance(bucket, SyncBucket):
                raise ValueError(f"{name}[{i}]: expected a SyncBucket, got {type(bucket).__name__}")
        _check_entries(name, [b.collective for b in buckets], ("grad",), world_size, rank)

    for i, o in enumerate(expert_overlap):
        if not isinstance(o, ExpertOverlap):
            raise ValueError(f"expert_overlap[{i}]: expected an ExpertOverlap, got {type(o).__name__}")
        _check_entries("expert_overlap", list(o.exchanges), ("expert",), world_size, rank)

    m = schedule.microbatches
    expert_total = _seconds(per_microbatch, "expert", rank, net)
    if overlap == "microbatches":
        if microbatch_overlap is None:
            raise ValueError("microbatch_overlap: the microbatches overlap needs the interleaved programs")
        exposed = microbatch_overlap.exposed_s(
            expert_hidden_s(expert_overlap, rank, net, "forward"),
            expert_hidden_s(expert_overlap, rank, net, "backward"),
        )
        # Per microbatch: the step's exposed seconds spread over its m microbatches.
        expert = min(expert_total, max(0.0, exposed / m))
        expert_hidden = expert_total - expert
    else:
        expert_hidden = expert_hidden_s(expert_overlap, rank, net) if overlap == "chunks" else 0.0
        expert = expert_total - expert_hidden
    pipe = _seconds(per_microbatch, "pipeline", rank, net)
    fsdp = _seconds(per_microbatch, "fsdp", rank, net)
    fsdp_exposed = max(0.0, fsdp - timing.microbatch_s)
    t_mb = timing.microbatch_s + expert + pipe + fsdp_exposed
    # Gradient collectives with no launch time start as the backward ends, behind the buckets.
    unbucketed = [SyncBucket(c, 0.0) for c in per_step if c.phase == "grad"]
    grad = simulate_sync([*grad_buckets, *unbucketed], rank, net)
    gather = simulate_sync(gather_buckets, rank, net)
    breakdown = {
        "compute": m * timing.microbatch_s,
        "expert_comm": m * expert,
        "pipeline_comm": m * pipe,
        "fsdp_gather_exposed": m * fsdp_exposed,
        "bubble": bubble_s(schedule, t_mb, timing),
        "grad_sync_exposed": grad.exposed_s,
        "optimizer": timing.optimizer_s,
        "param_gather_exposed": gather.exposed_s,
        "other_comm": _seconds(per_step, "other", rank, net),
        "skew": skew_seconds(
            skew,
            *sync_points(per_microbatch, [*per_step, *(b.collective for b in grad_buckets)], m),
            m * timing.microbatch_s,
        ),
        "grad_sync_hidden": grad.hidden_s,
        "grad_sync_total": grad.total_s,
        "param_gather_hidden": gather.hidden_s,
        "param_gather_total": gather.total_s,
        "fsdp_gather_total": m * fsdp,
        "expert_comm_hidden": m * expert_hidden,
        "expert_comm_total": m * expert_total,
    }
    # Summing the parts (rather than pipeline time + ...) keeps the breakdown adding up to the step exactly.
    step = sum(breakdown[k] for k in STEP_KEYS)
    if not step > 0:
        raise ValueError("projected step time is 0: give the rank some compute, optimizer or communication time")
    return Projection(
        step_s=step,
        tokens_per_s_per_gpu=tokens_per_step / step / world_size,
        tflops_per_gpu=flops_per_token * tokens_per_step / step / world_size / 1e12,
        breakdown_s=breakdown,
        assumptions=_assumptions(schedule, net, len(grad_buckets), len(gather_buckets))
        + [_overlap_assumption(expert_overlap, overlap), _skew_assumption(skew)],
    )
