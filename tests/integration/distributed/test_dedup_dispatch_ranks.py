"""Per-rank and per-node dispatch on gloo ranks against per-expert rows and hand counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dedup_dispatch_cases import D_MODEL, EXPERTS, TOKENS, TOP_K, batch, make_layer, sharded, step
from dispatch_cases import shard
from distributed_harness import run_ranks

from moe_engine.config import DispatchKind
from moe_engine.host_sync import HostSyncError, forbid_host_sync, profile_host_syncs
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.router import RouterOutput
from moe_engine.parallel.groups import build_node_groups
from moe_engine.parallel.layout import destination_share

pytestmark = pytest.mark.slow

FP32_TOL = dict(rtol=1e-5, atol=1e-6)


# (name, rows, kind, capacity_factor, a2a_chunks); each is compared with per-expert rows of the same kind.
EP2_CASES = [
    ("per-rank-sync", "per-rank", "sync", 1.0, 1),
    ("per-rank-no-sync", "per-rank", "no-sync", 4.0, 1),
    ("per-rank-sync-chunks", "per-rank", "sync", 1.0, 2),
    ("per-node-of-1-no-sync", "per-node", "no-sync", 4.0, 1),
]
EP4_CASES = [
    ("per-rank-sync", "per-rank", "sync", 1.0, 1),
    ("per-rank-no-sync-chunks", "per-rank", "no-sync", 4.0, 3),
    ("per-node-sync", "per-node", "sync", 1.0, 1),
    ("per-node-no-sync", "per-node", "no-sync", 4.0, 1),
    ("per-node-sync-chunks", "per-node", "sync", 1.0, 2),
    ("per-node-no-sync-chunks", "per-node", "no-sync", 4.0, 2),
]
# Tight capacity: the per-rank tail drop, against the rule recomputed by hand.
DROP_CASES = [
    ("per-rank-drops", "per-rank", "no-sync", 0.5, 1),
    ("per-rank-drops-chunks", "per-rank", "no-sync", 0.5, 2),
]

# Tight capacity at both levels of per-node rows (4 ranks as 2 nodes of 2), against the rule by hand.
NODE_DROP_CASES = [("per-node-drops", "per-node", "no-sync", 0.6, 1)]


def _compare_job(cases, ranks_per_node: int) -> dict:
    rank = dist.get_rank()
    nodes = build_node_groups([list(range(dist.get_world_size()))], ranks_per_node)
    out = {}
    for name, rows, kind, capacity_factor, chunks in cases:
        x_TD, grad_TD = batch(rank, name)
        reference = step(sharded("per-expert", kind, capacity_factor, 1, None), x_TD, grad_TD)
        dedup = step(sharded(rows, kind, capacity_factor, chunks, nodes), x_TD, grad_TD)
        out[name] = (reference, dedup)
    for name, rows, kind, capacity_factor, chunks in DROP_CASES if ranks_per_node == 1 else NODE_DROP_CASES:
        x_TD, grad_TD = batch(rank, name)
        out[name] = step(sharded(rows, kind, capacity_factor, chunks, nodes, routing="random"), x_TD, grad_TD)
    # No host sync in the no-sync variant, in forward and backward.
    for rows in ("per-rank", "per-node"):
        layer = sharded(rows, "no-sync", 1.0, 2, nodes)
        x = torch.randn(TOKENS, D_MODEL, requires_grad=True)
        try:
            with forbid_host_sync():
                syncs = profile_host_syncs(lambda m=layer, x=x: m(x).backward(torch.randn(TOKENS, D_MODEL)))
            # On a CPU the grouped GEMM reads its offsets on the host (test_host_sync.py); nothing else may.
            outside = [str(s) for s in syncs if not s.inside("aten::_grouped_mm")]
            out[f"guard-{rows}"] = "ok" if not outside else f"syncs outside the grouped GEMM: {outside[:3]}"
        except HostSyncError as error:
            out[f"guard-{rows}"] = str(error)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    # Two ranks: nodes of one rank each (per-node then runs its intra-node level over single ranks).
    ep2 = run_ranks(_compare_job, 2, EP2_CASES, 1, timeout=180)
    # Four ranks as two nodes of two.
    ep4 = run_ranks(_compare_job, 4, EP4_CASES, 2, timeout=180)
    return {"ep2": ep2, "ep4": ep4}


@pytest.mark.parametrize(
    "world, name", [("ep2", case[0]) for case in EP2_CASES] + [("ep4", case[0]) for case in EP4_CASES]
)
def test_dedup_rows_compute_what_per_expert_rows_compute(results, world, name):
    dropped_total = 0
    for rank, rank_results in enumerate(results[world]):
        reference, dedup = rank_results[name]
        for key in ("y", "grad_x", "grad_router", "grad_gate_up", "grad_down"):
            torch.testing.assert_close(
                dedup[key], reference[key], **FP32_TOL, msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}"
            )
        assert torch.equal(dedup["expert_TK"], reference["expert_TK"]), "same routes"
        assert reference["grad_router"].abs().max() > 0, "router gradients flow"
        dropped_total += int(dedup["dropped"]) + int(reference["dropped"])
    assert dropped_total == 0, "ample capacity: nothing dropped either way"


def kept_by_hand(expert_TK: torch.Tensor, ep: int, slots: int) -> torch.Tensor:
    """bool (T, k): each destination rank keeps the first ``slots`` tokens (in token order) that chose
    any of its experts; a dropped (token, rank) row drops every assignment it carried."""
    per_rank = EXPERTS // ep
    kept = torch.ones_like(expert_TK, dtype=torch.bool)
    taken = [0] * ep
    for t, experts in enumerate(expert_TK.tolist()):
        for dest in sorted({e // per_rank for e in experts}):
            taken[dest] += 1
            if taken[dest] > slots:
                kept[t] = kept[t] & torch.tensor([e // per_rank != dest for e in experts])
    return kept


def reference_with_drops(rank: int, x_TD, grad_TD, kept_TK) -> dict:
    """The unsharded layer on ``rank``'s batch, each token through each of its kept experts one at a time."""
    layer = make_layer(rank, "random")
    x = x_TD.clone().requires_grad_()
    route = layer.router(x)
    gate_up, down = layer.experts.gate_up, layer.experts.down
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(D_MODEL)
        for j in range(TOP_K):
            if kept_TK[t, j]:
                e = route.expert_TK[t, j]
                gate, up = (gate_up[e] @ x[t]).chunk(2)
                y = y + route.weight_TK[t, j] * (down[e] @ (F.silu(gate) * up))
        rows.append(y)
    y_TD = torch.stack(rows)
    ((y_TD * grad_TD).sum() + route.loss).backward()
    return dict(y=y_TD.detach(), grad_x=x.grad, grad_gate_up=gate_up.grad, grad_down=down.grad)


