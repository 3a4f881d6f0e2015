"""Every expert backend computes the same MoE layer as the plain references, outputs and gradients."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_to_scale, moe_layer_tolerance, tolerance

from moe_engine.config import ExpertBackendKind, MoEConfig
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.permute import combine, gather_tokens, plan_routing


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def make_layer(d_model, backend, seed=0, device="cpu", **moe) -> MoELayer:
    """Initialised on the CPU from the seed, then moved: the same weights on every device."""
    torch.manual_seed(seed)
    layer = MoELayer(d_model, MoEConfig(backend=backend, **moe))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.to(device)


def per_token_reference(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token through each of its experts one at a time: no sorting, no grouped GEMM.

    Returns the output and the router loss, which the layer adds to the objective implicitly.
    """
    route = layer.router(x_TD)
    gate_up, down = layer.experts.gate_up, layer.experts.down
    rows = []
    for t in range(x_TD.shape[0]):
        y = torch.zeros_like(x_TD[t])
        for j in range(route.expert_TK.shape[1]):
            e = route.expert_TK[t, j]
            gate, up = (gate_up[e] @ x_TD[t]).chunk(2)
            y = y + route.weight_TK[t, j] * (down[e] @ (F.silu(gate) * up))
        rows.append(y)
    y_TD = torch.stack(rows)
    if layer.shared_expert is not None:
        y_TD = y_TD + layer.shared_expert(x_TD)
    return y_TD, route.loss


def run_layer(layer, x_TD, grad_TD, reference=False):
    x = x_TD.clone().requires_grad_()
    layer.zero_grad()
    layer.router.reset_routing_generator()
    if reference:
        y, router_loss = per_token_reference(layer, x)
        ((y * grad_TD).sum() + router_loss).backward()
    else:
        y = layer(x)
        (y * grad_TD).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return y.detach(), x.grad.clone(), grads


SHAPES = [
    # tokens, d_model, hidden, experts, top_k, routing
    (64, 32, 48, 8, 2, "learned"),
    (37, 16, 24, 6, 3, "random"),
    (128, 32, 16, 16, 1, "skewed"),  # skewed at 16 experts leaves the tail experts empty
    (24, 32, 32, 4, 4, "balanced"),
    (5, 16, 16, 32, 2, "random"),  # most experts get no token
]


@pytest.mark.parametrize("tokens, d_model, hidden, experts, k, routing", SHAPES)
# MXFP8 rounds its operands: tests/unit/moe_engine/moe/test_mxfp8_experts.py holds it to its own tolerance.
@pytest.mark.parametrize(
    "backend", [b for b in ExpertBackendKind if b not in (ExpertBackendKind.MXFP8, ExpertBackendKind.FP8)]
)
def test_backends_match_reference(backend, tokens, d_model, hidden, experts, k, routing, device):
    moe = dict(num_experts=experts, top_k=k, expert_hidden=hidden, routing=routing, zipf_exponent=3.0)
    if experts == 16:
        moe["shared_expert_hidden"] = 24
    # Both on the device: random and skewed routing draw from the device's generator, the same draws
    # for both once each restarts its stream.
    layer = make_layer(d_model, backend, device=device, **moe)
    reference = make_layer(d_model, ExpertBackendKind.LOOP, device=device, **moe)
    x_TD, grad_TD = torch.randn(tokens, d_model).to(device), torch.randn(tokens, d_model).to(device)

    y, grad_x, grads = run_layer(layer, x_TD, grad_TD)
    y_ref, grad_x_ref, grads_ref = run_layer(reference, x_TD, grad_TD, reference=True)

    if routing == "skewed":
        counts = plan_routing(layer.router(x_TD).expert_TK, experts).groups.counts_E
        assert (counts == 0).any(), "this case should exercise experts without tokens"
    out_tol = moe_layer_tolerance(tokens, d_model, hidden, gradients=False)
    grad_tol = moe_layer_tolerance(tokens, d_model, hidden)
    assert_close_to_scale(y, y_ref, out_tol, msg="output")
    assert_close_to_scale(grad_x, grad_x_ref, grad_tol, msg="input gradient")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close_to_scale(grads[name], grads_ref[name], grad_tol, msg=name)


def test_grouped_backend_gradient_with_zero_strides(device):
    """y.sum().backward() hands the grouped GEMM an expanded (zero-stride) gradient."""
    layer = make_layer(16, ExpertBackendKind.TORCH, device=device, num_experts=4, top_k=2, expert_hidden=16)
    reference = make_layer(16, ExpertBackendKind.LOOP, device=device, num_experts=4, top_k=2, expert_hidden=16)
    x = torch.randn(20, 16).to(device)
    layer(x).sum().backward()
    reference(x).sum().backward()
    assert_close_to_scale(layer.experts.gate_up.grad, reference.experts.gate_up.grad, moe_layer_tolerance(20, 16, 16))


