"""The projection's rules for expert all-to-alls overlapped across microbatches and for the zero-bubble
schedules' bubble, against hand-computed numbers; the breakdown adds up to the step under each."""

from __future__ import annotations

import random

import pytest

from bench.predict.collectives import Collective, Network
from bench.predict.op_projection import step_prices
from bench.predict.ops import OpWork, TensorSpec, TracedOp
from bench.predict.overlap import (
    NOTHING,
    MicrobatchOverlap,
    PairedPipeline,
    Pairs,
    Program,
    interleaved_exposed_s,
    overlapped_pairs,
)
from bench.predict.pipeline_replay import ChunkSeconds, replay_idle_s
from bench.predict.pricing import PricedOp
from bench.predict.projection import KINDS, STEP_KEYS, RankTiming, Schedule, bubble_s, project_step

SEED = 7

# Two ranks on one node at 1 GB/s, no latency: an all-to-all of B bytes costs B / 2e9 s.
NET = Network(gpus_per_node=2, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
PAIR = (0, 1)


# A program: (compute before an all-to-all, the all-to-all) segments, then its tail of compute.
LONG_F = Program(((1.0, 2.0),), 1.0)
LONG_B = Program(((3.0, 1.0),), 1.0)


def test_interleaving_compute_longer_than_the_all_to_alls_hides_them():
    # F computes 0-1, starts its 2 s all-to-all (link 1-3), hands over; B computes 1-4, starts its 1 s
    # one (link 4-5), hands over; F's arrived at 3, its tail 4-5; B's arrived at 5, its tail 5-6.
    # Compute 6 s, makespan 6 s: nothing exposed.
    assert interleaved_exposed_s(LONG_F, LONG_B) == pytest.approx(0.0, abs=1e-12)


def test_interleaving_compute_shorter_than_the_all_to_alls_shows_the_rest():
    # F 0-1, all-to-all 1-6; B 1-2, its all-to-all queues behind F's on the link: 6-11; F waits to 6,
    # tail 6-7; B waits to 11, tail 11-12. Compute 4 s, makespan 12: 8 s of the 10 exposed.
    short = Program(((1.0, 5.0),), 1.0)
    assert interleaved_exposed_s(short, short) == pytest.approx(8.0, rel=1e-12)


def test_segment_by_segment_not_in_total():
    # F: 1 s then a 3 s all-to-all, then 0.1 s then a 3 s one, tail 1 s; B: 3 s, a 0.1 s all-to-all, tail 3 s.
    # Totals (F 2.1 s compute, 6 s all-to-all; B 6 s compute) would hide all but 0.1 s; segment by
    # segment: F 0-1, a1 1-4; B 1-4, b1 4-4.1; F waits a1 (4), 4-4.1, a2 4.1-7.1; B waits b1 (4.1), tail
    # 4.1-7.1; F waits a2 (7.1), tail 7.1-8.1. Compute 8.1 s, makespan 8.1: 0 exposed.
    f = Program(((1.0, 3.0), (0.1, 3.0)), 1.0)
    b = Program(((3.0, 0.1),), 3.0)
    assert interleaved_exposed_s(f, b) == pytest.approx(0.0, abs=1e-12)
    # The same forward beside a backward whose all-to-all comes late: F 0-1, a1 1-4; B 1-6.9, b1 6.9-7;
    # F waits a1 (arrived), 6.9-7.0, a2 7-10; B waits b1 (7), tail 7-7.1; F waits a2 to 10, tail 10-11.
    # Compute 8.1 s, makespan 11: 2.9 exposed (a2 had only B's 0.1 s tail to hide behind).
    late = Program(((5.9, 0.1),), 0.1)
    assert interleaved_exposed_s(f, late) == pytest.approx(2.9, rel=1e-12)


def test_alone_waits_for_every_all_to_all():
    assert interleaved_exposed_s(LONG_F, NOTHING) == pytest.approx(2.0, rel=1e-12)
    assert interleaved_exposed_s(NOTHING, LONG_B) == pytest.approx(1.0, rel=1e-12)


def test_interleaving_never_hides_more_than_the_partner_computes():
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for _ in range(500):
        programs = [
            Program(
                tuple((rng.uniform(0, 2), rng.uniform(0, 2), rng.random() < 0.7) for _ in range(rng.randint(0, 6))),
                rng.uniform(0, 2),
            )
            for _ in range(2)
        ]
        exposed = interleaved_exposed_s(*programs)
        total = sum(p.alltoall_s for p in programs)
        # What is waited for at once (routing counts) always shows.
        assert sum(p.waited_s for p in programs) - 1e-9 <= exposed <= total + 1e-9
        hidden = total - exposed
        assert hidden <= programs[0].compute_s + programs[1].compute_s + 1e-9


# A chain: exchanges with no compute between (the per-node dispatch's inter-node rows, then the
# intra-node ones) hands over once, as it starts, its exchanges back to back on the link.
CHAIN_F = Program(((1.0, 1.0 + 1.0),), 2.0)
CHAIN_B = Program(((2.0, 1.0),), 2.0)


def test_a_chain_hands_over_once_by_hand():
    # F 0-1, starts the chain (inter 1-2, intra 2-3 on the link), hands over; B 1-3, its all-to-all
    # 3-4, hands over; F's chain arrived at 3, tail 3-5, done; B's arrived at 4, tail 5-7. Compute 7 s,
    # makespan 7: nothing exposed.
    assert interleaved_exposed_s(CHAIN_F, CHAIN_B) == pytest.approx(0.0, abs=1e-12)
    # Handing over at each exchange of the chain instead: F 0-1, inter 1-2, hands over; B 1-3, b 3-4;
    # F resumes at 3, starts intra at once (no compute), 4-5 behind b, hands over; B waits b to 4,
    # tail 4-6; F waits intra (5), tail 6-8. Makespan 8: 1 s exposed.
    two_hand_overs = Program(((1.0, 1.0), (0.0, 1.0)), 2.0)
    assert interleaved_exposed_s(two_hand_overs, CHAIN_B) == pytest.approx(1.0, rel=1e-12)


# Routing counts (0.5 s) waited for at once, then rows: F: 0.5 s, counts, 0.5 s, a 2 s all-to-all,
# tail 1 s; B: 2 s, a 1 s all-to-all, tail 1 s.
COUNTS_F = Program(((0.5, 0.5, False), (0.5, 2.0)), 1.0)
COUNTS_B = Program(((2.0, 1.0),), 1.0)


def test_routing_counts_are_waited_for_at_once_by_hand():
    # F 0-0.5, counts 0.5-1.0, F waits for them (no hand-over), 1.0-1.5, rows 1.5-3.5, hands over;
    # B 1.5-3.5, its all-to-all 3.5-4.5, hands over; F's arrived at 3.5, tail 3.5-4.5, done; B's at
    # 4.5, tail 4.5-5.5. Compute 5 s, makespan 5.5: the counts' 0.5 s, all of it.
    assert COUNTS_F.waited_s == 0.5 and COUNTS_F.alltoall_s == 2.5
    assert interleaved_exposed_s(COUNTS_F, COUNTS_B) == pytest.approx(0.5, rel=1e-12)
    # Handing over at the counts instead: F 0-0.5, counts 0.5-1.0, hands over; B 0.5-2.5, b 2.5-3.5;
    # F resumes at 2.5, 2.5-3.0, rows 3.5-5.5 behind b; B waits b to 3.5, tail 3.5-4.5; F waits to
    # 5.5, tail 5.5-6.5. Makespan 6.5: 1.5 s exposed.
    counts_hand_over = Program(((0.5, 0.5), (0.5, 2.0)), 1.0)
    assert interleaved_exposed_s(counts_hand_over, COUNTS_B) == pytest.approx(1.5, rel=1e-12)
    # Counts queue behind what is in flight on the link: B 0-2, b 2-3, hands over; F at 2: 2-2.5,
    # counts wait for b, 3-3.5, 3.5-4, rows 4-6, hands over; B's arrived at 3, tail 4-5, done; F waits
    # to 6, tail 6-7. Compute 5 s, makespan 7: 2 s exposed, all of it while F waits for its counts
    # (0.5 s behind b, then their own 0.5 s) or its rows (1 s).
    assert interleaved_exposed_s(COUNTS_B, COUNTS_F) == pytest.approx(2.0, rel=1e-12)
    # Alone: every all-to-all waited for, 2.5 s.
    assert interleaved_exposed_s(COUNTS_F, NOTHING) == pytest.approx(2.5, rel=1e-12)


def test_the_step_counts_the_routing_counts_as_exposed_by_hand():
    # m = 4 on pp = 1: 3 pairs of 0.5 s exposed (the counts), the first forward alone 2.5 s, the last
    # backward alone 1 s: 5 s of the step's 4 * 3.5 = 14 s exposed.
    pairing = MicrobatchOverlap(COUNTS_F, COUNTS_B, *overlapped_pairs("1f1b", 1, 0, 4))
    assert pairing.exposed_s() == pytest.approx(3 * 0.5 + 2.5 + 1.0, rel=1e-12)
    step = _step("microbatches", COUNTS_F, COUNTS_B)
    b = step.breakdown_s
    assert (b["expert_comm"], b["expert_comm_hidden"], b["expert_comm_total"]) == pytest.approx((5.0, 9.0, 14.0))
    # Compute 4 * 5 s, the exposed 5 s, the optimizer 0.5 s.
    assert step.step_s == pytest.approx(4 * 5.0 + 5.0 + 0.5, rel=1e-12)
    assert sum(b[k] for k in STEP_KEYS) == pytest.approx(step.step_s, rel=1e-12)


def test_a_weight_backward_beside_an_input_backward_by_hand():
    # A backward of 3 s compute (two 1 s segments, 1 s tail) and two 0.5 s all-to-alls; 0.6 s of it
    # weight gradients. The input backward keeps 0.8 of each piece: 0.8, 0.8, tail 0.8. Beside it
    # another microbatch's weight backward in two 0.3 s slices, one per hand-over:
    # I 0-0.8, its all-to-all 0.8-1.3; W 0.8-1.1; I waits 1.1-1.3, computes 1.3-2.1, all-to-all
    # 2.1-2.6; W 2.1-2.4; I waits 2.4-2.6, its tail 2.6-3.4: 0.4 s exposed, where alone it is 1 s.
    backward = Program(((1.0, 0.5), (1.0, 0.5)), 1.0)
    pairing = MicrobatchOverlap(backward, backward, 0.0, 0.0, 0.0, 1.0, 0.0, weight_s=0.6)
    inputs, slices = pairing.input_backward, pairing.weight_slices
    assert [x for seg in inputs.segments for x in seg[:2]] + [inputs.tail_s] == pytest.approx([0.8, 0.5, 0.8, 0.5, 0.8])
    assert [x for seg in slices.segments for x in seg[:2]] + [slices.tail_s] == pytest.approx([0.3, 0.0, 0.3])
    assert interleaved_exposed_s(pairing.input_backward, pairing.weight_slices) == pytest.approx(0.4, rel=1e-12)
    assert pairing.exposed_s() == pytest.approx(0.4, rel=1e-12)
    # Weight gradients as long as the all-to-alls hide them whole (1.5 s: slices of 0.75 s).
    covering = MicrobatchOverlap(backward, backward, 0.0, 0.0, 0.0, 1.0, 0.0, weight_s=1.5)
    assert covering.exposed_s() == pytest.approx(0.0, abs=1e-12)
    # A full backward (the first stage's) beside them: its own compute waits for its own all-to-alls as
    # before; the slices hide 0.3 s of each: 0.4 s again.
    full = MicrobatchOverlap(backward, backward, 0.0, 0.0, 0.0, 0.0, 1.0, weight_s=0.6)
    assert full.exposed_s() == pytest.approx(0.4, rel=1e-12)
    with pytest.raises(ValueError, match="weight_s"):
        MicrobatchOverlap(backward, backward, 0.0, 0.0, 0.0, weight_s=3.5)


def test_overlapped_pairs():
    # pp = 1: m - 1 pairs, the first forward and the last backward alone.
    assert overlapped_pairs("1f1b", 1, 0, 8) == Pairs(7.0, 1.0, 1.0)
    # dualpipev, pp 2, 4 microbatches: rank 0 runs 3 OVERLAP_F_B actions of its 8 forward and 8
    # backward stage chunks (torch's plan): 1.5 microbatches paired, 2.5 alone each way.
    assert overlapped_pairs("dualpipev", 2, 0, 4) == Pairs(1.5, 2.5, 2.5)
    # interleaved1f1b, pp 2, 2 stages per rank, rank 0's paired plan (written out by hand in
    # tests/unit/moe_engine/parallel/test_paired_plan.py): 3 pairs, 5 forwards and 3 backwards alone, an
    # input and a full backward each beside a weight backward.
    assert overlapped_pairs("interleaved1f1b", 2, 0, 4, 2) == Pairs(1.5, 2.5, 1.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="interleaved1f1b or dualpipev"):
        overlapped_pairs("1f1b", 2, 0, 4)


@pytest.mark.parametrize(
    "kind, pp, v, m", [("dualpipev", 8, 2, 64), ("interleaved1f1b", 8, 7, 64), ("interleaved1f1b", 4, 3, 8)]
)
def test_overlapped_pairs_run_every_microbatch_once_each_way(kind, pp, v, m):
    for rank in range(pp):
        got = overlapped_pairs(kind, pp, rank, m, v)
        assert got.pairs + got.alone_forward == pytest.approx(m, rel=1e-12)
        backwards = got.alone_backward + got.input_beside_weight + got.backward_beside_weight
        assert got.pairs + backwards == pytest.approx(m, rel=1e-12)


def _step(overlap: str, forward: Program, backward: Program, m: int = 4):
    # The trace's all-to-alls: what the programs carry (1 s = 2e9 bytes on NET).
    a2a_s = forward.alltoall_s + backward.alltoall_s
    rows = Collective("all_to_all", PAIR, round(a2a_s * 2e9), "expert", count=1)
    timing = RankTiming(microbatch_s=forward.compute_s + backward.compute_s, optimizer_s=0.5)
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=m, kind="1f1b")
    pairing = MicrobatchOverlap(forward, backward, *overlapped_pairs("1f1b", 1, 0, m))
    return project_step(0, timing, [rows], [], schedule, NET, 4096, 2, 1e6, overlap=overlap, microbatch_overlap=pairing)


