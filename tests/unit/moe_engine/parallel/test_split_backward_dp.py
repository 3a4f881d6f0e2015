"""The zero-bubble split backward under the data-parallel optimizer's gradient buffers: torch's
``stage_backward_weight`` adds the weights' gradients to ``.grad`` past autograd's accumulator (no
hooks fire), and the optimizer still finds every one of them, in fp32 buffers for bf16 weights too."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from moe_engine.config import ExpertBackendKind, OptimizerConfig
from moe_engine.moe.expert_backend import defer_weight_grads
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups
from moe_engine.parallel.data_parallel import DataParallelOptimizer

SEED = 20261205
D, F, COUNTS = 16, 8, [6, 0, 9, 5]


class _Stage(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(D).to(dtype))
        self.experts = GroupedExperts(D, F, len(COUNTS), ExpertBackendKind.TORCH).to(dtype)
        for p in self.experts.parameters():
            torch.nn.init.normal_(p, std=0.5)

    def forward(self, x_ND, groups):
        return self.experts(x_ND * self.scale, groups)


def _setup(dtype):
    torch.manual_seed(SEED)
    model = _Stage(dtype)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.0), bucket_elements=300)
    x_ND = torch.randn(sum(COUNTS), D).to(dtype)
    grad_y_ND = torch.randn(sum(COUNTS), D).to(dtype)
    return model, opt, x_ND, grad_y_ND, ExpertGroups.from_counts(torch.tensor(COUNTS))


def _buffers(model, opt):
    return {name: opt.grad_view(p).clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", ["stage-backward", "deferred"])
def test_split_backward_fills_the_buffers_as_a_plain_backward(dtype, split):
    model, opt, x_ND, grad_y_ND, groups = _setup(dtype)
    opt.zero_grad()
    model(x_ND.clone().requires_grad_(), groups).backward(grad_y_ND)
    opt.finish_grad_sync()
    want = _buffers(model, opt)

    model, opt, x_ND, grad_y_ND, groups = _setup(dtype)
    opt.zero_grad()
    x = x_ND.clone().requires_grad_()
    if split == "stage-backward":
        y = model(x, groups)
        _, param_groups = stage_backward_input([y], [grad_y_ND], [x], model.parameters())
        stage_backward_weight(model.parameters(), param_groups)
    else:
        with defer_weight_grads() as deferred:
            y = model(x, groups)
        y.backward(grad_y_ND)
        deferred.run_all()
    opt.finish_grad_sync()
    got = _buffers(model, opt)
    for name, grad in want.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(got[name], grad), name
