"""The experts' weight gradients added inside their GEMM (``main_grad``): the data-parallel optimizer's
buffers hold what they hold when every gradient goes through ``.grad`` (bit for bit on the CPU, whose
path is the same product and add), against a float64 per-expert loop too; no expert gradient reaches
``.grad``; ``autograd.grad`` still hands the gradients back and leaves the buffers alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine.config import ExpertBackendKind, GradDtype, OptimizerConfig
from moe_engine.moe import expert_backend
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups
from moe_engine.parallel.data_parallel import DataParallelOptimizer

SEED = 20261206
D, F = 16, 8
MICROBATCH_COUNTS = ([6, 0, 9, 5], [3, 7, 0, 10])
"""Rows per expert in each of the two microbatches (an empty expert in each, a different one)."""
OP = "moe_engine.grouped_wgrad_accumulate.default"


class _Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, backend: ExpertBackendKind, mxfp8_wgrad: bool = False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(D).to(dtype))
        experts = len(MICROBATCH_COUNTS[0])
        self.experts = GroupedExperts(D, F, experts, backend, mxfp8_wgrad=mxfp8_wgrad).to(dtype)
        for p in self.experts.parameters():
            torch.nn.init.normal_(p, std=0.5)

    def forward(self, x_ND, groups):
        return self.experts(x_ND * self.scale, groups)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(dtype):
    generator = torch.Generator().manual_seed(SEED + 1)
    batches = []
    for counts in MICROBATCH_COUNTS:
        rows = sum(counts)
        x_ND = torch.randn(rows, D, generator=generator).to(dtype)
        grad_y_ND = torch.randn(rows, D, generator=generator).to(dtype)
        batches.append((x_ND, grad_y_ND, ExpertGroups.from_counts(torch.tensor(counts))))
    return batches


def _model(dtype, backend, mxfp8_wgrad=False):
    torch.manual_seed(SEED)
    return _Model(dtype, backend, mxfp8_wgrad)


def _train_buffers(dtype, backend, accumulate_in_gemm, mxfp8_wgrad=False):
    """The gradient buffers after two microbatches' backwards, and the ops those backwards ran."""
    model = _model(dtype, backend, mxfp8_wgrad)
    opt = DataParallelOptimizer(
        model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=300, accumulate_in_gemm=accumulate_in_gemm
    )
    opt.zero_grad()
    opt.arm_overlap(len(MICROBATCH_COUNTS))
    counted = _CountOps()
    for x_ND, grad_y_ND, groups in _inputs(dtype):
        y_ND = model(x_ND.clone().requires_grad_(), groups)
        with counted:
            y_ND.backward(grad_y_ND)
    # Every bucket launched in backward: the weights' hooks fire though no gradient reaches .grad.
    assert opt.launched_buckets == len(opt.buckets)
    opt.finish_grad_sync()
    return {name: opt.grad_view(p).clone() for name, p in model.named_parameters()}, counted.names


@pytest.mark.parametrize(
    "backend", [ExpertBackendKind.TORCH, ExpertBackendKind.MXFP8], ids=["torch", "mxfp8-bf16-wgrad"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_gemm_buffers_equal_the_through_grad_buffers(dtype, backend):
    want, want_ops = _train_buffers(dtype, backend, accumulate_in_gemm=False)
    got, got_ops = _train_buffers(dtype, backend, accumulate_in_gemm=True)
    for name, grad in want.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(got[name], grad), name
    # Two weights per experts call, one call per microbatch; none without main_grad.
    assert got_ops.count(OP) == 2 * len(MICROBATCH_COUNTS)
    assert want_ops.count(OP) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_wgrad_adds_into_the_buffers_itself(dtype, monkeypatch):
    """The MXFP8 weight-gradient GEMM adds into the buffers itself (every call gets the weight's buffer,
    none under ``accumulate_in_gemm: false``): the buffers the gradients handed back through ``.grad``
    fill, bit for bit on the CPU, whose emulation rounds the product to bf16 either way; and no bf16
    weight-gradient op runs."""
    buffers_given = []
    real = expert_backend.mx_wgrad.grouped_wgrad

    def spy(a, b, out_EXY=None, **kwargs):
        buffers_given.append(out_EXY is not None)
        return real(a, b, out_EXY, **kwargs)

    monkeypatch.setattr(expert_backend.mx_wgrad, "grouped_wgrad", spy)
    want, want_ops = _train_buffers(dtype, ExpertBackendKind.MXFP8, accumulate_in_gemm=False, mxfp8_wgrad=True)
    assert buffers_given == [False] * 2 * len(MICROBATCH_COUNTS)
    buffers_given.clear()
    got, got_ops = _train_buffers(dtype, ExpertBackendKind.MXFP8, accumulate_in_gemm=True, mxfp8_wgrad=True)
    assert buffers_given == [True] * 2 * len(MICROBATCH_COUNTS)
    assert got_ops.count(OP) == want_ops.count(OP) == 0
    for name, grad in want.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(got[name], grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_gemm_buffers_equal_a_float64_per_expert_loop(dtype):
    got, _ = _train_buffers(dtype, ExpertBackendKind.TORCH, accumulate_in_gemm=True)
    reference = _model(dtype, ExpertBackendKind.TORCH)
    loop = _Model(torch.float64, ExpertBackendKind.LOOP)
    loop.load_state_dict({k: v.double() for k, v in reference.state_dict().items()})
    for x_ND, grad_y_ND, groups in _inputs(dtype):
        loop(x_ND.double(), groups).backward(grad_y_ND.double())
    # bf16: the forward's activations and the gradients round to bf16 (2^-8 relative) on the way.
    rtol = 1e-5 if dtype == torch.float32 else 4e-2
    for name, param in loop.named_parameters():
        want = param.grad.float()
        scale = want.abs().max()
        assert (got[name] - want).abs().max() <= rtol * scale, name


def test_autograd_grad_hands_the_gradients_back_and_leaves_the_buffers():
    dtype, backend = torch.bfloat16, ExpertBackendKind.TORCH
    model = _model(dtype, backend)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=300)
    opt.zero_grad()
    x_ND, grad_y_ND, groups = _inputs(dtype)[0]
    weights = [model.experts.gate_up, model.experts.down]
    grads = torch.autograd.grad(model(x_ND, groups), weights, grad_y_ND)

    plain = _model(dtype, backend)
    want = torch.autograd.grad(plain(x_ND, groups), [plain.experts.gate_up, plain.experts.down], grad_y_ND)
    for got, expected in zip(grads, want):
        assert expected.abs().sum() > 0
        assert torch.equal(got, expected)
    for weight in weights:
        assert not opt.grad_view(weight).any()


def test_only_fp32_buffers_are_added_into():
    """A bf16 buffer (``grad_dtype: param`` for bf16 weights) keeps the two passes: the kernel adds in fp32."""
    model = _model(torch.bfloat16, ExpertBackendKind.TORCH)
    DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), grad_dtype=GradDtype.PARAM)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


def test_remove_hooks_takes_main_grad_away():
    model = _model(torch.bfloat16, ExpertBackendKind.TORCH)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=300)
    assert model.experts.gate_up.main_grad is opt.grad_view(model.experts.gate_up)
    opt.remove_hooks()
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    off = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), accumulate_in_gemm=False)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    off.remove_hooks()
    # A later optimizer without it takes an earlier one's main_grad away too.
    DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0))
    DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), accumulate_in_gemm=False)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