def test_a_step_overlapped_across_microbatches_by_hand():
    # Compute longer: 3 pairs hide everything; the first forward (2 s) and the last backward (1 s) wait.
    longer = _step("microbatches", LONG_F, LONG_B)
    b = longer.breakdown_s
    assert (b["expert_comm"], b["expert_comm_hidden"], b["expert_comm_total"]) == pytest.approx((3.0, 9.0, 12.0))
    assert longer.step_s == pytest.approx(4 * 6.0 + 3.0 + 0.5, rel=1e-12)
    # Compute shorter: each pair exposes 8 s of its 10, plus 5 + 5 alone: 34 of 40.
    short = Program(((1.0, 5.0),), 1.0)
    shorter = _step("microbatches", short, short)
    b = shorter.breakdown_s
    assert (b["expert_comm"], b["expert_comm_hidden"], b["expert_comm_total"]) == pytest.approx((34.0, 6.0, 40.0))
    assert shorter.step_s == pytest.approx(4 * 4.0 + 34.0 + 0.5, rel=1e-12)
    # Without overlap all of it shows.
    plain = _step("none", LONG_F, LONG_B)
    assert plain.breakdown_s["expert_comm"] == pytest.approx(12.0)
    assert plain.breakdown_s["expert_comm_hidden"] == 0.0
    assert any("another's backward" in a for a in longer.assumptions)


