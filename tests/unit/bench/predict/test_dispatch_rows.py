"""Rows per token of each ``DispatchRows`` and the price of one dispatch on two link levels, against
hand-computed numbers and a count over drawn routes."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from bench.predict.collectives import Network
from bench.predict.dispatch_rows import (
    DispatchShape,
    RowsPerToken,
    dispatch_exchanges,
    dispatch_seconds,
    expected_distinct,
    expected_rows_per_token,
    measured_rows_per_token,
    resolve_rows,
)
from bench.predict.op_projection import CHAINED, engine_dispatch, traced_programs
from bench.predict.ops import OpWork, TensorSpec, TracedOp
from bench.predict.pricing import PricedOp

SEED = 41


def test_hypergeometric_by_hand():
    # 8 experts on 4 ranks (2 each), top-2: a rank is missed with C(6,2)/C(8,2) = 15/28, so
    # E[distinct ranks] = 4 (1 - 15/28) = 52/28 = 13/7.
    assert expected_distinct(8, 2, 2) == pytest.approx(13 / 7, rel=1e-15)
    # One expert per group: every pick is its own group.
    assert expected_distinct(16, 1, 4) == pytest.approx(4.0, rel=1e-15)
    # One group: always hit once.
    assert expected_distinct(16, 16, 4) == pytest.approx(1.0, rel=1e-15)
    # Top-k larger than the experts outside a group: every group is hit.
    assert expected_distinct(8, 4, 5) == pytest.approx(2.0, rel=1e-15)


def test_expected_rows_match_drawn_routes():
    # 64 experts, top-8, ep 16 on 2 nodes of 8: the expectation against 20,000 drawn tokens.
    shape = DispatchShape(experts=64, top_k=8, ep=16, ranks_per_node=8)
    rng = random.Random(SEED)
    routes = [rng.sample(range(64), 8) for _ in range(20_000)]
    measured = measured_rows_per_token(routes, shape)
    expected = expected_rows_per_token(shape)
    print(f"seed {SEED}: measured {measured}, expected {expected}")
    assert measured.experts == expected.experts == 8
    # Standard error of a mean of distinct counts (sd < 1.5) over 20,000 tokens is about 0.01.
    assert measured.ranks == pytest.approx(expected.ranks, abs=0.05)
    assert measured.nodes == pytest.approx(expected.nodes, abs=0.02)
    assert expected.ranks == pytest.approx(16 * (1 - math.comb(60, 8) / math.comb(64, 8)), rel=1e-15)
    assert expected.nodes == pytest.approx(2 * (1 - math.comb(32, 8) / math.comb(64, 8)), rel=1e-15)


def test_measured_counts_by_hand():
    # 8 experts on 4 ranks (2 each), 2 ranks a node. Token a: experts 0, 1 (rank 0 twice: 1 rank, 1 node);
    # token b: experts 0, 7 (ranks 0 and 3, nodes 0 and 1).
    shape = DispatchShape(experts=8, top_k=2, ep=4, ranks_per_node=2)
    assert measured_rows_per_token([[0, 1], [0, 7]], shape) == RowsPerToken(ranks=1.5, nodes=1.5, experts=2.0)


def test_auto_resolves_as_the_engine_does():
    assert resolve_rows("auto", DispatchShape(64, 8, 16, 8)) == "per-node"
    assert resolve_rows("auto", DispatchShape(64, 8, 8, 8)) == "per-rank"
    assert resolve_rows("per-expert", DispatchShape(64, 8, 16, 8)) == "per-expert"
    with pytest.raises(ValueError, match="unknown kind"):
        resolve_rows("per-token", DispatchShape(64, 8, 16, 8))


def test_two_level_dispatch_price_by_hand():
    # ep 4 on 2 nodes of 2; intra 10 GB/s, inter 1 GB/s, alpha 1 us. 1,000 tokens of 1,000-byte rows,
    # D_r = 3, D_n = 1.5 (given, not drawn). Rank 1 (node 0, local index 1).
    net = Network(gpus_per_node=2, intra_node_gbps=10.0, inter_node_gbps=1.0, latency_us=1.0)
    shape = DispatchShape(experts=8, top_k=4, ep=4, ranks_per_node=2)
    rows = RowsPerToken(ranks=3.0, nodes=1.5, experts=4.0)
    across, inside = dispatch_exchanges("per-node", shape, rows, 1000, 1000, rank=1)
    assert across.ranks == (1, 3) and inside.ranks == (0, 1)
    assert (across.nbytes, inside.nbytes) == (1_500_000, 3_000_000)
    # Inter level: 1.5e6 B, half leaves the node: 1 alpha + 0.75e6 / 1e9 = 1e-6 + 7.5e-4.
    # Intra level: 3e6 B, half to the other rank: 1 alpha + 1.5e6 / 1e10 = 1e-6 + 1.5e-4.
    assert dispatch_seconds([across, inside], 1, net) == pytest.approx(2e-6 + 7.5e-4 + 1.5e-4, rel=1e-12)
    # Per-rank rows over the whole group: 3e6 B; 1/4 stays, 1/4 on the node (3e5 B / 1e10), 1/2 leaves
    # it (1.5e6 / 1e9): 3 alpha + max(7.5e-5, 1.5e-3).
    (flat,) = dispatch_exchanges("per-rank", shape, rows, 1000, 1000, rank=1)
    assert flat.ranks == (0, 1, 2, 3) and flat.nbytes == 3_000_000
    assert dispatch_seconds([flat], 1, net) == pytest.approx(3e-6 + 1.5e-3, rel=1e-12)
    # Per-expert: 4 rows a token, 4e6 B: 3 alpha + 2e6 / 1e9.
    (plain,) = dispatch_exchanges("per-expert", shape, rows, 1000, 1000, rank=1)
    assert dispatch_seconds([plain], 1, net) == pytest.approx(3e-6 + 2e-3, rel=1e-12)


def test_one_node_group_sends_once_over_the_group():
    shape = DispatchShape(experts=8, top_k=2, ep=4, ranks_per_node=8)
    rows = expected_rows_per_token(shape)
    assert rows.nodes == pytest.approx(1.0)
    (only,) = dispatch_exchanges("per-node", shape, rows, 10, 100, rank=2)
    assert only.ranks == (0, 1, 2, 3)
    assert only.nbytes == round(10 * rows.ranks * 100)


def _exchange(nbytes, spec, group=(0, 1, 2, 3)):
    op = TracedOp(
        "c10d.alltoall_base_.default",
        (spec,),
        (spec,),
        "forward",
        location="Transformer/Block/MoELayer",
        collective={"op": "all_to_all", "ranks": list(group), "nbytes": nbytes, "group_name": "ep"},
    )
    return PricedOp(op, OpWork("collective", 0.0, nbytes, spec.dtype), 0.0)


def test_the_engines_rows_from_a_per_expert_trace_by_hand():
    # 8 experts on ep 4 (2 a rank), top-2, 2 ranks a node. A per-expert send buffer of 100 rows of
    # 16 bf16 values (32 bytes): 3,200 bytes, and a routing-counts exchange of 4 int64.
    shape = DispatchShape(experts=8, top_k=2, ep=4, ranks_per_node=2)
    rows_spec, counts_spec = TensorSpec((100, 16), "torch.bfloat16"), TensorSpec((4,), "torch.int64")
    trace = [_exchange(32, counts_spec), _exchange(3200, rows_spec)]
    d_r, d_n = 4 * (1 - 15 / 28), 2 * (1 - 6 / 28)  # C(6,2)/C(8,2) = 15/28, C(4,2)/C(8,2) = 6/28
    # Per-rank, no-sync: the counts go; 100 * D_r / 2 rows of 32 + 8 * min(2, 2) bytes.
    out, phases = engine_dispatch(trace, {"ep": "expert"}, "per-rank", shape, sync=False, rank=1)
    (rows,) = out
    assert rows.op.collective["ranks"] == [0, 1, 2, 3]
    assert rows.op.collective["nbytes"] == round(100 * d_r / 2 * (32 + 16))
    # Per-node, sync: counts on each level; rows across nodes (ranks 1, 3) then inside node 0 (0, 1).
    out, phases = engine_dispatch(trace, {"ep": "expert"}, "auto", shape, sync=True, rank=1)
    counts_inter, counts_intra, inter, intra = out
    assert (inter.op.collective["ranks"], intra.op.collective["ranks"]) == ([1, 3], [0, 1])
    assert counts_inter.op.collective["nbytes"] == counts_intra.op.collective["nbytes"] == 32
    # Inter: a node holds 4 experts, side 8 * min(2, 4); intra: a rank 2, side 8 * 2.
    assert inter.op.collective["nbytes"] == round(100 * d_n / 2 * (32 + 16))
    assert intra.op.collective["nbytes"] == round(100 * d_r / 2 * (32 + 16))
    assert phases["ep:inter"] == phases["ep:intra"] == "expert"
    # Per-expert: the trace as it is.
    assert engine_dispatch(trace, {"ep": "expert"}, "per-expert", shape, sync=False, rank=1)[0] == trace


def test_a_projection_takes_ranks_per_node_from_the_profile_and_traces_a_twin():
    from bench.predict.device import load_profile
    from bench.run.project import on_cluster, traced_scenario
    from bench.scenario import load_scenario

    big = load_scenario("scenarios/olmo-core3/moe-1.2t-512gpu.yaml")
    assert big.parallel_config.ranks_per_node is None
    placed = on_cluster(big, load_profile("b300"))  # 8 GPUs a node, ep 64: 8 nodes
    assert placed.parallel_config.ranks_per_node == 8
    assert placed.parallel_config.resolved_dispatch_rows.value == "per-node"
    # One node's group keeps the default (every rank on one node).
    one_node = load_scenario("scenarios/olmo-core3/moe-128e-47b.yaml")
    assert on_cluster(one_node, load_profile("b300")).parallel_config.ranks_per_node is None
    # DualPipeV's rank is traced as its one-stage 1F1B twin, one microbatch after the other.
    twin = traced_scenario(placed, 2).parallel_config
    assert (twin.schedule.value, twin.virtual_stages, twin.microbatches, twin.overlap.value) == ("1f1b", 1, 2, "none")
    assert twin.ranks_per_node == 8


def _compute(stage, seconds):
    op = TracedOp("aten.mm.default", (), (), stage, location="Transformer/Block/MoELayer")
    return PricedOp(op, OpWork("gemm", 1.0, 1.0, "torch.bfloat16"), seconds)


def _staged(priced, stage):
    return dataclasses.replace(priced, op=dataclasses.replace(priced.op, stage=stage))


# 8 experts on ep 4, top-2, 2 ranks a node: rank 1 sends across nodes to (1, 3), inside its node to (0, 1).
PER_NODE = DispatchShape(experts=8, top_k=2, ep=4, ranks_per_node=2)
ACROSS, INSIDE = [1, 3], [0, 1]


def _level_order(out):
    """The level pairs of ``out``'s row exchanges: out (across, then inside) or back (inside, across)."""
    rows = [p.op.collective for p in out if p.op.inputs and p.op.inputs[0].dtype == "torch.bfloat16"]
    pairs = list(zip(rows[::2], rows[1::2], strict=True))
    for first, second in pairs:
        assert CHAINED not in first and second[CHAINED] is True
    order = {(tuple(ACROSS), tuple(INSIDE)): "out", (tuple(INSIDE), tuple(ACROSS)): "back"}
    return [order[tuple(first["ranks"]), tuple(second["ranks"])] for first, second in pairs]


