"""Chunked all-to-all dispatch on gloo ranks against one chunk and the single-process layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import make_case, make_layer, relative_error, shard, step
from distributed_harness import run_ranks
from tolerances import assert_moves_close, in_quadrature, model_tolerance, moe_layer_tolerance, tolerance
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.host_sync import forbid_host_sync
from moe_engine.moe import dispatch
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

SEED = 20260
"""Fixed, so that a failure replays exactly (printed by the tests that draw from it)."""


# ---- one MoE layer on 2 and 4 ranks ------------------------------------------------------------

EP2 = [
    make_case("chunks-no-sync-drops", 2, "no-sync", 0.5, "skewed"),
    make_case("chunks-no-sync-random", 2, "no-sync", 2.0, "random"),
    make_case("chunks-sync-skewed", 2, "sync", 1.0, "skewed", tokens=[24, 17]),
    make_case("chunks-sync-learned", 2, "sync", 1.0, "learned"),
    # One token per rank: 2 slots per destination, so 3 chunks leave one of them empty.
    make_case("chunks-one-token", 2, "no-sync", 2.0, "random", tokens=[1, 1]),
]
EP4 = [
    make_case("chunks-ep4-no-sync-drops", 4, "no-sync", 1.0, "skewed"),
    make_case("chunks-ep4-sync-random", 4, "sync", 1.0, "random", tokens=[24, 9, 17, 24]),
]
LAYER_CHUNKS = (1, 2, 3)


ORDER_CHUNKS = 3
ORDER_CASES = {kind: make_case(f"order-{kind}", 2, kind, 1.0, "random") for kind in ("no-sync", "sync")}


def _layer_job(cases: list[dict], checks: bool) -> dict:
    """Every case at each chunk count; with ``checks`` (2 ranks) also the order of exchanges and GEMMs
    and the host-sync guard (one spawned job: starting ranks costs more than running them)."""
    rank = dist.get_rank()
    results = {}
    for case in cases:
        for chunks in LAYER_CHUNKS:
            layer = make_layer(case["seed"], case["routing"], case["backend"], routing_seed=rank)
            spec = DispatchSpec(dist.group.WORLD, rank, case["ep"], case["kind"], case["capacity_factor"], chunks)
            layer = shard(layer, spec)
            results[case["name"], chunks] = step(layer, case["x"][rank], case["grad"][rank])
    if checks:
        results["order"] = {kind: _order_job(case, ORDER_CHUNKS) for kind, case in ORDER_CASES.items()}
        results["guard"] = _host_sync_job(ORDER_CHUNKS)
    return results


@pytest.fixture(scope="module")
def layers() -> dict:
    return {
        "ep2": run_ranks(_layer_job, 2, EP2, True, timeout=180),
        "ep4": run_ranks(_layer_job, 4, EP4, False, timeout=180),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", EP2 + EP4, ids=lambda case: case["name"])
def test_a_chunked_layer_computes_what_one_chunk_does(layers, case):
    ranks = layers["ep2" if case["ep"] == 2 else "ep4"]
    tokens = sum(x.shape[0] for x in case["x"])
    out_tol = moe_layer_tolerance(tokens, 16, 24, gradients=False)
    grad_tol = moe_layer_tolerance(tokens, 16, 24)
    for rank, results in enumerate(ranks):
        plain = results[case["name"], 1]
        for chunks in LAYER_CHUNKS[1:]:
            got = results[case["name"], chunks]
            # Same routes, same slots: the same assignments kept and dropped.
            assert torch.equal(got["dropped"], plain["dropped"]) and torch.equal(got["counts"], plain["counts"])
            for name in ("y", "grad_x", "grad_router", "grad_gate_up", "grad_down"):
                tol = out_tol if name == "y" else grad_tol
                assert relative_error(got[name], plain[name]) <= tol, (rank, chunks, name)
    if case["name"] == "chunks-no-sync-drops":
        assert all(r[case["name"], 1]["dropped"].item() > 0 for r in ranks), "the case drops assignments"


# ---- the order of exchanges and expert GEMMs -----------------------------------------------------


class _GemmLog(TorchDispatchMode):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.events.append(("gemm", None))
        return func(*args, **(kwargs or {}))


def _order_job(case: dict, chunks: int) -> tuple[list, list]:
    """(forward, backward) events: ("start" | "wait", exchange number) and ("gemm", None)."""
    rank = dist.get_rank()
    events, numbers = [], {}
    flight = dispatch._InFlight
    init, start, wait = flight.__init__, flight.start, flight.wait

    def numbered_init(self, *args):
        init(self, *args)
        numbers[id(self)] = len(numbers)

    def logged_start(self, *args):
        events.append(("start", numbers[id(self)]))
        return start(self, *args)

    def logged_wait(self, *args):
        events.append(("wait", numbers[id(self)]))
        return wait(self, *args)

    flight.__init__, flight.start, flight.wait = numbered_init, logged_start, logged_wait
    try:
        layer = make_layer(case["seed"], case["routing"], case["backend"], routing_seed=rank)
        spec = DispatchSpec(dist.group.WORLD, rank, case["ep"], case["kind"], case["capacity_factor"], chunks)
        layer = shard(layer, spec)
        x = case["x"][rank].clone().requires_grad_()
        with _GemmLog(events):
            y = layer(x)
            forward = list(events)
            events.clear()
            (y * case["grad"][rank]).sum().backward()
    finally:
        flight.__init__, flight.start, flight.wait = init, start, wait
    return forward, events


def _overlapped(events: list) -> dict[int, bool]:
    """Each exchange: whether an expert GEMM ran between its start and its wait."""
    started, under = {}, {}
    for i, (kind, number) in enumerate(events):
        if kind == "start":
            started[number] = i
        elif kind == "wait":
            under[number] = any(e[0] == "gemm" for e in events[started.pop(number) + 1 : i])
    assert not started, "every exchange started is waited for"
    return under


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ORDER_CASES))
def test_every_exchange_but_the_first_and_last_runs_under_experts(layers, kind):
    chunks = ORDER_CHUNKS
    for forward, backward in (results["order"][kind] for results in layers["ep2"]):
        # Exchanges in the order the forward makes them: dispatch 0, dispatch 1, combine 0, dispatch 2,
        # combine 1, combine 2. Each starts asynchronously and is waited for once, in each direction.
        dispatches, combines = [0, 1, 3], [2, 4, 5]
        under = _overlapped(forward)
        assert sorted(under) == sorted(dispatches + combines)
        # Forward: only the first dispatch and the last combine have no experts running under them.
        assert {n for n, hidden in under.items() if not hidden} == {dispatches[0], combines[-1]}
        # Each chunk's experts (2 GEMMs) run after its dispatch arrived.
        assert [e for e in forward if e[0] == "gemm"] == [("gemm", None)] * 2 * chunks
        # Backward: the combines' gradients go first, the dispatch's return last; the first of them
        # (the last chunk's combine) and the last (the first chunk's dispatch) have nothing under them.
        under = _overlapped(backward)
        assert sorted(under) == sorted(dispatches + combines)
        assert {n for n, hidden in under.items() if not hidden} == {combines[-1], dispatches[0]}


def _host_sync_job(chunks: int) -> bool:
    rank = dist.get_rank()
    case = make_case("guard-chunks", 2, "no-sync", 1.0, "skewed")
    layer = shard(
        make_layer(case["seed"], case["routing"], routing_seed=rank),
        DispatchSpec(dist.group.WORLD, rank, 2, "no-sync", 1.0, chunks),
    )
    x = case["x"][rank].clone().requires_grad_()
    with forbid_host_sync():
        layer(x).sum().backward()
    return x.grad is not None


@pytest.mark.slow
def test_the_chunked_no_sync_layer_never_syncs_with_the_host(layers):
    assert [results["guard"] for results in layers["ep2"]] == [True, True]


# ---- whole training steps ----------------------------------------------------------------------

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, aux_loss_weight=0.01, shared_expert_hidden=16),
)
# lr 1 and eps 1: the first updates are about proportional to the (clipped) gradient.
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0, max_grad_norm=0.1)
SEQUENCES, STEPS, TRAIN_CHUNKS = 8, 2, 3
TRAIN_LAYOUTS = {
    2: {
        # Capacity 1.0 with learned routes: some assignments are dropped, the same with chunks.
        "ep2-no-sync-zero1": ParallelConfig(
            dp=2, ep=2, dispatch="no-sync", capacity_factor=1.0, optimizer_sharding="zero1", microbatches=2
        ),
        "ep2-sync-zero1": ParallelConfig(dp=2, ep=2, dispatch="sync", optimizer_sharding="zero1", microbatches=2),
    },
    4: {
        "pp2-ep2-1f1b-no-sync": ParallelConfig(dp=2, ep=2, pp=2, schedule="1f1b", microbatches=2, capacity_factor=2.0),
        "pp2-ep2-1f1b-sync-zero1": ParallelConfig(
            dp=2, ep=2, pp=2, schedule="1f1b", microbatches=2, dispatch="sync", optimizer_sharding="zero1"
        ),
        "dp4-ep4-sync-zero1": ParallelConfig(dp=4, ep=4, dispatch="sync", optimizer_sharding="zero1"),
    },
}


def _batches():
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _train(parallel: ParallelConfig, groups) -> dict:
    rank_model = build_rank_model(CONFIG, parallel, groups, torch.device("cpu"), SEED)
    for layer in rank_model.moe_layers():
        layer.dispatcher.chunks = parallel.a2a_chunks
    trainer = ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)
    params = dict(rank_model.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    share = SEQUENCES // parallel.dp
    rows = slice(groups.coords.dp_rank * share, (groups.coords.dp_rank + 1) * share)
    losses, norms, dropped = [], [], []
    for tokens, labels in _batches():
        losses.append(trainer.step(tokens[rows], labels[rows]))
        norms.append(trainer.last_grad_norm.clone())
        dropped.append([int(layer.last_dropped) for layer in rank_model.moe_layers()])
    updates = {n: p.detach() - before[n] for n, p in params.items()}
    return {
        "losses": losses,
        "norms": norms,
        "updates": updates,
        "before": before,
        "dropped": dropped,
        "last_stage": groups.coords.pp_rank == parallel.pp - 1,
    }


def _train_job(layouts: dict[str, ParallelConfig]) -> dict:
    results = {}
    for name, parallel in layouts.items():
        groups = build_process_groups(Layout(parallel))
        for chunks in (1, TRAIN_CHUNKS):
            results[name, chunks] = _train(dataclasses.replace(parallel, a2a_chunks=chunks), groups)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(TRAIN_LAYOUTS))
def test_chunked_training_steps_match_one_chunk(world):
    print(f"seed {SEED}")
    ranks = run_ranks(_train_job, world, TRAIN_LAYOUTS[world], timeout=300)
    tokens = SEQUENCES * CONFIG.seq_len
    loss_tol = model_tolerance(CONFIG, tokens, gradients=False)
    grad_tol = model_tolerance(CONFIG, tokens)
    norm_tol = in_quadrature(grad_tol, tolerance(torch.float32, CONFIG.vocab_size * CONFIG.d_model, depth=2))
    update_tol = in_quadrature(grad_tol, norm_tol, grad_tol, norm_tol)
    for name in TRAIN_LAYOUTS[world]:
        for rank, results in enumerate(ranks):
            plain, chunked = results[name, 1], results[name, TRAIN_CHUNKS]
            assert chunked["dropped"] == plain["dropped"], (name, rank)
            if plain["last_stage"]:
                torch.testing.assert_close(
                    torch.stack(chunked["losses"]),
                    torch.stack(plain["losses"]),
                    rtol=loss_tol,
                    atol=0,
                    msg=f"{name} rank {rank}: losses",
                )
            torch.testing.assert_close(
                torch.stack(chunked["norms"]), torch.stack(plain["norms"]), rtol=norm_tol, atol=0
            )
            for param, update in chunked["updates"].items():
                assert_moves_close(
                    update,
                    plain["updates"][param],
                    update_tol,
                    plain["before"][param],
                    STEPS,
                    msg=f"{name} rank {rank}: update of {param}",
                )
    if world == 2:
        assert any(sum(d) for r in ranks for d in r["ep2-no-sync-zero1", 1]["dropped"]), "the no-sync layout drops"