def test_microbatches_overlap_needs_the_programs():
    timing = RankTiming(microbatch_s=1.0, optimizer_s=0.0)
    with pytest.raises(ValueError, match="interleaved programs"):
        project_step(0, timing, [], [], Schedule(1, 1, 2, "1f1b"), NET, 4096, 2, 1e6, overlap="microbatches")


TIMINGS = {
    # F = B = W = 1 s.
    "equal": RankTiming(microbatch_s=3.0, optimizer_s=0.0, forward_s=1.0, weight_grad_s=1.0),
    # F = 1, B = 1.5, W = 0.5 s.
    "light_w": RankTiming(microbatch_s=3.0, optimizer_s=0.0, forward_s=1.0, weight_grad_s=0.5),
}


@pytest.mark.parametrize(
    "kind, v, timing, bubble",
    [
        # 1F1B: (pp - 1) t_mb = 3 * 3.
        ("1f1b", 1, "equal", 9.0),
        # Interleaved 1F1B, v = 2: 3 * 3 / 2.
        ("interleaved1f1b", 2, "equal", 4.5),
        # ZB1P over 2 chunks: 3 (F + B - W) / 2 = 3 * 1 / 2; 3 (1 + 1.5 - 0.5) / 2 = 3.
        ("interleaved-zb", 2, "equal", 1.5),
        ("interleaved-zb", 2, "light_w", 3.0),
        # ZB-V: 3 max(0, F + B - 2W) / 2: zero when F = B = W; 3 (1 + 1.5 - 1) / 2 = 2.25.
        ("zbv", 2, "equal", 0.0),
        ("zbv", 2, "light_w", 2.25),
        # DualPipeV: 3 (F + 2B - W) / 2 = 3 * 2 / 2; 3 (1 + 3 - 0.5) / 2 = 5.25.
        ("dualpipev", 2, "equal", 3.0),
        ("dualpipev", 2, "light_w", 5.25),
    ],
)
def test_bubble_by_hand(kind, v, timing, bubble):
    schedule = Schedule(pp=4, virtual_stages=v, microbatches=8, kind=kind)
    assert bubble_s(schedule, 3.0, TIMINGS[timing]) == pytest.approx(bubble, rel=1e-12, abs=1e-12)


