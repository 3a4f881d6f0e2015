"""Expert-parallel dispatch's single-process pieces: the capacity rule, the slot plan (both maps, the
dropped tail), backends ignoring padding rows, and received padding rows coming back zero. On gloo
ranks against the single-process layer: tests/integration/distributed/test_dispatch_ranks.py."""

from __future__ import annotations

import pytest
import torch
from dispatch_cases import D_MODEL, EXPERTS, HIDDEN, TOP_K, expected_kept, relative_error
from tolerances import tolerance

from moe_engine.config import DispatchKind, ExpertBackendKind
from moe_engine.moe.dispatch import AllToAllDispatcher, capacity
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups, combine, gather_tokens, plan_routing, plan_slots


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