def test_per_node_levels_run_in_the_engines_order():
    # Three chunks: a forward pass is counts, then d0, d1, c0, d2, c1, c2 (chunk k + 1's dispatch
    # before chunk k's combine); its backward the same six in reverse, each the other way: the
    # combines' gradients go out. A recomputed forward in the backward has its counts again.
    rows_spec, counts_spec = TensorSpec((100, 16), "torch.bfloat16"), TensorSpec((4,), "torch.int64")
    forward = [_exchange(32, counts_spec)] + [_exchange(3200, rows_spec) for _ in range(6)]
    backward = [_staged(p, "backward") for p in [*forward, *forward[1:]]]
    out, _ = engine_dispatch([*forward, *backward], {"ep": "expert"}, "per-node", PER_NODE, sync=False, rank=1)
    pass_order = ["out", "out", "back", "out", "back", "back"]
    assert _level_order(out) == pass_order * 3
    # Under sync each pass keeps its counts, one per level, not chained.
    out, _ = engine_dispatch([*forward, *backward], {"ep": "expert"}, "per-node", PER_NODE, sync=True, rank=1)
    counts = [p.op.collective for p in out if p.op.inputs[0].dtype == "torch.int64"]
    assert [c["ranks"] for c in counts] == [ACROSS, INSIDE] * 2 and not any(CHAINED in c for c in counts)


