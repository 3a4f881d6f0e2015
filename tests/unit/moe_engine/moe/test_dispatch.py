"""Expert-parallel dispatch computes the single-process layer's function (or exactly its capacity-dropped
version), reports its drops, and the no-sync variant never synchronises with the host."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from tolerances import tolerance

from moe_engine.config import DispatchKind, ExpertBackendKind, MoEConfig
from moe_engine.host_sync import HostSyncError, forbid_host_sync
from moe_engine.moe.dispatch import AllToAllDispatcher, capacity
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.permute import ExpertGroups, combine, gather_tokens, plan_routing, plan_slots

D_MODEL, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 24, 8, 2, 24


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def make_layer(seed: int, routing: str, backend: str = "torch", routing_seed: int = 0) -> MoELayer:
    """Same parameters for every ``routing_seed``: it only seeds random and skewed expert choices."""
    torch.manual_seed(seed)
    moe = MoEConfig(
        num_experts=EXPERTS,
        top_k=TOP_K,
        expert_hidden=HIDDEN,
        routing=routing,
        zipf_exponent=2.0,
        backend=backend,
        routing_seed=routing_seed,
    )
    layer = MoELayer(D_MODEL, moe)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def shard(full: MoELayer, dispatch: DispatchSpec) -> MoELayer:
    """A layer built with ``dispatch`` (its block of experts, its dispatcher) holding ``full``'s weights."""
    layer = MoELayer(full.d_model, full.config, full.router.layer_idx, full.fused_kernels, dispatch)
    held = layer.experts.global_experts
    experts = {"experts.gate_up", "experts.down"}
    state = {n: v[held.start : held.stop] if n in experts else v for n, v in full.state_dict().items()}
    layer.load_state_dict(state)
    return layer


def make_case(name, ep, kind, capacity_factor, routing, backend="torch", tokens=None, seed=0):
    """One expert-parallel configuration, with each rank's own fresh batch and output gradient."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tokens = tokens or [TOKENS] * ep
    x = [torch.randn(t, D_MODEL, generator=generator) for t in tokens]
    grad = [torch.randn(t, D_MODEL, generator=generator) for t in tokens]
    return dict(
        name=name,
        ep=ep,
        kind=kind,
        capacity_factor=capacity_factor,
        routing=routing,
        backend=backend,
        seed=seed,
        x=x,
        grad=grad,
    )


def _step(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor) -> dict:
    x = x_TD.clone().requires_grad_()
    layer.zero_grad()
    layer.router.reset_routing_generator()
    y = layer(x)
    (y * grad_TD).sum().backward()
    return dict(
        y=y.detach(),
        grad_x=x.grad,
        grad_router=layer.router.weight.grad,
        grad_gate_up=layer.experts.gate_up.grad,
        grad_down=layer.experts.down.grad,
        dropped=layer.last_dropped,
        counts=layer.last_counts_E,
        experts=layer.experts.global_experts,
    )


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
    results = {case["name"]: _step(_sharded(case, rank), case["x"][rank], case["grad"][rank]) for case in cases}
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


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case's per-rank results: one spawned job per world size."""
    ep2 = run_ranks(_rank_job, 2, EP2_CASES, True, timeout=120)
    ep4 = run_ranks(_rank_job, 4, EP4_CASES, False, timeout=120)
    return {name: [rank_results[name] for rank_results in job] for job in (ep2, ep4) for name in job[0]}


