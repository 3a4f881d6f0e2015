"""The dense projections' weight gradients added inside their GEMM (``moe_engine.modules.linear.Linear``
with a ``main_grad``): the data-parallel optimizer's buffers hold what the ``.grad`` path puts there (bit
for bit on the CPU, whose path is the same product and add), and a float64 ``nn.Linear`` model's
gradients; no dense gradient reaches ``.grad``; ``autograd.grad`` hands the gradients back and leaves the
buffers alone; torch's zero-bubble phases run dX and dW apart, each once; without ``main_grad`` the layer
is plain ``F.linear``."""

from __future__ import annotations

import pytest
import torch
from op_recording import OpRecorder
from tolerances import assert_close_to_scale, tolerance
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from moe_engine.config import OptimizerConfig
from moe_engine.modules.linear import Linear
from moe_engine.modules.mlp import SwiGLU
from moe_engine.parallel.data_parallel import DataParallelOptimizer

SEED = 20261207
D, H = 16, 24
BATCH, SEQ = 2, 5
OP = "moe_engine::wgrad_accumulate"
MICROBATCHES = 2


class _Model(torch.nn.Module):
    """A norm-like scale (a parameter whose gradient goes through ``.grad``) before a SwiGLU MLP (three
    projections) and a last projection that takes a non-contiguous input."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(D))
        self.mlp = SwiGLU(D, H)
        self.out = Linear(BATCH, BATCH)

    def forward(self, x_BSD):
        y_BSD = self.mlp(x_BSD * self.scale)
        # (B, S, D) -> (D, S, B): the projection's input is a strided view.
        return self.out(y_BSD.transpose(0, 2))


def _model(dtype):
    """The same values in every dtype: drawn in fp32, then cast."""
    torch.manual_seed(SEED)
    model = _Model()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model.to(dtype)


def _inputs(dtype):
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        (
            torch.randn(BATCH, SEQ, D, generator=generator).to(dtype),
            torch.randn(D, SEQ, BATCH, generator=generator).to(dtype),
        )
        for _ in range(MICROBATCHES)
    ]


def _gemms(recorder: OpRecorder) -> int:
    # The last projection's input is a strided view: torch computes its dX with a bmm.
    return recorder.ops["aten::mm"] + recorder.ops["aten::bmm"]


def _train_buffers(dtype, accumulate_in_gemm):
    """The gradient buffers after the microbatches' backwards, the inputs' gradients, and the ops run."""
    model = _model(dtype)
    opt = DataParallelOptimizer(
        model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=200, accumulate_in_gemm=accumulate_in_gemm
    )
    opt.zero_grad()
    opt.arm_overlap(MICROBATCHES)
    counted = OpRecorder()
    input_grads = []
    for x_BSD, grad_y in _inputs(dtype):
        x_BSD = x_BSD.clone().requires_grad_()
        y = model(x_BSD)
        with counted:
            y.backward(grad_y)
        input_grads.append(x_BSD.grad)
    # Every bucket launched in backward: the weights' hooks fire though no gradient reaches .grad.
    assert opt.launched_buckets == len(opt.buckets)
    opt.finish_grad_sync()
    buffers = {name: opt.grad_view(p).clone() for name, p in model.named_parameters()}
    return buffers, input_grads, counted.ops, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_gemm_buffers_equal_the_through_grad_buffers(dtype):
    want, want_x, want_ops, _ = _train_buffers(dtype, accumulate_in_gemm=False)
    got, got_x, got_ops, model = _train_buffers(dtype, accumulate_in_gemm=True)
    for name, grad in want.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(got[name], grad), name
    for got_grad, want_grad in zip(got_x, want_x):
        assert torch.equal(got_grad, want_grad)
    # Four projections per microbatch; none without main_grad.
    assert got_ops[OP] == 4 * MICROBATCHES
    assert want_ops[OP] == 0
    if dtype != torch.float32:  # fp32 weights' .grad is their buffer view
        assert all(p.grad is None for name, p in model.named_parameters() if name != "scale")


def test_in_gemm_buffers_equal_a_float64_model():
    got, got_x, _, _ = _train_buffers(torch.float32, accumulate_in_gemm=True)
    reference = _model(torch.float64)
    want_x = []
    for x_BSD, grad_y in _inputs(torch.float64):
        x_BSD = x_BSD.clone().requires_grad_()
        reference(x_BSD).backward(grad_y)
        want_x.append(x_BSD.grad)
    # The longest sum is H terms; from the inputs through the MLP and back, six reductions in a row.
    tol = tolerance(torch.float32, H, depth=6)
    for name, param in reference.named_parameters():
        assert_close_to_scale(got[name].double(), param.grad, tol, name)
    for got_grad, want_grad in zip(got_x, want_x):
        assert_close_to_scale(got_grad.double(), want_grad, tol, "x")


def test_autograd_grad_hands_the_gradients_back_and_leaves_the_buffers():
    dtype = torch.bfloat16
    model = _model(dtype)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=200)
    opt.zero_grad()
    x_BSD, grad_y = _inputs(dtype)[0]
    weights = [p for name, p in model.named_parameters() if name != "scale"]
    grads = torch.autograd.grad(model(x_BSD), weights, grad_y)

    plain = _model(dtype)
    want = torch.autograd.grad(plain(x_BSD), [p for n, p in plain.named_parameters() if n != "scale"], grad_y)
    for got, expected in zip(grads, want):
        assert expected.abs().sum() > 0
        assert torch.equal(got, expected)
    for weight in weights:
        assert not opt.grad_view(weight).any()


def test_zero_bubble_phases_split_dx_from_dw():
    """With ``main_grad`` attached, torch's input phase runs the four projections' dX GEMMs and no
    weight gradient, its weight phase their four dW GEMMs; the gradients equal the plain model's."""
    dtype = torch.float32
    plain = _model(dtype)
    x_BSD, grad_y = _inputs(dtype)[0]
    x_plain = x_BSD.clone().requires_grad_()
    plain(x_plain).backward(grad_y)

    model = _model(dtype)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=200)
    opt.zero_grad()
    x = x_BSD.clone().requires_grad_()
    y = model(x)
    with OpRecorder() as mms:
        (grad_x,), param_groups = stage_backward_input([y], [grad_y], [x], model.parameters())
    assert _gemms(mms) == 4, "the input phase ran other GEMMs than the projections' dX"
    assert torch.equal(grad_x, x_plain.grad)
    for name, p in model.named_parameters():
        assert not opt.grad_view(p).any(), f"{name}: a weight gradient in the input phase"
    with OpRecorder() as mms:
        stage_backward_weight(model.parameters(), param_groups)
    assert _gemms(mms) == 4, "the weight phase ran other GEMMs than the projections' dW"
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        # stage_backward_weight hands the gradients to .grad (the buffer view, for fp32 weights).
        assert torch.equal(p.grad, q.grad), name