def test_per_node_programs_hand_over_once_per_chain_by_hand():
    # One microbatch (C = 1): forward 1 s, counts, 0.5 s, dispatch, 2 s (experts), combine, 0.25 s;
    # backward 1 s, the combine's gradients (out), 3 s, the dispatch's (back), 0.5 s.
    rows_spec, counts_spec = TensorSpec((100, 16), "torch.bfloat16"), TensorSpec((4,), "torch.int64")
    dispatch, combine, counts = _exchange(3200, rows_spec), _exchange(3200, rows_spec), _exchange(32, counts_spec)
    trace = [_compute("forward", 1.0), counts, _compute("forward", 0.5), dispatch, _compute("forward", 2.0)]
    trace += [combine, _compute("forward", 0.25), _compute("backward", 1.0), _staged(combine, "backward")]
    trace += [_compute("backward", 3.0), _staged(dispatch, "backward"), _compute("backward", 0.5)]
    d_r, d_n = 4 * (1 - 15 / 28), 2 * (1 - 6 / 28)
    inter, intra = round(100 * d_n / 2 * 48), round(100 * d_r / 2 * 48)

    out, phases = engine_dispatch(trace, {"ep": "expert"}, "per-node", PER_NODE, sync=True, rank=1)
    programs = traced_programs(out, 1, phases)
    f, b = programs["forward"], programs["backward"]
    # Forward: both levels' counts, each waited for at once; then one chain per way.
    assert [(s.compute_s, s.hands_over) for s in f.segments] == [(1.0, False), (0.0, False), (0.5, True), (2.0, True)]
    assert [[(c.ranks, c.nbytes) for c in s.exchanges] for s in f.segments] == [
        [((1, 3), 32)],
        [((0, 1), 32)],
        [((1, 3), inter), ((0, 1), intra)],
        [((0, 1), intra), ((1, 3), inter)],
    ]
    assert f.tail_s == 0.25
    assert [(s.compute_s, s.hands_over, len(s.exchanges)) for s in b.segments] == [(1.0, True, 2), (3.0, True, 2)]
    assert [c.ranks for c in b.segments[0].exchanges] == [(1, 3), (0, 1)]
    assert [c.ranks for c in b.segments[1].exchanges] == [(0, 1), (1, 3)]
    assert b.tail_s == 0.5
    # Priced: a chain's seconds are its exchanges' summed. Rank 1's all-to-all over (1, 3) crosses
    # nodes (1 GB/s: half its bytes leave), over (0, 1) stays inside (10 GB/s).
    net = Network(gpus_per_node=2, intra_node_gbps=10.0, inter_node_gbps=1.0, latency_us=0.0)
    chain_s = inter / 2 / 1e9 + intra / 2 / 10e9
    priced = f.priced(1, net)
    assert priced.segments == (
        (1.0, pytest.approx(16 / 1e9), False),
        (0.0, pytest.approx(16 / 10e9), False),
        (0.5, pytest.approx(chain_s), True),
        (2.0, pytest.approx(chain_s), True),
    )
    assert priced.waited_s == pytest.approx(16 / 1e9 + 16 / 10e9)

    # No-sync: no counts; their compute joins the dispatch's segment.
    out, phases = engine_dispatch(trace, {"ep": "expert"}, "per-node", PER_NODE, sync=False, rank=1)
    f = traced_programs(out, 1, phases)["forward"]
    assert [(s.compute_s, s.hands_over, len(s.exchanges)) for s in f.segments] == [(1.5, True, 2), (2.0, True, 2)]
