"""Chunked expert all-to-alls (``parallel.a2a_chunks``): the chunk arithmetic (bounds, chunk-major
order, a row map moved to it) against plain loops. One MoE layer, the order of exchanges and expert
GEMMs, the host syncs and whole training steps, chunked against one chunk on gloo ranks:
tests/integration/distributed/test_chunked_dispatch_ranks.py."""

from __future__ import annotations

import itertools

import torch

from moe_engine.moe.permute import (
    RowMap,
    chunk_bounds,
    chunk_major_order,
    chunk_rows,
    gather_tokens,
    plan_routing,
    plan_slots,
    reorder_rows,
)

SEED = 20260
"""Fixed, so that a failure replays exactly (printed by the tests that draw from it)."""


# ---- the chunk arithmetic ----------------------------------------------------------------------


def test_chunk_bounds_cut_rows_into_nearly_equal_pieces():
    for rows in range(12):
        for chunks in range(1, 6):
            bounds = chunk_bounds(rows, chunks)
            sizes = [b - a for a, b in itertools.pairwise(bounds)]
            assert bounds[0] == 0 and bounds[-1] == rows and len(sizes) == chunks
            assert max(sizes) - min(sizes) <= 1, (rows, chunks)
    assert chunk_rows([5, 0, 3], 2) == [[2, 0, 1], [3, 0, 2]]


def _chunk_major_by_loop(rows_S: list[int], chunks: int) -> list[int]:
    starts = [sum(rows_S[:s]) for s in range(len(rows_S))]
    order = []
    for k in range(chunks):
        for s, rows in enumerate(rows_S):
            bounds = chunk_bounds(rows, chunks)
            order += [starts[s] + w for w in range(bounds[k], bounds[k + 1])]
    return order


def test_chunk_major_order_matches_a_loop():
    generator = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    for _ in range(50):
        runs = int(torch.randint(1, 6, (), generator=generator))
        rows_S = torch.randint(0, 9, (runs,), generator=generator)
        chunks = int(torch.randint(1, 5, (), generator=generator))
        total = int(rows_S.sum())
        got = chunk_major_order(rows_S, total, chunks).tolist()
        assert got == _chunk_major_by_loop(rows_S.tolist(), chunks), (rows_S.tolist(), chunks)


def test_a_reordered_row_map_gathers_and_returns_the_same_rows():
    # Slots with drops and empty rows: the gather into the new order is the old gather reordered, and
    # its backward (each token's rows summed back) is unchanged.
    generator = torch.Generator().manual_seed(SEED)
    tokens, top_k, experts, ranks, slots = 10, 2, 4, 2, 6
    expert_TK = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    rows = plan_slots(plan_routing(expert_TK, experts), ranks, slots).rows
    order_R = chunk_major_order(torch.full((ranks,), slots), ranks * slots, 4)
    moved = reorder_rows(rows, order_R)
    x = torch.randn(tokens, 3, generator=generator, requires_grad=True)
    grad_R = torch.randn(ranks * slots, 3, generator=generator)
    old = gather_tokens(x, rows)
    (old_grad,) = torch.autograd.grad(old, x, grad_R)
    new = gather_tokens(x, moved)
    (new_grad,) = torch.autograd.grad(new, x, grad_R[order_R])
    torch.testing.assert_close(new, old[order_R], rtol=0, atol=0)
    torch.testing.assert_close(new_grad, old_grad, rtol=0, atol=0)
    assert isinstance(moved, RowMap) and torch.equal(moved.kept_N, rows.kept_N)
