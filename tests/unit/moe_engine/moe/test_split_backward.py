"""The experts' split backward: input gradients (dX) and weight gradients (dW) as separate autograd
nodes, so that torch's zero-bubble stage backward (``stage_backward_input`` then
``stage_backward_weight``) and ``defer_weight_grads`` run each GEMM once, in its own phase, with
the per-expert loop's autograd gradients (fp32) as the reference."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from moe_engine.config import ExpertBackendKind
from moe_engine.moe import expert_backend as expert_backend_module
from moe_engine.moe import experts as experts_module
from moe_engine.moe.expert_backend import defer_weight_grads
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups

SEED = 20261205
D, F = 16, 8
COUNTS = [5, 0, 11, 3, 7]  # an empty expert included
PADDING = 2  # rows after the last offset, as in an expert-parallel receive buffer


class _Stage(torch.nn.Module):
    """A pipeline stage in miniature: a dense scale (a parameter outside the experts) before them, so
    x reaches the experts through a node of its own, as in the model."""

    def __init__(self, backend: ExpertBackendKind, fused: bool):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.empty(D))
        self.experts = GroupedExperts(D, F, len(COUNTS), backend, fused_kernels=fused)

    def forward(self, x_ND: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        # The padding rows' gradients are undefined: masked, as the dispatch's scatter does.
        real_N1 = (torch.arange(x_ND.shape[0]) < sum(COUNTS)).unsqueeze(1)
        return self.experts(torch.where(real_N1, x_ND * self.scale, 0), groups)


def _stages(fused: bool, backend=ExpertBackendKind.TORCH):
    torch.manual_seed(SEED)
    reference = _Stage(ExpertBackendKind.LOOP, False)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    split = _Stage(backend, fused)
    split.load_state_dict(reference.state_dict())
    x_ND = torch.randn(sum(COUNTS) + PADDING, D)
    grad_y_ND = torch.randn(sum(COUNTS) + PADDING, D)
    grad_y_ND[sum(COUNTS) :] = 0  # callers mask the padding rows' outputs
    groups = ExpertGroups.from_counts(torch.tensor(COUNTS))
    return reference, split, x_ND, grad_y_ND, groups


def _reference_grads(reference, x_ND, grad_y_ND, groups):
    x = x_ND.clone().requires_grad_()
    reference(x, groups).backward(grad_y_ND)
    return x.grad, {name: p.grad for name, p in reference.named_parameters()}


def _assert_close(got, want, name):
    assert got is not None, f"{name}: no gradient"
    if name.startswith("x"):  # the grouped backends leave the padding rows' gradients undefined
        got, want = got[: sum(COUNTS)], want[: sum(COUNTS)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fused", [False, True])
def test_plain_backward_equals_the_loop(fused):
    reference, split, x_ND, grad_y_ND, groups = _stages(fused)
    want_x, want_w = _reference_grads(reference, x_ND, grad_y_ND, groups)
    x = x_ND.clone().requires_grad_()
    split(x, groups).backward(grad_y_ND)
    _assert_close(x.grad, want_x, "x")
    for name, p in split.named_parameters():
        _assert_close(p.grad, want_w[name], name)


class _GEMMCounter:
    def __init__(self, monkeypatch):
        self.calls = 0
        # The input gradients' GEMMs run in the experts module, the weight gradients' in expert_backend.
        for module in (experts_module, expert_backend_module):
            inner = module.grouped_mm

            def counted(*args, inner=inner, **kwargs):
                self.calls += 1
                return inner(*args, **kwargs)

            monkeypatch.setattr(module, "grouped_mm", counted)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


@pytest.mark.parametrize("fused", [False, True])
def test_zero_bubble_stage_backward_splits_dx_from_dw(fused, monkeypatch):
    """torch's input phase gives dX and no expert weight gradient, its weight phase the weight
    gradients; each equals the loop's, and each phase runs only its own GEMMs: grad_a and dX in
    the input phase (2), the two weight-gradient GEMMs in the weight phase (2)."""
    reference, split, x_ND, grad_y_ND, groups = _stages(fused)
    want_x, want_w = _reference_grads(reference, x_ND, grad_y_ND, groups)
    gemms = _GEMMCounter(monkeypatch)

    x = x_ND.clone().requires_grad_()
    y = split(x, groups)
    assert gemms.take() == 2
    (grad_x,), param_groups = stage_backward_input([y], [grad_y_ND], [x], split.parameters())
    assert gemms.take() == 2, "the input phase ran other GEMMs than grad_a and dX"
    _assert_close(grad_x, want_x, "x")
    assert all(p.grad is None for p in split.parameters()), "a weight gradient in the input phase"

    stage_backward_weight(split.parameters(), param_groups)
    assert gemms.take() == 2, "the weight phase ran other GEMMs than the two weight gradients"
    for name, p in split.named_parameters():
        _assert_close(p.grad, want_w[name], name)


def test_defer_weight_grads_runs_each_weight_gradient_once():
    reference, split, x_ND, grad_y_ND, groups = _stages(fused=True)
    want_x, want_w = _reference_grads(reference, x_ND, grad_y_ND, groups)
    expert_weights = {"experts.gate_up", "experts.down"}
    fired: list[str] = []
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(name))

    x = x_ND.clone().requires_grad_()
    with defer_weight_grads() as deferred:
        split(x, groups).backward(grad_y_ND)
    _assert_close(x.grad, want_x, "x")
    assert deferred.pending == 1
    named = dict(split.named_parameters())
    assert all(named[name].grad is None for name in expert_weights)
    _assert_close(named["scale"].grad, want_w["scale"], "scale")  # not deferred
    assert fired == ["scale"]

    deferred.run_all()
    deferred.run_all()  # a second call finds nothing queued
    assert deferred.pending == 0
    for name, p in named.items():
        _assert_close(p.grad, want_w[name], name)
    assert sorted(fired) == sorted(["scale", *expert_weights]), "a hook fired twice or not at all"


def test_run_all_before_backward_raises():
    _, split, x_ND, _, groups = _stages(fused=False)
    with defer_weight_grads() as deferred:
        split(x_ND.clone().requires_grad_(), groups)
    with pytest.raises(RuntimeError, match="before the backward"):
        deferred.run_all()
    assert deferred.pending == 1


def test_backward_twice_accumulates_twice():
    """A retained graph backpropagated twice accumulates twice, as autograd's own ops do: the stash
    of the first pass is consumed, not mistaken for a weights-only pass."""
    reference, split, x_ND, grad_y_ND, groups = _stages(fused=False)
    want_x, want_w = _reference_grads(reference, x_ND, grad_y_ND, groups)
    x = x_ND.clone().requires_grad_()
    y = split(x, groups)
    y.backward(grad_y_ND, retain_graph=True)
    y.backward(grad_y_ND)
    _assert_close(x.grad, 2 * want_x, "x")
    for name, p in split.named_parameters():
        _assert_close(p.grad, 2 * want_w[name], name)


def test_input_only_grad_then_full_backward():
    """``autograd.grad`` for x alone leaves the weights' closure in the stash; a later full backward of
    the same graph still computes dX and the weights once."""
    reference, split, x_ND, grad_y_ND, groups = _stages(fused=False)
    want_x, want_w = _reference_grads(reference, x_ND, grad_y_ND, groups)
    x = x_ND.clone().requires_grad_()
    y = split(x * 1, groups)
    (grad_x,) = torch.autograd.grad(y, x, grad_y_ND, retain_graph=True)
    _assert_close(grad_x, want_x, "x (autograd.grad)")
    y.backward(grad_y_ND)
    _assert_close(x.grad, want_x, "x")
    for name, p in split.named_parameters():
        _assert_close(p.grad, want_w[name], name)


def test_mxfp8_split_equals_its_plain_backward():
    """The MXFP8 backend splits the same way; its reference is its own unsplit backward (the
    quantized GEMMs differ from the loop's fp32 ones)."""
    _, plain, x_ND, grad_y_ND, groups = _stages(fused=False, backend=ExpertBackendKind.MXFP8)
    _, split, _, _, _ = _stages(fused=False, backend=ExpertBackendKind.MXFP8)
    x = x_ND.clone().requires_grad_()
    plain(x, groups).backward(grad_y_ND)

    x2 = x_ND.clone().requires_grad_()
    y = split(x2, groups)
    (grad_x,), param_groups = stage_backward_input([y], [grad_y_ND], [x2], split.parameters())
    assert all(p.grad is None for p in split.experts.parameters())
    stage_backward_weight(split.parameters(), param_groups)
    torch.testing.assert_close(grad_x[: sum(COUNTS)], x.grad[: sum(COUNTS)], rtol=0, atol=0)
    for (name, p), q in zip(split.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_weights_only_backward_skips_dx(monkeypatch):
    """A backward that wants the weights alone runs grad_a and the two weight-gradient GEMMs, not dX."""
    reference, split, x_ND, grad_y_ND, groups = _stages(fused=False)
    _, want_w = _reference_grads(reference, x_ND, grad_y_ND, groups)
    gemms = _GEMMCounter(monkeypatch)
    y = split(x_ND.clone().requires_grad_(), groups)
    gemms.take()
    weights = [split.experts.gate_up, split.experts.down]
    grads = torch.autograd.grad(y, weights, grad_y_ND)
    assert gemms.take() == 3
    _assert_close(grads[0], want_w["experts.gate_up"], "gate_up")
    _assert_close(grads[1], want_w["experts.down"], "down")