def test_without_main_grad_it_is_plain_linear():
    x = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(SEED))
    layer = Linear(D, 6)
    reference = torch.nn.Linear(D, 6, bias=False)
    reference.load_state_dict(layer.state_dict())
    counted = OpRecorder()
    with counted:
        y = layer(x)
        y.sum().backward()
    reference(x).sum().backward()
    assert torch.equal(y, reference(x))
    assert torch.equal(layer.weight.grad, reference.weight.grad)
    assert counted.fused() == {}


def test_linear_has_no_bias():
    with pytest.raises(ValueError, match="no bias"):
        Linear(D, 6, bias=True)


def test_weights_only_pass_gives_the_plain_gradients():
    """``autograd.grad`` for x, then for the weights alone: each weight's gradient once, equal to the plain
    model's. The way to a projection's weight node passes its GEMM's dX node (torch's), so this pass
    computes the four dX again beside the four dW; torch's zero-bubble weight phase does not (it starts
    at the saved gradients: test_zero_bubble_phases_split_dx_from_dw)."""
    dtype = torch.float32
    plain = _model(dtype)
    x_BSD, grad_y = _inputs(dtype)[0]
    names = [n for n, _ in plain.named_parameters() if n != "scale"]
    want = torch.autograd.grad(plain(x_BSD), [p for n, p in plain.named_parameters() if n in names], grad_y)

    model = _model(dtype)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=200)
    opt.zero_grad()
    x = x_BSD.clone().requires_grad_()
    y = model(x)
    torch.autograd.grad(y, x, grad_y, retain_graph=True)
    with OpRecorder() as mms:
        grads = torch.autograd.grad(y, [p for n, p in model.named_parameters() if n in names], grad_y)
    assert _gemms(mms) == 8
    for name, got, expected in zip(names, grads, want):
        assert torch.equal(got, expected), name
    assert not any(opt.grad_view(p).any() for p in model.parameters())


def test_a_checkpointed_projection_is_not_run_again_in_backward():
    """Non-reentrant checkpointing stops its recompute at the last saved tensor: the projection saves x
    (and torch's GEMM its weight) before the GEMM runs, so the backward runs dX and the weight gradient
    op, not the forward GEMM again, as for ``F.linear``."""
    layer = Linear(D, 6)
    DataParallelOptimizer(layer, None, OptimizerConfig(max_grad_norm=0.0))
    x = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(SEED), requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=False)
    with OpRecorder() as counted:
        y.backward(torch.ones_like(y))
    assert counted.ops["aten::mm"] == 1  # dX
    assert counted.ops[OP] == 1