def fp32_softmax_router(weight_ED: torch.Tensor, x_TD: torch.Tensor, top_k: int):
    """The softmax router written out in fp32 from the values of ``weight_ED`` (whatever its dtype).

    Returns the top-k experts, their scores and the fp32 leaf the scores are differentiable in.
    """
    w_ED = weight_ED.detach().float().requires_grad_()
    scores_TE = torch.softmax(x_TD.detach().float() @ w_ED.T, dim=-1)
    top = scores_TE.topk(top_k, dim=-1)
    return top.indices, top.values, w_ED


@pytest.mark.parametrize("backend", [ExpertBackendKind.LOOP, ExpertBackendKind.TORCH])
def test_layer_cast_with_module_to_bf16(backend, device):
    """``nn.Module.to(bf16)`` casts the router's weight too: the router still scores in fp32 (from the
    rounded weight), its gradient comes back in bf16, and the layer computes what the same rounded
    weights compute in fp32, to bf16 accuracy."""
    layer = make_layer(32, backend, device=device, num_experts=8, top_k=2, expert_hidden=32, shared_expert_hidden=16)
    layer = layer.to(torch.bfloat16)
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    generator = torch.Generator().manual_seed(5)
    x_TD = torch.randn(48, 32, generator=generator).bfloat16().to(device)
    grad_TD = torch.randn(48, 32, generator=generator).bfloat16().to(device)

    route = layer.router(x_TD)
    expert_TK, weight_TK, w_ED = fp32_softmax_router(layer.router.weight, x_TD, top_k=2)
    assert route.weight_TK.dtype == torch.float32
    assert torch.equal(route.expert_TK, expert_TK)
    # The same fp32 products over d_model = 32, perhaps summed in another order, then the softmax.
    router_tol = tolerance(torch.float32, 32, depth=2)
    assert_close_to_scale(route.weight_TK, weight_TK, router_tol)
    grad_TK = torch.randn(48, 2, generator=generator).to(device)
    (route.weight_TK * grad_TK).sum().backward()
    (weight_TK * grad_TK).sum().backward()
    grad_router = layer.router.weight.grad
    assert grad_router.dtype == torch.bfloat16
    # The fp32 gradient rounded once to bf16 (unit roundoff 2^-8), after the fp32 rounding of both sides
    # (the scores and their gradient, then the sum over the 48 tokens).
    fp32_tol = tolerance(torch.float32, 48, depth=3)
    torch.testing.assert_close(grad_router.float(), w_ED.grad, rtol=2**-8, atol=fp32_tol * w_ED.grad.abs().max().item())

    # The bf16 layer rounds each GEMM's output and each activation (2^-8 each, a handful in a row):
    # measured up to 0.009 over four seeds; 0.02 is about five roundings.
    y, grad_x, grads = run_layer(layer, x_TD, grad_TD)
    y_ref, grad_x_ref, grads_ref = run_layer(
        copy.deepcopy(layer).float(), x_TD.float(), grad_TD.float(), reference=True
    )
    assert y.dtype == grad_x.dtype == torch.bfloat16
    assert relative_error(y.float(), y_ref) <= 0.02
    assert relative_error(grad_x.float(), grad_x_ref) <= 0.02
    for name in grads_ref:
        assert grads[name].dtype == torch.bfloat16, name
        assert relative_error(grads[name].float(), grads_ref[name]) <= 0.02, name


def test_permutation_round_trip_and_gradients(device):
    tokens, k, d = 33, 3, 8
    torch.manual_seed(0)
    expert_TK = torch.stack([torch.randperm(7)[:k] for _ in range(tokens)]).to(device)
    plan = plan_routing(expert_TK, 7)
    counts_E, offsets_E = plan.groups.counts_E, plan.groups.offsets_E
    assert counts_E.tolist() == torch.bincount(expert_TK.flatten(), minlength=7).tolist()
    assert offsets_E.dtype == torch.int32
    assert offsets_E.tolist() == torch.cumsum(counts_E, 0).tolist()
    order_N = plan.rows.assignment_R

    x_TD = torch.randn(tokens, d, dtype=torch.float64).to(device).requires_grad_()
    w_TK = torch.rand(tokens, k, dtype=torch.float64).to(device).requires_grad_()
    x_ND = gather_tokens(x_TD, plan.rows)
    # Rows are grouped by expert, in token order within an expert.
    sorted_experts = expert_TK.flatten()[order_N]
    assert (sorted_experts[1:] >= sorted_experts[:-1]).all()
    assert torch.equal(x_ND, x_TD.detach().repeat_interleave(k, 0)[order_N])

    def scale_rows(rows_ND):
        return rows_ND * torch.arange(1, rows_ND.shape[0] + 1, dtype=rows_ND.dtype, device=rows_ND.device)[:, None]

    torch.autograd.gradcheck(lambda x, w: combine(scale_rows(gather_tokens(x, plan.rows)), w, plan.rows), (x_TD, w_TK))