def expected_kept(expert_TK: torch.Tensor, ep: int, slot_capacity: int) -> torch.Tensor:
    """bool (T, k): each destination keeps its first ``slot_capacity`` assignments by (expert, t, j)."""
    per_rank = EXPERTS // ep
    kept = torch.ones(expert_TK.numel(), dtype=torch.bool)
    flat = expert_TK.flatten().tolist()
    for dest in range(ep):
        queue = sorted((e, n) for n, e in enumerate(flat) if e // per_rank == dest)
        for _, n in queue[slot_capacity:]:
            kept[n] = False
    return kept.view_as(expert_TK)


# Single-process pieces -------------------------------------------------------------------------


def test_capacity_is_the_factor_times_the_balanced_load():
    assert capacity(64, 2, 1.25) == 40
    assert capacity(48, 2, 0.5) == 12
    assert capacity(30, 1, 0.1) == 3
    assert capacity(10, 4, 1.0) == 3


@pytest.mark.parametrize("ep, slot_capacity", [(2, 5), (4, 3), (2, 40)])
def test_slot_plan_maps_both_ways_and_drops_the_tail(ep, slot_capacity):
    torch.manual_seed(ep)
    tokens = 20
    expert_TK = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
    expert_TK[:8, 0] = 0  # a crowded first expert
    slots = plan_slots(plan_routing(expert_TK, EXPERTS), ep, slot_capacity)
    rows = slots.rows

    kept_TK = expected_kept(expert_TK, ep, slot_capacity)
    assert torch.equal(rows.kept_N, kept_TK.flatten())
    assert slots.dropped.item() == (~kept_TK).sum().item()
    kept_E = torch.bincount(expert_TK[kept_TK], minlength=EXPERTS)
    assert torch.equal(slots.kept_E, kept_E)
    kept_n = rows.kept_N.nonzero().flatten()
    filled_r = rows.filled_R.nonzero().flatten()
    assert torch.equal(rows.assignment_R[rows.row_N[kept_n]], kept_n)
    assert torch.equal(rows.row_N[rows.assignment_R[filled_r]], filled_r)
    per_rank = EXPERTS // ep
    assert torch.equal(rows.row_N[kept_n] // slot_capacity, expert_TK.flatten()[kept_n] // per_rank)

    x_TD = torch.randn(tokens, 3, dtype=torch.float64, requires_grad=True)
    w_TK = torch.rand(tokens, TOP_K, dtype=torch.float64, requires_grad=True)
    scale_R1 = torch.arange(1.0, rows.assignment_R.numel() + 1, dtype=torch.float64).unsqueeze(1)
    buffer_RD = gather_tokens(x_TD, rows)
    assert (buffer_RD[~rows.filled_R] == 0).all()
    expected_TD = (
        (w_TK * kept_TK).unsqueeze(2).mul(x_TD.unsqueeze(1)).mul(scale_R1[rows.row_N].view(tokens, TOP_K, 1)).sum(1)
    )
    assert torch.allclose(combine(buffer_RD * scale_R1, w_TK, rows), expected_TD)
    torch.autograd.gradcheck(lambda x, w: combine(gather_tokens(x, rows) * scale_R1, w, rows), (x_TD, w_TK))


# MXFP8 rounds its operands: tests/unit/moe_engine/moe/test_mxfp8_experts.py holds it to its own tolerance.
@pytest.mark.parametrize(
    "backend", [b for b in ExpertBackendKind if b not in (ExpertBackendKind.MXFP8, ExpertBackendKind.FP8)]
)
def test_backends_ignore_trailing_padding_rows(backend):
    torch.manual_seed(0)
    experts = GroupedExperts(D_MODEL, HIDDEN, 3, backend)
    reference = GroupedExperts(D_MODEL, HIDDEN, 3, ExpertBackendKind.LOOP)
    for p, q in zip(experts.parameters(), reference.parameters()):
        torch.nn.init.normal_(p, std=0.3)
        q.data.copy_(p.data)
    counts_E = torch.tensor([4, 0, 3])
    x_ND = torch.randn(7, D_MODEL)
    padded_ND = torch.cat([x_ND, torch.full((5, D_MODEL), float("nan"))])
    grad_ND = torch.randn(7, D_MODEL)

    y_ND = experts(padded_ND, ExpertGroups.from_counts(counts_E))[:7]
    (y_ND * grad_ND).sum().backward()
    y_ref = reference(x_ND, ExpertGroups.from_counts(counts_E))
    (y_ref * grad_ND).sum().backward()
    # The experts' two GEMMs and their backward, the weight gradients summed over up to 7 rows.
    assert relative_error(y_ND, y_ref) <= tolerance(torch.float32, HIDDEN, depth=2)
    for p, q in zip(experts.parameters(), reference.parameters()):
        assert relative_error(p.grad, q.grad) <= tolerance(torch.float32, HIDDEN, depth=4)


def test_dispatcher_kinds_are_validated():
    assert DispatchKind("no-sync") is DispatchKind.NO_SYNC
    with pytest.raises(ValueError, match="capacity_factor"):
        AllToAllDispatcher(None, DispatchKind.NO_SYNC, 0.0)


class _NanPadExperts:
    """Rows times 2 + their expert id; rows after the last offset NaN, as a grouped GEMM may leave them."""

    def __init__(self, fused: bool):
        self.fused_kernels = fused

    def __call__(self, x, groups, rows=None):
        x_RD = x if rows is None else gather_tokens(x, rows, self.fused_kernels)
        expert_R = torch.searchsorted(groups.offsets_E, torch.arange(x_RD.shape[0]), right=True)
        y_RD = x_RD * 2 + expert_R.unsqueeze(1)
        real_R = torch.arange(x_RD.shape[0]) < groups.offsets_E[-1]
        return torch.where(real_R.unsqueeze(1), y_RD, float("nan"))


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_received_padding_rows_come_back_zero_with_no_gradient(fused):
    from moe_engine.moe.dispatch import _run_received

    seed = 7
    torch.manual_seed(seed)
    local_R = torch.tensor([2, 0, 3, 1, 0, 3, 3, 2, 1, 0])  # 3 local experts; id 3 is padding
    counts_L = torch.bincount(local_R, minlength=4)[:3]
    recv_RD = torch.randn(10, 6, requires_grad=True)
    y_RD = _run_received(recv_RD, local_R, counts_L, _NanPadExperts(fused), padded=True, fused=fused)
    real = local_R < 3
    expected = torch.where(real.unsqueeze(1), recv_RD.detach() * 2 + local_R.unsqueeze(1), 0.0)
    assert torch.equal(y_RD, expected), f"seed {seed}"
    grad = torch.randn_like(y_RD)
    y_RD.backward(grad)
    assert torch.equal(recv_RD.grad, torch.where(real.unsqueeze(1), grad * 2, 0.0)), f"seed {seed}"