def test_zero_bubble_spreads_exposed_communication_over_f_b_w():
    # t_mb = 6 s of which 3 s compute: F, B, W scale by 2: ZB-V 3 (2 + 3 - 2) / 2 = 4.5.
    schedule = Schedule(pp=4, virtual_stages=2, microbatches=8, kind="zbv")
    assert bubble_s(schedule, 6.0, TIMINGS["light_w"]) == pytest.approx(4.5, rel=1e-12)


def test_zero_bubble_needs_the_split():
    schedule = Schedule(pp=4, virtual_stages=2, microbatches=8, kind="zbv")
    with pytest.raises(ValueError, match="forward_s and weight_grad_s"):
        bubble_s(schedule, 3.0, RankTiming(microbatch_s=3.0, optimizer_s=0.0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overlap", ["none", "chunks", "microbatches"])
def test_breakdown_adds_up_to_the_step(kind, overlap):
    rng = random.Random(f"{SEED}-{kind}-{overlap}")
    v = 2 if kind in ("interleaved1f1b", "interleaved-zb", "zbv", "dualpipev") else 1
    microbatch_s = rng.uniform(1, 3)
    timing = RankTiming(microbatch_s, rng.uniform(0, 1), microbatch_s * 0.3, microbatch_s * rng.uniform(0, 0.4))
    ranks = tuple(range(8))
    per_mb = [
        Collective("all_to_all", (0, 1, 2, 3), rng.randrange(10**9), "expert", count=4),
        Collective("send", (0, 4), rng.randrange(10**8), "pipeline", count=2),
    ]
    per_step = [Collective("all_reduce", ranks, rng.randrange(10**9), "grad")]
    net = Network(gpus_per_node=2, intra_node_gbps=100.0, inter_node_gbps=10.0, latency_us=5.0)
    if overlap == "microbatches" and kind not in ("dualpipev", "interleaved1f1b"):
        overlap = "chunks"  # the engine pairs a pipeline's plan under these two only
    pairing = None
    if overlap == "microbatches":
        forward = Program(((rng.uniform(0, 0.5), rng.uniform(0, 0.5)),), microbatch_s * 0.3)
        backward = Program(((rng.uniform(0, 0.5), rng.uniform(0, 0.5)),), microbatch_s * 0.2)
        pairing = MicrobatchOverlap(
            forward, backward, *overlapped_pairs(kind, 2, 0, 8, v), pipeline=PairedPipeline(kind, 2, v, 8, 0)
        )
    projection = project_step(
        0,
        timing,
        per_mb,
        per_step,
        Schedule(2, v, 8, kind),
        net,
        8192,
        8,
        1e9,
        overlap=overlap,
        microbatch_overlap=pairing,
    )
    b = projection.breakdown_s
    assert sum(b[k] for k in STEP_KEYS) == pytest.approx(projection.step_s, rel=1e-12)
    assert b["expert_comm"] + b["expert_comm_hidden"] == pytest.approx(b["expert_comm_total"], rel=1e-12)
    assert b["bubble"] >= 0.0


def _traced_compute(stage, seconds):
    op = TracedOp("aten.mm.default", X, X, stage, location="Transformer/Block/Attention")
    return PricedOp(op, OpWork("gemm", 1.0, 1.0, "torch.bfloat16"), seconds)


def _traced_a2a(stage, nbytes):
    op = TracedOp(
        "c10d.alltoall_base_.default",
        X,
        X,
        stage,
        location="Transformer/Block/MoELayer",
        collective={"op": "all_to_all", "ranks": list(PAIR), "nbytes": nbytes, "group_name": "ep"},
    )
    return PricedOp(op, OpWork("collective", 0.0, nbytes, "torch.bfloat16"), 0.0)


X = (TensorSpec((4,), "torch.bfloat16"),)


def test_programs_read_from_a_trace():
    # Two traced microbatches: forward 1 s, a2a, 2 s, a2a, 0.5 s; backward 3 s, a2a, 1 s; the second
    # microbatch's a2a bytes differ (routes): the program holds their mean.
    trace = []
    for nbytes in (1000, 3000):
        trace += [
            _traced_compute("forward", 1.0),
            _traced_a2a("forward", nbytes),
            _traced_compute("forward", 2.0),
            _traced_a2a("forward", nbytes),
            _traced_compute("forward", 0.5),
        ]
        trace += [_traced_compute("backward", 3.0), _traced_a2a("backward", nbytes), _traced_compute("backward", 1.0)]
    programs = step_prices(trace, 2, {"ep": "expert"}).programs
    forward, backward = programs["forward"], programs["backward"]
    assert [s.compute_s for s in forward.segments] == [1.0, 2.0] and forward.tail_s == pytest.approx(0.5)
    assert [[a.nbytes for a in s.exchanges] for s in forward.segments] == [[2000], [2000]]
    assert [s.compute_s for s in backward.segments] == [3.0] and backward.tail_s == pytest.approx(1.0)
    # On NET a 2000-byte all-to-all costs 1e-6 s; rows hand over.
    priced = forward.priced(0, NET)
    assert priced.segments == ((1.0, pytest.approx(1e-6), True), (2.0, pytest.approx(1e-6), True))
    # A direction whose all-to-alls do not split over the traced microbatches has no program.
    assert "backward" not in step_prices(trace[:-3], 2, {"ep": "expert"}).programs


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (8, 64)])
def test_dualpipev_activations_in_flight_match_torchs_plan(pp, m):
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    from bench.predict.plan.rank import in_flight_microbatches

    for rank in range(pp):
        actions = ScheduleDualPipeV._calculate_single_rank_operations(
            SimpleNamespace(pp_group_size=pp, _n_microbatches=m), rank
        )
        held = peak = 0
        for action in actions:
            if action is None:
                continue
            for step in action.sub_actions if action.computation_type == Kind.OVERLAP_F_B else (action,):
                # A stage chunk's activations live from its forward to its full backward or its W.
                held += {Kind.FORWARD: 1, Kind.FULL_BACKWARD: -1, Kind.BACKWARD_WEIGHT: -1}.get(
                    step.computation_type, 0
                )
                peak = max(peak, held)
        assert in_flight_microbatches("dualpipev", pp, 2, m, rank) == peak / 2