@pytest.mark.parametrize("name", [case[0] for case in DROP_CASES])
def test_per_rank_no_sync_drops_the_tail_rows(results, name):
    capacity_factor = next(case[3] for case in DROP_CASES if case[0] == name)
    slots = math.ceil(capacity_factor * TOKENS * destination_share(EXPERTS, TOP_K, 2))
    got = [rank_results[name] for rank_results in results["ep2"]]
    kept = [kept_by_hand(g["expert_TK"], 2, slots) for g in got]
    refs = [reference_with_drops(rank, *batch(rank, name), kept[rank]) for rank in range(2)]
    assert sum(int((~k).sum()) for k in kept) > 0, "the capacity is tight enough to drop"
    per_rank = EXPERTS // 2
    for rank in range(2):
        assert int(got[rank]["dropped"]) == int((~kept[rank]).sum()), "this rank's dropped assignments"
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        expected = dict(
            y=refs[rank]["y"],
            grad_x=refs[rank]["grad_x"],
            # An expert's gradient sums every source rank's tokens.
            grad_gate_up=sum(ref["grad_gate_up"][experts] for ref in refs),
            grad_down=sum(ref["grad_down"][experts] for ref in refs),
        )
        for key, value in expected.items():
            torch.testing.assert_close(
                got[rank][key], value, **FP32_TOL, msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}"
            )


