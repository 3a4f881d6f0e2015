"""``bench.predict.projection``: the alpha-beta prices of each collective and the projected step, against hand arithmetic.

Expected values are written out as literal arithmetic (latency 10 us = 10e-6 s, 900 GB/s = 900e9 bytes/s,
50 GB/s = 50e9 bytes/s unless a test says otherwise); reusing the module's helpers here would only check
that the module agrees with itself.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from bench.predict.collectives import Collective, Network, collective_seconds, summarize_collectives
from bench.predict.overlap import SyncBucket, simulate_sync
from bench.predict.projection import Projection, RankTiming, Schedule, project_step

NET = Network(gpus_per_node=8, intra_node_gbps=900, inter_node_gbps=50, latency_us=10.0)
NODE0 = tuple(range(8))
TWO_NODES = tuple(range(16))
SUM_KEYS = (
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
BESIDE = (
    "grad_sync_hidden",
    "grad_sync_total",
    "param_gather_hidden",
    "param_gather_total",
    "fsdp_gather_total",
    "expert_comm_hidden",
    "expert_comm_total",
)


def approx(x: float):
    return pytest.approx(x, rel=1e-12)


def seconds(op: str, ranks, nbytes: int, rank: int = 0, net: Network = NET, count: int = 1) -> float:
    return collective_seconds(Collective(op, tuple(ranks), nbytes, "other", count), rank, net)


# ---- Network ----------------------------------------------------------------------------------


def test_from_cluster_defaults():
    assert Network.from_cluster({}) == Network(
        gpus_per_node=8, intra_node_gbps=900, inter_node_gbps=50, latency_us=10.0
    )


def test_from_cluster_takes_given_keys_and_ignores_the_rest():
    cluster = {
        "name": "x",
        "gpus": 64,
        "gpu_memory_gib": 80,
        "peak_tflops": 989,
        "gpus_per_node": 4,
        "inter_node_gbps": 400,
    }
    assert Network.from_cluster(cluster) == Network(
        gpus_per_node=4, intra_node_gbps=900, inter_node_gbps=400, latency_us=10.0
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"gpus_per_node": 8.0}, "gpus_per_node"),
        ({"intra_node_gbps": 0}, "intra_node_gbps"),
        ({"inter_node_gbps": -1}, "inter_node_gbps"),
        ({"latency_us": -0.5}, "latency_us"),
    ],
)
def test_network_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"network.{field}"):
        Network.from_cluster(kwargs)


# ---- collectives ------------------------------------------------------------------------------


def test_all_to_all_inside_a_node():
    # l = 8: 7/8 of the buffer stays on the node, nothing leaves it.
    assert seconds("all_to_all", NODE0, 8_000_000, rank=3) == approx(7 * 10e-6 + 8_000_000 * 7 / 8 / 900e9)


def test_all_to_all_over_two_full_nodes_uses_eight_local_ranks():
    # n = 16, l = 8: on node 16e6 * 7/16 / 900e9 = 7.8e-6 s; off node 16e6 * 8/16 / 50e9 = 1.6e-4 s.
    expected = 15 * 10e-6 + 16_000_000 * 8 / 16 / 50e9
    assert seconds("all_to_all", TWO_NODES, 16_000_000, rank=3) == approx(expected)
    assert seconds("all_to_all", TWO_NODES, 16_000_000, rank=12) == approx(expected)


def test_all_to_all_takes_the_slower_of_the_two_link_kinds():
    slow_nvlink = Network(gpus_per_node=8, intra_node_gbps=10, inter_node_gbps=1000, latency_us=0.0)
    # on node 16e6 * 7/16 / 10e9 = 7e-4 s beats off node 16e6 * 8/16 / 1000e9 = 8e-6 s.
    assert seconds("all_to_all", TWO_NODES, 16_000_000, net=slow_nvlink) == approx(16_000_000 * 7 / 16 / 10e9)


def test_all_to_all_uneven_group_counts_ranks_on_this_rank_node():
    group = (0, 1, 8, 9, 10, 11, 16, 17)  # 2 + 4 + 2 ranks on nodes 0, 1, 2
    b = 8_000_000
    assert seconds("all_to_all", group, b, rank=9) == approx(7 * 10e-6 + max(b * 3 / 8 / 900e9, b * 4 / 8 / 50e9))
    assert seconds("all_to_all", group, b, rank=0) == approx(7 * 10e-6 + max(b * 1 / 8 / 900e9, b * 6 / 8 / 50e9))


def test_all_reduce_inside_and_across_nodes():
    assert seconds("all_reduce", (0, 1, 2, 3), 1_000_000_000) == approx(2 * 3 * 10e-6 + 2 * 3 / 4 * 1e9 / 900e9)
    assert seconds("all_reduce", (0, 8), 1_000_000_000) == approx(2 * 1 * 10e-6 + 2 * 1 / 2 * 1e9 / 50e9)
    # One rank across the node boundary prices the whole ring at the inter-node bandwidth.
    assert seconds("all_reduce", tuple(range(9)), 9_000_000) == approx(2 * 8 * 10e-6 + 2 * 8 / 9 * 9e6 / 50e9)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_reduce_scatter_and_all_gather(op):
    assert seconds(op, NODE0, 64_000_000) == approx(7 * 10e-6 + 7 / 8 * 64e6 / 900e9)
    assert seconds(op, (0, 8, 16, 24), 64_000_000) == approx(3 * 10e-6 + 3 / 4 * 64e6 / 50e9)


def test_broadcast():
    assert seconds("broadcast", NODE0, 90_000_000) == approx(7 * 10e-6 + 90e6 / 900e9)
    assert seconds("broadcast", TWO_NODES, 90_000_000) == approx(15 * 10e-6 + 90e6 / 50e9)


@pytest.mark.parametrize("n, steps", [(2, 1), (5, 3), (8, 3), (16, 4)])
def test_barrier(n, steps):
    assert seconds("barrier", range(n), 0) == approx(2 * steps * 10e-6)


def test_send_and_recv():
    assert seconds("send", (0, 1), 4_000_000) == approx(10e-6 + 4e6 / 900e9)
    assert seconds("recv", (7, 8), 4_000_000, rank=7) == approx(10e-6 + 4e6 / 50e9)
    assert seconds("send", (8, 7), 4_000_000, rank=8) == approx(10e-6 + 4e6 / 50e9)


@pytest.mark.parametrize(
    "op, nbytes",
    [
        ("all_to_all", 1000),
        ("all_reduce", 1000),
        ("reduce_scatter", 1000),
        ("all_gather", 1000),
        ("broadcast", 1000),
        ("barrier", 0),
    ],
)
def test_single_rank_group_is_free(op, nbytes):
    assert seconds(op, (5,), nbytes, rank=5) == 0.0


def test_count_multiplies():
    assert seconds("all_reduce", (0, 8), 1_000_000_000, count=3) == approx(3 * (2 * 10e-6 + 1e9 / 50e9))
    assert seconds("send", (0, 1), 900, count=4) == approx(4 * (10e-6 + 900 / 900e9))


def test_ranks_given_as_a_list_become_a_tuple():
    assert Collective("all_reduce", [0, 1], 8, "grad").ranks == (0, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"op": "allreduce"}, "unknown op 'allreduce'"),
        ({"phase": "backward"}, "unknown phase 'backward'"),
        ({"ranks": ()}, "at least one rank"),
        ({"ranks": (0, 0)}, "twice"),
        ({"ranks": (0, -1)}, "integers >= 0"),
        ({"op": "send", "ranks": (0, 1, 2)}, "this rank, peer"),
        ({"op": "recv", "ranks": (0,)}, "this rank, peer"),
        ({"nbytes": -1}, "collective.nbytes"),
        ({"op": "barrier", "nbytes": 4}, "no payload"),
        ({"count": 0}, "collective.count"),
    ],
)
def test_collective_rejects_bad_fields(kwargs, match):
    fields = {"op": "all_reduce", "ranks": (0, 1), "nbytes": 8, "phase": "grad"} | kwargs
    with pytest.raises(ValueError, match=match):
        Collective(**fields)


def test_rank_must_be_in_the_group():
    with pytest.raises(ValueError, match="rank 2 is not in the all_reduce group"):
        collective_seconds(Collective("all_reduce", (0, 1), 8, "grad"), 2, NET)


def test_summarize_collectives():
    items = [
        Collective("all_to_all", NODE0, 1000, "expert", count=4),
        Collective("all_reduce", (0, 8), 3000, "grad"),
        Collective("all_to_all", tuple(range(8, 16)), 1000, "expert", count=2),  # same size, other group: merged
        Collective("all_to_all", NODE0, 1000, "other"),
        Collective("barrier", NODE0, 0, "other"),
    ]
    assert summarize_collectives(items) == [
        {"op": "all_to_all", "group_size": 8, "nbytes": 1000, "phase": "expert", "count": 6, "total_bytes": 6000},
        {"op": "all_reduce", "group_size": 2, "nbytes": 3000, "phase": "grad", "count": 1, "total_bytes": 3000},
        {"op": "all_to_all", "group_size": 8, "nbytes": 1000, "phase": "other", "count": 1, "total_bytes": 1000},
        {"op": "barrier", "group_size": 8, "nbytes": 0, "phase": "other", "count": 1, "total_bytes": 0},
    ]
    json.dumps(summarize_collectives(items))
    assert summarize_collectives([]) == []


# ---- schedule and timing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "zigzag"}, "unknown schedule 'zigzag'"),
        ({"microbatches": 0}, "schedule.microbatches"),
        ({"pp": 0}, "schedule.pp"),
        ({"virtual_stages": 0}, "schedule.virtual_stages"),
        ({"virtual_stages": 2, "kind": "1f1b"}, "needs kind interleaved1f1b"),
    ],
)
def test_schedule_rejects_bad_fields(kwargs, match):
    fields = {"pp": 2, "virtual_stages": 1, "microbatches": 4, "kind": "1f1b"} | kwargs
    with pytest.raises(ValueError, match=match):
        Schedule(**fields)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"microbatch_s": -1.0}, "timing.microbatch_s"),
        ({"optimizer_s": -1.0}, "timing.optimizer_s"),
        ({"weight_add_s": -1.0}, "timing.weight_add_s"),
    ],
)
def test_timing_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankTiming(**({"microbatch_s": 0.1, "optimizer_s": 0.01} | kwargs))


# ---- the projected step -----------------------------------------------------------------------


def check_breakdown(p: Projection) -> None:
    assert set(p.breakdown_s) == {*SUM_KEYS, *BESIDE}
    assert sum(p.breakdown_s[k] for k in SUM_KEYS) == approx(p.step_s)
    for sync in ("grad_sync", "param_gather"):
        assert p.breakdown_s[f"{sync}_hidden"] + p.breakdown_s[f"{sync}_exposed"] == approx(
            p.breakdown_s[f"{sync}_total"]
        )
    assert p.breakdown_s["expert_comm_hidden"] + p.breakdown_s["expert_comm"] == approx(
        p.breakdown_s["expert_comm_total"]
    )


def pp1() -> Schedule:
    return Schedule(pp=1, virtual_stages=1, microbatches=1, kind="1f1b")


TIMING = RankTiming(microbatch_s=0.3, optimizer_s=0.01)
EXPERT_A2A = Collective("all_to_all", NODE0, 9_000_000, "expert", count=2)
EXPERT_S = 2 * (7 * 10e-6 + 9e6 * 7 / 8 / 900e9)  # 2 * (7e-5 + 7e-6)
BARRIER = Collective("barrier", NODE0, 0, "other")


# ---- overlapped syncs: buckets queued on one link -------------------------------------------------

# No latency, 1 GB/s between nodes: an all-reduce of B bytes over ranks (0, 8) costs 2 * 1/2 * B / 1e9 = B / 1e9 s.
SLOW = Network(gpus_per_node=8, intra_node_gbps=900, inter_node_gbps=1, latency_us=0.0)
PAIR = (0, 8)


def pair_bucket(seconds: float, window_s: float) -> SyncBucket:
    return SyncBucket(Collective("all_reduce", PAIR, round(seconds * 1e9), "grad"), window_s)


def test_buckets_queue_on_the_link_in_launch_order():
    # By hand, the compute ending at 0:
    #   bucket 1: launches at -10, costs 2: runs [-10, -8]
    #   bucket 2: launches at  -9, costs 3: waits for bucket 1, runs [-8, -5]
    #   bucket 3: launches at  -3, costs 1: the link idles from -5, runs [-3, -2]
    #   bucket 4: launches at -2.5, costs 4: waits for bucket 3, runs [-2, 2]
    # exposed 2 of the 10 s; without the queue bucket 4 would end at 1.5, launched all at -10 they would end at 0.
    buckets = [pair_bucket(2, 10), pair_bucket(3, 9), pair_bucket(1, 3), pair_bucket(4, 2.5)]
    sync = simulate_sync(buckets, 0, SLOW)
    assert sync.total_s == approx(10)
    assert sync.exposed_s == approx(2)
    assert sync.hidden_s == approx(8)


def test_a_sync_launched_early_enough_hides_entirely_and_one_launched_at_the_end_not_at_all():
    assert simulate_sync([pair_bucket(2, 5), pair_bucket(1, 2)], 0, SLOW).exposed_s == 0.0
    late = simulate_sync([pair_bucket(2, 0), pair_bucket(1, 0)], 0, SLOW)
    assert (late.total_s, late.exposed_s, late.hidden_s) == (approx(3), approx(3), approx(0))
    assert simulate_sync([], 0, SLOW) == simulate_sync([], 0, NET)
    assert simulate_sync([], 0, SLOW).exposed_s == 0.0


def test_each_bucket_is_priced_by_its_own_ring():
    # A reduce-scatter over 4 nodes: (n-1)/n * B / beta = 3/4 * 4e9 / 1e9 = 3 s; it waits for the
    # all-reduce before it (-4 .. -2), then runs [-2, 1].
    scatter = SyncBucket(Collective("reduce_scatter", (0, 8, 16, 24), 4_000_000_000, "grad"), 3)
    sync = simulate_sync([pair_bucket(2, 4), scatter], 0, SLOW)
    assert sync.total_s == approx(5)
    assert sync.exposed_s == approx(1)


def test_sync_bucket_rejects_bad_fields():
    with pytest.raises(ValueError, match=re.escape("sync_bucket.window_s")):
        SyncBucket(Collective("all_reduce", PAIR, 8, "grad"), -1.0)
    with pytest.raises(ValueError, match=re.escape("sync_bucket.collective")):
        SyncBucket("all_reduce", 1.0)


def test_pp1_gradient_sync_hidden_under_backward():
    grad = Collective("all_reduce", NODE0, 9_000_000_000, "grad")
    p = project_step(
        0,
        TIMING,
        [EXPERT_A2A],
        [BARRIER],
        pp1(),
        NET,
        tokens_per_step=8192,
        world_size=8,
        flops_per_token=6e9,
        grad_buckets=[SyncBucket(grad, 0.2)],
    )
    g = 2 * 7 * 10e-6 + 2 * 7 / 8 * 9e9 / 900e9  # 0.01764 s < 0.2 s of backward left
    step = 0.3 + EXPERT_S + 0.01 + 6 * 10e-6
    assert p.step_s == approx(step)
    assert p.breakdown_s == {
        "compute": approx(0.3),
        "expert_comm": approx(EXPERT_S),
        "pipeline_comm": 0.0,
        "bubble": 0.0,
        "grad_sync_exposed": 0.0,
        "grad_sync_hidden": approx(g),
        "grad_sync_total": approx(g),
        "optimizer": approx(0.01),
        "param_gather_exposed": 0.0,
        "param_gather_hidden": 0.0,
        "param_gather_total": 0.0,
        "other_comm": approx(6 * 10e-6),
        "fsdp_gather_exposed": 0.0,
        "fsdp_gather_total": 0.0,
        "skew": 0.0,
        "expert_comm_hidden": 0.0,
        "expert_comm_total": approx(EXPERT_S),
    }
    assert p.tokens_per_s_per_gpu == approx(8192 / step / 8)
    assert p.tflops_per_gpu == approx(6e9 * 8192 / step / 8 / 1e12)
    check_breakdown(p)


def test_split_weight_backwards_add_to_compute_once_per_step():
    # weight_add_s is per step: 4 microbatches of 0.3 s under 1F1B, plus 0.05 s of adds, not 4 x 0.05.
    schedule = Schedule(pp=2, virtual_stages=1, microbatches=4, kind="1f1b")
    common = dict(tokens_per_step=8192, world_size=8, flops_per_token=6e9)
    plain = project_step(0, TIMING, [], [], schedule, NET, **common)
    added = project_step(0, dataclasses.replace(TIMING, weight_add_s=0.05), [], [], schedule, NET, **common)
    assert added.breakdown_s["compute"] == approx(4 * 0.3 + 0.05)
    assert added.step_s == approx(plain.step_s + 0.05)
    check_breakdown(added)


def test_pp1_gradient_sync_partly_exposed():
    grad = Collective("all_reduce", TWO_NODES, 20_000_000_000, "grad")
    g = 2 * 15 * 10e-6 + 2 * 15 / 16 * 20e9 / 50e9  # 0.7503 s
    exposed = g - 0.2
    p = project_step(
        0,
        TIMING,
        [EXPERT_A2A],
        [],
        pp1(),
        NET,
        tokens_per_step=4096,
        world_size=16,
        flops_per_token=1e9,
        grad_buckets=[SyncBucket(grad, 0.2)],
    )
    assert p.breakdown_s["grad_sync_total"] == approx(g)
    assert p.breakdown_s["grad_sync_exposed"] == approx(exposed)
    step = 0.3 + EXPERT_S + exposed + 0.01
    assert p.step_s == approx(step)
    assert p.tokens_per_s_per_gpu == approx(4096 / step / 16)
    assert p.tflops_per_gpu == approx(1e9 * 4096 / step / 16 / 1e12)
    check_breakdown(p)


def test_gradient_collectives_without_a_launch_time_are_exposed():
    grad = Collective("all_reduce", NODE0, 9_000_000_000, "grad")
    p = project_step(0, TIMING, [], [grad], pp1(), NET, tokens_per_step=8192, world_size=8, flops_per_token=6e9)
    g = 2 * 7 * 10e-6 + 2 * 7 / 8 * 9e9 / 900e9
    assert p.breakdown_s["grad_sync_exposed"] == approx(g)
    assert p.breakdown_s["grad_sync_hidden"] == 0.0
    assert p.step_s == approx(0.3 + g + 0.01)
    check_breakdown(p)


def test_buckets_and_unbucketed_entries_and_gathers_by_hand():
    # Reductions: 2 s launched 3 s before the backward ends, 2 s launched 1 s before: [-3, -1], [-1, 1];
    # then an unbucketed 0.5 s all-reduce queues behind them at the end: [1, 1.5]. Exposed 1.5 of 4.5.
    # Gathers under the optimizer's updates: 1 s launched 4 s before they end, 3 s launched 2 s before:
    # [-4, -3], [-2, 1]: exposed 1 of 4. Pipeline of pp = 2 stages (the overlap holds whatever pp and m).
    timing = RankTiming(microbatch_s=5.0, optimizer_s=4.5)
    extra = Collective("all_reduce", PAIR, 500_000_000, "grad")
    gathers = [
        SyncBucket(Collective("all_gather", PAIR, 2_000_000_000, "grad"), 4),
        SyncBucket(Collective("all_gather", PAIR, 6_000_000_000, "grad"), 2),
    ]
    schedule = Schedule(pp=2, virtual_stages=1, microbatches=4, kind="1f1b")
    p = project_step(
        0,
        timing,
        [],
        [extra],
        schedule,
        SLOW,
        tokens_per_step=1000,
        world_size=16,
        flops_per_token=1.0,
        grad_buckets=[pair_bucket(2, 3), pair_bucket(2, 1)],
        gather_buckets=gathers,
    )
    b = p.breakdown_s
    assert (b["grad_sync_total"], b["grad_sync_exposed"], b["grad_sync_hidden"]) == (
        approx(4.5),
        approx(1.5),
        approx(3),
    )
    assert (b["param_gather_total"], b["param_gather_exposed"], b["param_gather_hidden"]) == (
        approx(4),
        approx(1),
        approx(3),
    )
    # (4 + 1) * 5 s of pipeline, the exposed syncs, the optimizer.
    assert p.step_s == approx(25 + 1.5 + 4.5 + 1)
    check_breakdown(p)


def test_pp1_runs_microbatches_back_to_back_whatever_the_kind():
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=4, kind="gpipe")
    p = project_step(
        0, TIMING, [EXPERT_A2A], [], schedule, NET, tokens_per_step=8192, world_size=8, flops_per_token=6e9
    )
    assert p.breakdown_s["bubble"] == 0.0
    assert p.breakdown_s["compute"] == approx(4 * 0.3)
    assert p.breakdown_s["expert_comm"] == approx(4 * EXPERT_S)
    assert p.step_s == approx(4 * (0.3 + EXPERT_S) + 0.01)
    check_breakdown(p)


# A pipeline of pp = 4 stages over dp = 8 (world 32, 8 GPUs per node): stage s is ranks 8s..8s+7, so rank 8
# (stage 1) trades activations and gradients with ranks 0 and 16 on other nodes.
STAGE_MESSAGES = [
    Collective("recv", (8, 0), 4_000_000, "pipeline"),
    Collective("send", (8, 16), 4_000_000, "pipeline"),
    Collective("recv", (8, 16), 4_000_000, "pipeline"),
    Collective("send", (8, 0), 4_000_000, "pipeline"),
]
PIPE_S = 4 * (10e-6 + 4e6 / 50e9)  # 4 * 9e-5
STAGE_A2A = Collective("all_to_all", tuple(range(8, 16)), 18_000_000, "expert", count=4)
STAGE_EXPERT_S = 4 * (7 * 10e-6 + 18e6 * 7 / 8 / 900e9)  # 4 * 8.75e-5
DP_GRAD = Collective("all_reduce", tuple(range(8, 16)), 1_800_000_000, "grad")
DP_GRAD_S = 2 * 7 * 10e-6 + 2 * 7 / 8 * 1.8e9 / 900e9
PIPE_TIMING = RankTiming(microbatch_s=0.1, optimizer_s=0.02)
BARRIER_STAGE = Collective("barrier", tuple(range(32)), 0, "other")  # 2 * 5 * alpha


def pipelined(kind: str, v: int) -> Projection:
    schedule = Schedule(pp=4, virtual_stages=v, microbatches=8, kind=kind)
    return project_step(
        8,
        PIPE_TIMING,
        [STAGE_A2A, *STAGE_MESSAGES],
        [DP_GRAD, BARRIER_STAGE],
        schedule,
        NET,
        tokens_per_step=65536,
        world_size=32,
        flops_per_token=2e10,
    )


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_1f1b_and_gpipe_bubble(kind):
    p = pipelined(kind, 1)
    t_mb = 0.1 + STAGE_EXPERT_S + PIPE_S  # 0.10071 s
    step = (8 + 4 - 1) * t_mb + DP_GRAD_S + 0.02 + 2 * 5 * 10e-6
    assert p.breakdown_s["bubble"] == approx(3 * t_mb)
    assert p.breakdown_s["compute"] == approx(8 * 0.1)
    assert p.breakdown_s["expert_comm"] == approx(8 * STAGE_EXPERT_S)
    assert p.breakdown_s["pipeline_comm"] == approx(8 * PIPE_S)
    assert p.breakdown_s["grad_sync_exposed"] == approx(DP_GRAD_S)
    assert p.breakdown_s["other_comm"] == approx(2 * 5 * 10e-6)
    assert p.step_s == approx(step)
    assert p.tokens_per_s_per_gpu == approx(65536 / step / 32)
    assert p.tflops_per_gpu == approx(2e10 * 65536 / step / 32 / 1e12)
    check_breakdown(p)


def test_interleaved_bubble_shrinks_with_virtual_stages():
    p = pipelined("interleaved1f1b", 2)
    t_mb = 0.1 + STAGE_EXPERT_S + PIPE_S
    assert p.breakdown_s["bubble"] == approx(3 * t_mb / 2)
    assert p.step_s == approx(8 * t_mb + 3 * t_mb / 2 + DP_GRAD_S + 0.02 + 2 * 5 * 10e-6)
    check_breakdown(p)


def test_projection_to_dict_is_json_ready_and_states_its_assumptions():
    p = pipelined("interleaved1f1b", 2)
    d = json.loads(json.dumps(p.to_dict()))
    assert set(d) == {"step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "breakdown_s", "assumptions"}
    assert d["step_s"] == p.step_s
    assert d["breakdown_s"] == p.breakdown_s
    text = "\n".join(p.assumptions)
    for formula in (
        "2 * (n-1) * alpha",
        "2 * ceil(log2 n) * alpha",
        "m * t_mb + (pp - 1) * t_mb / v",
        "alpha + B / beta",
        "no contention",
    ):
        assert formula in text
    bucketed = "\n".join(
        project_step(
            0,
            TIMING,
            [],
            [],
            pp1(),
            NET,
            tokens_per_step=1,
            world_size=1,
            flops_per_token=0,
            grad_buckets=[SyncBucket(Collective("all_reduce", (0,), 8, "grad"), 0.1)],
        ).assumptions
    )
    assert "s_i = max(-w_i, e_(i-1)), e_i = s_i + c_i, exposed = max(0, e_N)" in bucketed


# ---- input errors -----------------------------------------------------------------------------


def call(**overrides):
    args = {
        "rank": 0,
        "timing": TIMING,
        "per_microbatch": [EXPERT_A2A],
        "per_step": [BARRIER],
        "schedule": pp1(),
        "net": NET,
        "tokens_per_step": 8192,
        "world_size": 8,
        "flops_per_token": 6e9,
    } | overrides
    return project_step(**args)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"per_microbatch": [Collective("all_reduce", NODE0, 8, "grad")]}, r"per_microbatch\[0\]: phase 'grad'"),
        ({"per_step": [BARRIER, Collective("all_to_all", NODE0, 8, "expert")]}, r"per_step\[1\]: phase 'expert'"),
        ({"per_step": [Collective("send", (0, 1), 8, "pipeline")]}, r"per_step\[0\]: phase 'pipeline'"),
        ({"per_step": [Collective("all_reduce", (0, 8), 8, "grad")]}, "rank >= world_size=8"),
        (
            {"rank": 1, "per_step": [Collective("send", (0, 2), 8, "other")], "per_microbatch": []},
            "rank 1 is not in the send group",
        ),
        ({"rank": 8}, r"rank: must be an integer in \[0, 8\)"),
        ({"world_size": 0}, "world_size"),
        ({"tokens_per_step": 0}, "tokens_per_step"),
        ({"flops_per_token": -1.0}, "flops_per_token"),
        ({"per_microbatch": ["all_to_all"]}, "expected a Collective"),
        ({"schedule": Schedule(pp=16, virtual_stages=1, microbatches=4, kind="1f1b")}, "exceed world_size=8"),
        ({"timing": RankTiming(0.0, 0.0), "per_microbatch": [], "per_step": []}, "projected step time is 0"),
        (
            {"grad_buckets": [SyncBucket(Collective("all_to_all", NODE0, 8, "expert"), 0.1)]},
            r"grad_buckets\[0\]: phase 'expert'",
        ),
        (
            {"gather_buckets": [SyncBucket(Collective("all_gather", (1, 2), 8, "grad"), 0.1)]},
            "rank 0 is not in the all_gather group",
        ),
        ({"grad_buckets": [Collective("all_reduce", NODE0, 8, "grad")]}, r"grad_buckets\[0\]: expected a SyncBucket"),
    ],
)
def test_project_step_rejects_bad_inputs(overrides, match):
    with pytest.raises(ValueError, match=match):
        call(**overrides)


def test_fsdp_gathers_show_only_what_outlasts_the_compute():
    # 8 ranks on one node; each microbatch gathers 9 GB (forward and backward) over them.
    gather = Collective("all_gather", NODE0, 9_000_000_000, "fsdp", count=2)
    c = 2 * (7 * 10e-6 + 7 / 8 * 9e9 / 900e9)
    for compute, exposed in ((0.001, c - 0.001), (1.0, 0.0)):
        p = project_step(0, RankTiming(compute, 0.0), [gather], [], Schedule(1, 1, 4, "1f1b"), NET, 8192, 8, 1e9)
        assert p.breakdown_s["fsdp_gather_total"] == approx(4 * c)
        assert p.breakdown_s["fsdp_gather_exposed"] == approx(4 * exposed)
        assert p.step_s == approx(4 * compute + 4 * exposed)
