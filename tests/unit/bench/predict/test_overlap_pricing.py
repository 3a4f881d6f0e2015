"""The projection's price of chunked expert all-to-alls (``parallel.a2a_chunks``): the rule of one MoE
layer pass, the step it gives, and what it reads from a trace, against hand-computed numbers."""

from __future__ import annotations

import copy
import random

import pytest

import bench.run.trace as trace_module
from bench.predict.collectives import Collective, Network
from bench.predict.device import load_profile
from bench.predict.op_projection import expert_overlap, project_priced_step, step_prices
from bench.predict.ops import OpWork, TensorSpec, TracedOp
from bench.predict.overlap import ExpertOverlap, chunked_exposed_s
from bench.predict.pricing import PricedOp, price_ops
from bench.predict.projection import RankTiming, Schedule, project_step
from bench.scenario import scenario_from_dict

SEED = 29


@pytest.mark.parametrize(
    "alltoall_s, compute_s, chunks, exposed",
    [
        # One chunk: nothing overlaps.
        (8.0, 6.0, 1, 8.0),
        # No compute: nothing to hide under.
        (8.0, 0.0, 4, 8.0),
        # Compute to spare: the first dispatch and the last combine, 8 / 4.
        (8.0, 100.0, 4, 2.0),
        # Link 1 s per message, experts 1.5 s per chunk: d0 0-1, d1 1-2, e0 1-2.5, c0 2.5-3.5, d2 3.5-4.5,
        # e1 2.5-4, c1 4.5-5.5, d3 5.5-6.5, e2 4.5-6, c2 6.5-7.5, e3 6.5-8, c3 8-9: 9 - 6 = 3 (the
        # combines wait for the experts, the next dispatch queues behind them).
        (8.0, 6.0, 4, 3.0),
        # 1 s per message, 2 s per chunk: d0 0-1, d1 1-2, e0 1-3, c0 3-4, e1 3-5, c1 5-6: 6 - 4 = 2.
        (4.0, 4.0, 2, 2.0),
        # 1 s per message, 0.5 s per chunk: d0 0-1, d1 1-2, e0 1-1.5, c0 2-3, e1 2-2.5, c1 3-4: 4 - 1 = 3.
        (4.0, 1.0, 2, 3.0),
    ],
)
def test_one_pass_by_hand(alltoall_s, compute_s, chunks, exposed):
    assert chunked_exposed_s(alltoall_s, compute_s, chunks) == pytest.approx(exposed, rel=1e-12)


def test_a_pass_never_hides_more_than_its_compute_or_its_middle_chunks():
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for _ in range(2000):
        a, x, c = rng.uniform(0, 10), rng.choice([0.0, rng.uniform(0, 20)]), rng.randint(1, 8)
        exposed = chunked_exposed_s(a, x, c)
        hidden = a - exposed
        assert -1e-12 <= hidden <= x + 1e-12, (a, x, c)
        # The first chunk's dispatch and the last one's combine always show.
        assert exposed >= a / c - 1e-12, (a, x, c)
        # More compute hides at least as much.
        assert chunked_exposed_s(a, x + 1.0, c) <= exposed + 1e-12


# Two ranks on one node at 1 GB/s, no latency: an all-to-all of B bytes costs B (l - 1) / n / 1e9 = B / 2e9 s.
NET = Network(gpus_per_node=2, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
PAIR = (0, 1)


def test_a_step_with_chunked_dispatch_by_hand():
    # One microbatch's forward: 2 MoE passes in 2 chunks, 8 row all-to-alls of 1e9 bytes (0.5 s each:
    # a = 2 s per pass), 1 s of experts (0.5 s per pass); and the routing counts (2 calls of 2e6 bytes,
    # 1 ms each) that nothing hides. Per pass, messages of 0.5 s, experts of 0.25 s per chunk: d0 0-0.5,
    # d1 0.5-1, e0 0.5-0.75, c0 1-1.5, e1 1-1.25, c1 1.5-2: exposed 2 - 0.5 = 1.5 s, hidden 0.5 s; the
    # microbatch hides 1 s of its 4.002.
    rows = Collective("all_to_all", PAIR, 10**9, "expert", count=8)
    counts = Collective("all_to_all", PAIR, 2 * 10**6, "expert", count=2)
    overlap = ExpertOverlap(chunks=2, passes=2.0, exchanges=(rows,), compute_s=1.0)
    timing = RankTiming(microbatch_s=5.0, optimizer_s=0.5)
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=4, kind="1f1b")
    plain = project_step(0, timing, [rows, counts], [], schedule, NET, 4096, 2, 1e6)
    chunked = project_step(0, timing, [rows, counts], [], schedule, NET, 4096, 2, 1e6, expert_overlap=[overlap])
    assert plain.step_s == pytest.approx(4 * (5.0 + 4.002) + 0.5, rel=1e-12)
    assert chunked.step_s == pytest.approx(4 * (5.0 + 3.002) + 0.5, rel=1e-12)
    b = chunked.breakdown_s
    assert (b["expert_comm"], b["expert_comm_hidden"], b["expert_comm_total"]) == pytest.approx((12.008, 4.0, 16.008))
    assert plain.breakdown_s["expert_comm_hidden"] == 0.0
    assert any("2 chunks per MoE layer pass" in a for a in chunked.assumptions)


X = (TensorSpec((4,), "torch.bfloat16"),)
COUNTS = (TensorSpec((2, 4), "torch.int64"),)