def test_zero_bubble_layouts_reduce_their_gradients_after_the_backward():
    # A 4-layer pipeline of 2 ranks under ZB-V (two stages a rank) against 1F1B, projected on H100: the W
    # actions write gradients past autograd's hooks, so no bucket hides under the backward.
    from bench.predict.device import load_profile
    from bench.run.project import project_on_device
    from bench.scenario import load_scenario
    from bench.validate.variants import patched

    base = load_scenario("scenarios/smoke/e8-pp2-ep2-bf16.yaml")
    base = patched(base, {"model": {"n_layers": 4}, "parallel": {"microbatches": 4}})
    zbv = patched(base, {"parallel": {"schedule": "zbv", "virtual_stages": 2}})
    profile = load_profile("h100-sxm")
    plain, zero_bubble = (project_on_device(s, profile)["breakdown_s"] for s in (base, zbv))
    assert plain["grad_sync_hidden"] > 0
    assert zero_bubble["grad_sync_hidden"] == 0.0
    assert zero_bubble["grad_sync_exposed"] == pytest.approx(zero_bubble["grad_sync_total"])


def test_a_paired_pipelines_bubble_is_its_replay():
    # interleaved1f1b, pp 2, 2 stages per rank, 4 microbatches, no all-to-all: a microbatch's forward 1 s,
    # backward 2 s, so a stage chunk's forward 0.5 s, backward 1 s, a pair their sum. The bubble is rank
    # 0's idle time in the replay, half of what it is with the chunk's seconds doubled.
    forward, backward = Program((), 1.0), Program((), 2.0)
    pipeline = PairedPipeline("interleaved1f1b", 2, 2, 4, 0)
    pairing = MicrobatchOverlap(forward, backward, *overlapped_pairs("interleaved1f1b", 2, 0, 4, 2), pipeline=pipeline)
    timing = RankTiming(microbatch_s=3.0, optimizer_s=0.0)
    schedule = Schedule(pp=2, virtual_stages=2, microbatches=4, kind="interleaved1f1b")
    step = project_step(
        0, timing, [], [], schedule, NET, 4096, 2, 1e6, overlap="microbatches", microbatch_overlap=pairing
    )
    doubled = ChunkSeconds(forward=1.0, backward=2.0, input_backward=2.0, weight_backward=0.0, forward_backward=3.0)
    assert step.breakdown_s["bubble"] == pytest.approx(replay_idle_s("interleaved1f1b", 2, 2, 4, 0, doubled) / 2)
    assert step.breakdown_s["bubble"] > 0
    assert step.step_s == pytest.approx(4 * 3.0 + step.breakdown_s["bubble"], rel=1e-12)


def test_a_paired_interleaved_pipeline_adds_its_split_weight_gradients_to_compute():
    # interleaved 1F1B's paired plan splits its cool-down: each weight backward's gradients are added into
    # the buffer in a pass of their own (bench.predict.split_weights), on top of m microbatches' compute.
    from bench.predict.device import load_profile
    from bench.predict.split_weights import split_weight_add_s
    from bench.run.project import project_on_device
    from bench.scenario import load_scenario
    from bench.validate.variants import patched

    base = load_scenario("scenarios/smoke/e8-pp2-ep2-bf16.yaml")
    paired = patched(
        base,
        {
            "model": {"n_layers": 4},
            "parallel": {
                "microbatches": 4,
                "schedule": "interleaved1f1b",
                "virtual_stages": 2,
                "overlap": "microbatches",
            },
        },
    )
    profile = load_profile("h100-sxm")
    doc = project_on_device(paired, profile)
    slowest = next(s for s in doc["stages"] if s["pipeline_rank"] == doc["slowest_stage"])
    added = split_weight_add_s(paired.model, paired.parallel_config, paired.precision, profile, doc["slowest_stage"])
    assert added > 0
    assert doc["breakdown_s"]["compute"] == pytest.approx(4 * slowest["microbatch_s"] + added)