def kept_per_node_by_hand(expert_TK: list[torch.Tensor], ranks_per_node: int, capacity_factor: float):
    """Per source rank, bool (T, k) kept assignments, and the assignments each rank dropped, by the
    two-level rule: a source's rows to a node, in token order, keep the first C1 slots; the forwarding
    rank (same local index on that node) receives its C1 slots from each node's source in node order
    and spreads each kept row to the ranks of its node holding its experts, each keeping its first C2."""
    ep = len(expert_TK)
    nodes, per_rank = ep // ranks_per_node, EXPERTS // ep
    p_node, p_rank = destination_share(EXPERTS, TOP_K, nodes), destination_share(EXPERTS, TOP_K, ep)
    c1 = math.ceil(round(capacity_factor * TOKENS * p_node, 9))
    c2 = math.ceil(round(nodes * c1 * p_rank / p_node, 9))
    kept = [torch.ones_like(e, dtype=torch.bool) for e in expert_TK]
    dropped = [0] * ep

    def drop(source: int, token: int, rank: int, at: int) -> None:
        for j, e in enumerate(expert_TK[source][token].tolist()):
            if e // per_rank == rank and kept[source][token, j]:
                kept[source][token, j] = False
                dropped[at] += 1

    def node_ranks(node: int) -> range:
        return range(node * ranks_per_node, (node + 1) * ranks_per_node)

    for node in range(nodes):
        for local in range(ranks_per_node):
            forwarder = node * ranks_per_node + local
            arrived = []  # (source, token) in arrival order
            for source_node in range(nodes):
                source = source_node * ranks_per_node + local
                rows = [
                    t
                    for t, es in enumerate(expert_TK[source].tolist())
                    if any(e // per_rank in node_ranks(node) for e in es)
                ]
                for t in rows[c1:]:
                    for rank in node_ranks(node):
                        drop(source, t, rank, source)
                arrived += [(source, t) for t in rows[:c1]]
            taken = dict.fromkeys(node_ranks(node), 0)
            for source, t in arrived:
                for rank in sorted({e // per_rank for e in expert_TK[source][t].tolist()} & set(node_ranks(node))):
                    taken[rank] += 1
                    if taken[rank] > c2:
                        drop(source, t, rank, forwarder)
    return kept, dropped


def test_per_node_no_sync_drops_the_tail_rows_at_both_levels(results):
    name, capacity_factor = NODE_DROP_CASES[0][0], NODE_DROP_CASES[0][3]
    got = [rank_results[name] for rank_results in results["ep4"]]
    kept, dropped = kept_per_node_by_hand([g["expert_TK"] for g in got], 2, capacity_factor)
    assert [int(g["dropped"]) for g in got] == dropped, "assignments dropped, counted where dropped"
    assert sum(dropped) > 0, "the capacity is tight enough to drop"
    refs = [reference_with_drops(rank, *batch(rank, name), kept[rank]) for rank in range(4)]
    per_rank = EXPERTS // 4
    for rank in range(4):
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        expected = dict(
            y=refs[rank]["y"],
            grad_x=refs[rank]["grad_x"],
            grad_gate_up=sum(ref["grad_gate_up"][experts] for ref in refs),
            grad_down=sum(ref["grad_down"][experts] for ref in refs),
        )
        for key, value in expected.items():
            torch.testing.assert_close(
                got[rank][key], value, **FP32_TOL, msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}"
            )


@pytest.mark.parametrize("world", ["ep2", "ep4"])
def test_no_sync_dedup_never_synchronises_with_the_host(results, world):
    for rank_results in results[world]:
        assert rank_results["guard-per-rank"] == "ok"
        assert rank_results["guard-per-node"] == "ok"


# ---- bytes on the wire --------------------------------------------------------------------------

# Every rank routes its 6 tokens the same way (top-2 of 8 experts; rank r holds experts 2r, 2r+1;
# node 0 = ranks 0, 1 holds experts 0-3, node 1 = ranks 2, 3 holds 4-7):
FIXED_ROUTES = [
    [0, 1],  # both on rank 0 (none remote for rank 0)
    [2, 3],  # both on rank 1: one row per rank and per node, two per expert
    [1, 2],  # ranks 0, 1, one node
    [4, 7],  # ranks 2, 3, one node
    [3, 5],  # ranks 1, 2: both nodes
    [6, 7],  # both on rank 3
]
ROW_BYTES = D_MODEL * 4
SIDE_BYTES = 2 * 2 * 4  # weights and ids, min(k, experts per destination) = 2 columns each, fp32
# Rows each rank sends to other ranks, by hand, (dispatch, combine); the combine sends back what the
# rank received, and every rank routes alike, so a rank receives (ranks - 1) x its local rows:
#   per expert: dispatch, assignments on other ranks: 12 - (3, 4, 2, 3) local; combine 3 x local
#   per rank:   dispatch, (token, rank) pairs on other ranks, 9 in all: 9 - (2, 3, 2, 2); combine 3 x local
#   per node:   inter-node: (token, node) pairs on the other node: node 0 sends t3, t4, t5 (3), node 1
#               t0, t1, t2, t4 (4), and sends back what the other node sent it; intra-node: each rank
#               receives its node's rows from both nodes (node 0: t0, t1, t2, t4; node 1: t3, t4, t5,
#               twice) and sends each to the other rank of its node that holds any of its experts:
#               rank 0 t1, t2, t4; rank 1 t0, t2; rank 2 t3, t5; rank 3 t3, t4 (twice each)
HAND_ROWS = {
    "per-expert": {"rows": ([9, 8, 10, 9], [9, 12, 6, 9])},
    "per-rank": {"rows": ([7, 6, 7, 7], [6, 9, 6, 6])},
    "per-node": {"inter": ([3, 3, 4, 4], [4, 4, 3, 3]), "intra": ([6, 4, 4, 4], [4, 6, 4, 4])},
}
# Rows that cross nodes, (dispatch, combine): per expert, assignments on the other node's ranks, and
# back the assignments of the other node's two ranks on this one; per rank, the same in (token, rank)
# pairs; per node, the inter-node rows.
HAND_CROSSING = {
    "per-expert": ([5, 5, 7, 7], [6, 8, 4, 6]),
    "per-rank": ([4, 4, 5, 5], [4, 6, 4, 4]),
    "per-node": ([3, 3, 4, 4], [4, 4, 3, 3]),
}


def _record_job(rows: str) -> list[tuple]:
    """(level, destination global rank, bytes, direction) for every remote piece of every all-to-all."""
    rank = dist.get_rank()
    nodes = build_node_groups([list(range(4))], 2)
    layer = shard(make_layer(rank), DispatchSpec(dist.group.WORLD, rank, 4, DispatchKind.SYNC, 1.0, 1, rows, nodes))
    sizes = {id(nodes.inter): "inter", id(nodes.intra): "intra"}
    records, original = [], dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        group_ = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(group_)
        splits = input_split_sizes or [input.shape[0] // size] * size
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        for g, count in enumerate(splits):
            dest = dist.get_global_rank(group_, g) if group is not None else g
            if dest != rank and count:
                records.append((sizes.get(id(group), "rows"), dest, count, count * row_bytes, input.dtype))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = recording
    try:
        x_TD = torch.randn(len(FIXED_ROUTES), D_MODEL, requires_grad=True)
        expert_TK = torch.tensor(FIXED_ROUTES)
        weight_TK = torch.rand(expert_TK.shape, requires_grad=True)
        zero = torch.zeros(())
        route = RouterOutput(expert_TK, weight_TK, torch.zeros(EXPERTS, dtype=torch.int64), zero, zero, zero)
        y, _ = layer.dispatcher(x_TD, route, layer.experts)
        forward = list(records)
        y.sum().backward()
    finally:
        dist.all_to_all_single = original
    return forward


@pytest.mark.parametrize("rows", ["per-expert", "per-rank", "per-node"])
def test_bytes_sent_equal_the_hand_count(rows):
    ranks = run_ranks(_record_job, 4, rows, timeout=120)
    for rank, records in enumerate(ranks):
        floats = [r for r in records if r[4] is torch.float32]
        counts = [r for r in records if r[4] is torch.int64]
        for level, (dispatch, back) in HAND_ROWS[rows].items():
            wide = [r for r in floats if r[0] == level and r[3] == r[2] * ROW_BYTES]
            side = [r for r in floats if r[0] == level and r[3] == r[2] * SIDE_BYTES]
            assert sum(r[2] for r in wide) == dispatch[rank] + back[rank], f"rank {rank} {level} rows"
            assert sum(r[3] for r in wide) == (dispatch[rank] + back[rank]) * ROW_BYTES
            # A dedup row carries its side row on dispatch.
            assert sum(r[3] for r in side) == (0 if rows == "per-expert" else dispatch[rank] * SIDE_BYTES)
        # Sync counts: per expert (ep, L) int64 to each rank, per rank one int64 per destination; per node,
        # to each node its rows and how many of them go on to each of its 2 ranks, then inside the node
        # one int64 per rank (the rows forwarded there).
        per_destination = {
            "per-expert": {"rows": 2 * 8},
            "per-rank": {"rows": 8},
            "per-node": {"inter": 3 * 8, "intra": 8},
        }
        for level, nbytes in per_destination[rows].items():
            sent = [r for r in counts if r[0] == level]
            assert sent and sum(r[3] for r in sent) == nbytes * len({r[1] for r in sent}), (rank, level, sent)
        crossing = [r for r in floats if (r[1] // 2 != rank // 2) and r[3] == r[2] * ROW_BYTES]
        dispatch, back = HAND_CROSSING[rows]
        assert sum(r[2] for r in crossing) == dispatch[rank] + back[rank], f"rank {rank} rows across nodes"


# ---- where an overlapped step hands over (moe_engine.moe.dispatch.HandOver) ------------------------------


def _hand_over_job(cases) -> dict:
    """Per case: the groups of the exchanges in flight at each hand-over, in forward and in backward."""
    from moe_engine.moe import dispatch

    rank = dist.get_rank()
    nodes = build_node_groups([list(range(4))], 2)
    names = {id(nodes.inter): "inter", id(nodes.intra): "intra"}
    out = {}
    started: list[str] = []
    calls: list[str] = []
    original = dist.all_to_all_single

    def recording(*args, group=None, async_op=False, **kwargs):
        started.append(names.get(id(group), "ep") + ("" if async_op else " at once"))
        return original(*args, group=group, async_op=async_op, **kwargs)

    def hand_over() -> None:
        # The exchanges started since the last hand-over: the one in flight is last.
        calls.append(" ".join(started))
        started.clear()

    for rows, kind, chunks in cases:
        layer = sharded(rows, kind, 4.0, chunks, nodes)
        started.clear()
        calls.clear()
        dist.all_to_all_single = recording
        dispatch.in_flight_hook = hand_over
        try:
            x_TD, grad_TD = batch(rank, f"hand-over-{rows}-{kind}-{chunks}")
            y = layer(x_TD.requires_grad_())
            forward = list(calls)
            calls.clear()
            started.clear()
            (y * grad_TD).sum().backward()
        finally:
            dispatch.in_flight_hook = None
            dist.all_to_all_single = original
        out[(rows, kind, chunks)] = (forward, list(calls))
    return out


HAND_OVER_CASES = [
    ("per-expert", "sync", 1),
    ("per-rank", "sync", 1),
    ("per-node", "sync", 1),
    ("per-node", "no-sync", 1),
    ("per-node", "no-sync", 2),
]


def test_an_overlapped_step_hands_over_once_per_exchange_or_chain_never_at_counts():
    ranks = run_ranks(_hand_over_job, 4, HAND_OVER_CASES, timeout=180)
    # Hand-worked: per-expert and per-rank rows hand over at the dispatch and at the combine, in each
    # direction; the counts travel at once before the rows (sync), the per-rank side buffer beside its
    # rows. Per node the dispatch is a chain inter -> intra and the combine intra -> inter: each hands
    # over once, with its last exchange in flight (the backward runs each chain the other way round);
    # the side buffers and the intra-node counts travel inside the chain. Chunks: once per chunk and chain.
    want = {
        ("per-expert", "sync", 1): (["ep at once ep", "ep"], ["ep", "ep"]),
        ("per-rank", "sync", 1): (["ep at once ep ep", "ep"], ["ep", "ep ep"]),
        ("per-node", "sync", 1): (
            # Both levels' counts travel before any row: nothing in the chain waits on the host.
            ["inter at once intra at once inter inter intra intra", "intra inter"],
            ["inter intra", "intra intra inter inter"],
        ),
        ("per-node", "no-sync", 1): (
            ["inter inter intra intra", "intra inter"],
            ["inter intra", "intra intra inter inter"],
        ),
        ("per-node", "no-sync", 2): (
            # Chunk 1's inter-node rows leave inside chunk 0's chain; the combine waits chunk 0's return
            # (handing over), then chunk 1's with nothing new started (handing over again).
            ["inter inter inter inter intra intra", "intra inter intra intra", "intra inter", ""],
            ["inter inter intra", "intra intra inter inter intra", "intra intra", "inter inter"],
        ),
    }
    for rank, got in enumerate(ranks):
        for case, (forward, backward) in want.items():
            assert got[case] == (forward, backward), (rank, case, got[case])


def _host_reads_job(chunks: int) -> list[str]:
    nodes = build_node_groups([list(range(4))], 2)
    layer = sharded("per-node", "sync", 1.0, chunks, nodes)
    x_TD, _ = batch(dist.get_rank(), f"host-reads-{chunks}")
    # Split sizes reach the host through tolist (no op the profiler sees), anything else through item.
    reads: list[str] = []
    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append(f"tolist {tuple(self.shape)}")
        return tolist(self)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        syncs = profile_host_syncs(lambda: layer(x_TD))
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    # On a CPU the grouped GEMM reads its offsets on the host (test_host_sync.py); nothing else may.
    return reads + [str(s) for s in syncs if not s.inside("aten::_grouped_mm")]


@pytest.mark.parametrize("chunks", [1, 2])
def test_sync_rows_per_node_read_the_host_once_before_any_row_travels(chunks):
    # Both levels' split sizes in one read: a read inside the chain would hold the other microbatch.
    for rank, reads in enumerate(run_ranks(_host_reads_job, 4, chunks, timeout=120)):
        assert len(reads) == 1, (rank, reads)