def _compute(stage, seconds, location):
    return PricedOp(
        TracedOp("aten.mm.default", X, X, stage, location=location), OpWork("gemm", 1.0, 1.0, "torch.bfloat16"), seconds
    )


def _a2a(stage, nbytes, tensors=X):
    op = TracedOp(
        "c10d.alltoall_base_.default",
        tensors,
        tensors,
        stage,
        location="Transformer/Block/MoELayer",
        collective={"op": "all_to_all", "ranks": list(PAIR), "nbytes": nbytes, "group_name": "ep"},
    )
    return PricedOp(op, OpWork("collective", 0.0, nbytes, "torch.bfloat16"), 0.0)


EXPERTS = "Transformer/Block/MoELayer/GroupedExperts"


def _layer_pass(stage, chunks, forward=True):
    ops = [_a2a(stage, 64, COUNTS)] if forward else []
    for _ in range(chunks):
        ops += [_a2a(stage, 1000), _compute(stage, 0.25, EXPERTS), _a2a(stage, 1000)]
    return ops


def test_what_a_trace_says_of_its_chunks():
    # Two microbatches traced; each: two MoE layers' forwards and backwards in 3 chunks, with 0.75 s of
    # experts per pass, and attention (not the experts') around them.
    trace = []
    for _ in range(2):
        for _ in range(2):
            trace += [_compute("forward", 1.0, "Transformer/Block/Attention"), *_layer_pass("forward", 3)]
        for _ in range(2):
            trace += [
                *_layer_pass("backward", 3, forward=False),
                _compute("backward", 2.0, "Transformer/Block/Attention"),
            ]
    forward, backward = expert_overlap(trace, 2, {"ep": "expert"})
    for o, passes in ((forward, 2.0), (backward, 2.0)):
        assert (o.chunks, o.passes, o.compute_s) == (3, passes, pytest.approx(1.5))
        (rows,) = o.exchanges
        # Six row all-to-alls per pass, two passes per microbatch; the counts left out.
        assert (rows.count, rows.nbytes, rows.ranks) == (12, 1000, PAIR)
    prices = step_prices(trace, 2, {"ep": "expert"})
    assert prices.expert_overlap == [forward, backward]
    # Unchunked, the experts run between one dispatch and one combine: C = 1, nothing hidden.
    (one, _) = expert_overlap(
        [*_layer_pass("forward", 1), *_layer_pass("backward", 1, forward=False)], 1, {"ep": "expert"}
    )
    assert one.chunks == 1
    # No count exchange in the forward (no expert parallelism traced there): nothing to read.
    assert expert_overlap(_layer_pass("backward", 2, forward=False), 1, {"ep": "expert"}) == []


SCENARIO = {
    "schema_version": 1,
    "name": "chunked",
    "mode": "proxy",
    "model": {
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96},
    },
    "routing": {"mode": "balanced", "seed": 0},
    "precision": "bf16",
    "parallel": {"dp": 2, "ep": 2, "microbatches": 2, "dispatch": "no-sync", "capacity_factor": 1.25},
    "run": {"tokens_per_step": 2 * 2 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 0, "threads": 1},
    "cluster": {"gpus": 2, "gpus_per_node": 2, "gpu_memory_gib": 1, "peak_tflops": 1},
}


@pytest.fixture
def chunked_proxy(monkeypatch):
    """The trace's proxy rank with each MoE layer's exchanges in the scenario's a2a_chunks."""
    build = trace_module.build_proxy_rank

    def build_chunked(config, parallel, *args, **kwargs):
        rank_model = build(config, parallel, *args, **kwargs)
        for layer in rank_model.moe_layers():
            layer.dispatcher.chunks = parallel.a2a_chunks
        return rank_model

    monkeypatch.setattr(trace_module, "build_proxy_rank", build_chunked)


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_traced_chunked_step_reads_its_chunks(chunked_proxy, chunks):
    spec = copy.deepcopy(SCENARIO)
    spec["parallel"]["a2a_chunks"] = chunks
    trace = trace_module.trace_step(scenario_from_dict(spec), rank=0)
    b300 = load_profile("b300")
    priced = price_ops(trace.ops, b300)
    forward, backward = expert_overlap(priced, 2, trace.group_phases)
    # Two MoE layers per microbatch, each forward and backward once.
    assert (forward.chunks, forward.passes, backward.chunks, backward.passes) == (chunks, 2.0, chunks, 2.0)
    experts = sum(p.seconds for p in priced if "/GroupedExperts" in p.op.location and p.op.stage == "forward")
    assert forward.compute_s == pytest.approx(experts / 2, rel=1e-12) and forward.compute_s > 0
    # Each pass moves the same rows whatever the chunks: ep * capacity rows of d_model bf16, out and back.
    capacity = 40  # ceil(1.25 * 32 tokens * top-2 / ep 2)
    assert sum(c.count * c.nbytes for c in forward.exchanges) == pytest.approx(2 * 2 * 2 * capacity * 64 * 2, rel=0.01)
    net = Network(gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
    prices = step_prices(priced, 2, trace.group_phases)
    projection = project_priced_step(prices, 0, Schedule(1, 1, 2, "1f1b"), net, 128, 2, 1e6)
    hidden = projection.breakdown_s["expert_comm_hidden"]
    assert (hidden > 0) == (chunks > 1)
