"""The projection's rules for expert all-to-alls overlapped across microbatches and for the zero-bubble
schedules' bubble, against hand-computed numbers; the breakdown adds up to the step under each."""

from __future__ import annotations

import random

import pytest

from bench.predict.collectives import Collective, Network
from bench.predict.overlap import microbatch_exposed_s
from bench.predict.projection import KINDS, STEP_KEYS, RankTiming, Schedule, bubble_s, project_step

SEED = 7

# Two ranks on one node at 1 GB/s, no latency: an all-to-all of B bytes costs B / 2e9 s.
NET = Network(gpus_per_node=2, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
PAIR = (0, 1)


@pytest.mark.parametrize(
    "alltoall_s, compute_s, microbatches, exposed",
    [
        # Compute longer than the all-to-alls: each of the 3 pairs hides all; the first forward's and
        # the last backward's (one microbatch's worth, 2 s) show.
        (2.0, 3.0, 4, 2.0),
        # Compute shorter: each pair shows 5 - 3 = 2 s, 3 pairs, plus the unpaired 5 s: 11.
        (5.0, 3.0, 4, 11.0),
        # One microbatch has no partner: all of it shows.
        (5.0, 30.0, 1, 5.0),
        # Equal: nothing of a pair shows.
        (3.0, 3.0, 10, 3.0),
    ],
)
def test_microbatch_overlap_by_hand(alltoall_s, compute_s, microbatches, exposed):
    assert microbatch_exposed_s(alltoall_s, compute_s, microbatches) == pytest.approx(exposed, rel=1e-12)


def test_microbatch_overlap_never_hides_more_than_the_compute():
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for _ in range(2000):
        a, x, m = rng.uniform(0, 10), rng.uniform(0, 10), rng.randint(1, 64)
        exposed = microbatch_exposed_s(a, x, m)
        hidden = m * a - exposed
        assert -1e-9 <= hidden <= (m - 1) * x + 1e-9, (a, x, m)
        assert exposed >= a - 1e-12


def _step(overlap: str, rows_bytes: int, microbatch_s: float = 3.0, m: int = 4):
    rows = Collective("all_to_all", PAIR, rows_bytes, "expert", count=1)
    timing = RankTiming(microbatch_s=microbatch_s, optimizer_s=0.5)
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=m, kind="1f1b")
    return project_step(0, timing, [rows], [], schedule, NET, 4096, 2, 1e6, overlap=overlap)


def test_a_step_overlapped_across_microbatches_by_hand():
    # 4e9 bytes a microbatch: 2 s of all-to-alls under 3 s of compute: 2 s exposed in the step, 6 s hidden.
    shorter = _step("microbatches", 4 * 10**9)
    b = shorter.breakdown_s
    assert (b["expert_comm"], b["expert_comm_hidden"], b["expert_comm_total"]) == pytest.approx((2.0, 6.0, 8.0))
    assert shorter.step_s == pytest.approx(4 * 3.0 + 2.0 + 0.5, rel=1e-12)
    # 10e9 bytes: 5 s under 3 s: 3 pairs show 2 s each, plus 5 s: 11 of 20.
    longer = _step("microbatches", 10 * 10**9)
    b = longer.breakdown_s
    assert (b["expert_comm"], b["expert_comm_hidden"], b["expert_comm_total"]) == pytest.approx((11.0, 9.0, 20.0))
    assert longer.step_s == pytest.approx(4 * 3.0 + 11.0 + 0.5, rel=1e-12)
    # Without overlap all of it shows.
    plain = _step("none", 10 * 10**9)
    assert plain.breakdown_s["expert_comm"] == pytest.approx(20.0)
    assert plain.breakdown_s["expert_comm_hidden"] == 0.0
    assert any("another microbatch's compute" in a for a in shorter.assumptions)


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
    projection = project_step(0, timing, per_mb, per_step, Schedule(2, v, 8, kind), net, 8192, 8, 1e9, overlap=overlap)
    b = projection.breakdown_s
    assert sum(b[k] for k in STEP_KEYS) == pytest.approx(projection.step_s, rel=1e-12)
    assert b["expert_comm"] + b["expert_comm_hidden"] == pytest.approx(b["expert_comm_total"], rel=1e-12)
    assert b["bubble"] >= 0.0
