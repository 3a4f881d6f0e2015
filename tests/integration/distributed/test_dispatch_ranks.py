"""Expert-parallel dispatch on gloo ranks against the single-process layer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dispatch_cases import (
    D_MODEL,
    EXPERTS,
    HIDDEN,
    TOKENS,
    TOP_K,
    expected_kept,
    make_case,
    make_layer,
    relative_error,
    shard,
    step,
)
from distributed_harness import run_ranks
from tolerances import moe_layer_tolerance

from moe_engine.host_sync import HostSyncError, forbid_host_sync
from moe_engine.moe.dispatch import LocalDispatcher
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer


def _sharded(case: dict, rank: int) -> MoELayer:
    # Each rank draws its own random/skewed routing, as ranks with different data would.
    layer = make_layer(case["seed"], case["routing"], case["backend"], routing_seed=rank)
    return shard(layer, DispatchSpec(dist.group.WORLD, rank, case["ep"], case["kind"], case["capacity_factor"]))


def _host_sync_checks(rank: int) -> dict:
    """No-sync forward+backward inside the guard; the sync variant must trip it."""
    outcome = {}
    for kind in ("no-sync", "sync"):
        layer = _sharded(make_case("guard", 2, kind, 1.0, "skewed"), rank)
        x = torch.randn(TOKENS, D_MODEL, requires_grad=True)
        try:
            with forbid_host_sync():
                layer(x).backward(torch.randn(TOKENS, D_MODEL))
            outcome[kind] = "ok"
        except HostSyncError as error:
            outcome[kind] = f"HostSyncError: {error}"
    return outcome


def _rank_job(cases: list[dict], guard: bool) -> dict:
    rank = dist.get_rank()
    results = {case["name"]: step(_sharded(case, rank), case["x"][rank], case["grad"][rank]) for case in cases}
    if guard:
        results["guard"] = _host_sync_checks(rank)
    return results


EP2_CASES = [
    make_case("sync-learned", 2, "sync", 1.0, "learned"),
    make_case("no-sync-learned", 2, "no-sync", 2.0, "learned"),
    # Uneven loads, and ranks with different token counts (the sync variant allows it).
    make_case("sync-skewed", 2, "sync", 1.0, "skewed", tokens=[24, 17]),
    make_case("no-sync-random", 2, "no-sync", 2.0, "random"),
    make_case("no-sync-drops", 2, "no-sync", 0.5, "skewed"),
    make_case("no-sync-drops-loop", 2, "no-sync", 0.5, "skewed", backend="loop"),
]
EP4_CASES = [
    make_case("ep4-no-sync-drops", 4, "no-sync", 1.0, "skewed"),
    make_case("ep4-sync-random", 4, "sync", 1.0, "random"),
]
CASES = {case["name"]: case for case in EP2_CASES + EP4_CASES}


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case's per-rank results: one spawned job per world size."""
    ep2 = run_ranks(_rank_job, 2, EP2_CASES, True, timeout=120)
    ep4 = run_ranks(_rank_job, 4, EP4_CASES, False, timeout=120)
    return {name: [rank_results[name] for rank_results in job] for job in (ep2, ep4) for name in job[0]}


def kept_reference(layer: MoELayer, x_TD, grad_TD, kept_TK) -> dict:
    """Each token through each of its kept experts one at a time, plus the router loss."""
    x = x_TD.clone().requires_grad_()
    layer.zero_grad()
    layer.router.reset_routing_generator()
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
    return dict(
        y=y_TD.detach(),
        grad_x=x.grad,
        grad_router=layer.router.weight.grad.clone(),
        grad_gate_up=layer.experts.gate_up.grad.clone(),
        grad_down=layer.experts.down.grad.clone(),
        expert_TK=route.expert_TK,
    )


def references(case: dict) -> list[dict]:
    """Per rank: the full single-process layer on that rank's batch (LocalDispatcher), and which
    assignments no-sync capacity keeps (recomputed here from the router's choices)."""
    refs = []
    for rank, (x_TD, grad_TD) in enumerate(zip(case["x"], case["grad"])):
        layer = make_layer(case["seed"], case["routing"], routing_seed=rank)
        assert isinstance(layer.dispatcher, LocalDispatcher)
        ref = step(layer, x_TD, grad_TD)
        layer.router.reset_routing_generator()
        expert_TK = layer.router(x_TD).expert_TK
        ref["kept"] = torch.ones_like(expert_TK, dtype=torch.bool)
        if case["kind"] == "no-sync":
            slot_capacity = math.ceil(case["capacity_factor"] * x_TD.shape[0] * TOP_K / case["ep"])
            ref["kept"] = expected_kept(expert_TK, case["ep"], slot_capacity)
        if not ref["kept"].all():
            ref.update(kept_reference(layer, x_TD, grad_TD, ref["kept"]))
        refs.append(ref)
    return refs


def assert_matches_reference(case: dict, ranks: list[dict]) -> None:
    refs = references(case)
    per_rank = EXPERTS // case["ep"]
    for rank, (got, ref) in enumerate(zip(ranks, refs)):
        assert got["experts"] == range(rank * per_rank, (rank + 1) * per_rank)
        assert got["dropped"].dtype == torch.int64 and got["dropped"].dim() == 0
        assert got["dropped"].item() == (~ref["kept"]).sum().item()
        assert torch.equal(got["counts"], ref["counts"])
        # The single-process layer's rounding; the experts' gradients sum over every rank's tokens.
        all_tokens = sum(x.shape[0] for x in case["x"])
        grad_tol = moe_layer_tolerance(all_tokens, D_MODEL, HIDDEN)
        for name in ("y", "grad_x", "grad_router"):
            tol = moe_layer_tolerance(all_tokens, D_MODEL, HIDDEN, gradients=False) if name == "y" else grad_tol
            assert relative_error(got[name], ref[name]) <= tol, (rank, name)
        # A rank's experts receive gradient from every rank's tokens.
        for name in ("grad_gate_up", "grad_down"):
            expected = sum(r[name] for r in refs)[rank * per_rank : (rank + 1) * per_rank]
            assert relative_error(got[name], expected) <= grad_tol, (rank, name)


@pytest.mark.parametrize(
    "name", ["sync-learned", "no-sync-learned", "sync-skewed", "no-sync-random", "ep4-sync-random"]
)
@pytest.mark.slow
def test_dropless_matches_single_process_layer(results, name):
    assert_matches_reference(CASES[name], results[name])
    assert all(r["dropped"].item() == 0 for r in results[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["no-sync-drops", "no-sync-drops-loop", "ep4-no-sync-drops"])
def test_over_capacity_drops_are_counted_and_removed(results, name):
    assert sum(r["dropped"].item() for r in results[name]) > 0, "this case should drop assignments"
    assert_matches_reference(CASES[name], results[name])


@pytest.mark.slow
def test_no_sync_has_no_host_sync_and_sync_is_caught(results):
    for outcome in results["guard"]:
        assert outcome["no-sync"] == "ok"
        assert outcome["sync"].startswith("HostSyncError") and "tolist" in outcome["sync"]
