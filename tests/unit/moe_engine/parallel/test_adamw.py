"""The optimizers' AdamW (torch's foreach one) updates fp32 masters bit for bit as the per-parameter
loop (``foreach=False``, torch's default on a CPU) does, over several steps. Small gradients and two
learning rates: torch's fused AdamW fails this on a CPU (one last-bit difference)."""

from __future__ import annotations

import pytest
import torch

from moe_engine.config import OptimizerConfig
from moe_engine.parallel.data_parallel import DataParallelOptimizer
from moe_engine.train import MasterWeightAdamW, adamw_param_groups

SEED = 20261205
STEPS = 4
CONFIGS = [
    OptimizerConfig(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.0) for lr in (1e-3, 3e-3)
]


class _Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(24, 16).to(dtype))
        self.e = torch.nn.Parameter(torch.randn(3, 8, 16).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(16).to(dtype))


def _grads(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + step)
    return [(1e-3 * torch.randn(p.shape, generator=g)).to(p.dtype) for p in model.parameters()]


def _reference(dtype: torch.dtype, config: OptimizerConfig) -> list[torch.Tensor]:
    """Today's eager update: AdamW's per-parameter loop over fp32 masters."""
    torch.manual_seed(SEED)
    model = _Model(dtype)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(
        adamw_param_groups(masters, config), lr=config.lr, betas=config.betas, eps=config.eps, foreach=False
    )
    for step in range(STEPS):
        for master, grad in zip(masters, _grads(model, step)):
            master.grad = grad.float()
        opt.step()
    return [m.detach() for m in masters]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_master_weight_adamw_is_the_loop_bit_for_bit(dtype, config):
    torch.manual_seed(SEED)
    model = _Model(dtype)
    opt = MasterWeightAdamW(model.parameters(), config)
    assert opt.inner.defaults["foreach"]
    for step in range(STEPS):
        for p, grad in zip(model.parameters(), _grads(model, step)):
            p.grad = grad
        opt.step()
    for master, param, want in zip(opt.masters, model.parameters(), _reference(dtype, config)):
        assert torch.equal(master, want)
        assert torch.equal(param, want.to(dtype))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_data_parallel_optimizer_is_the_loop_bit_for_bit(dtype, config):
    """One process (no groups), small buckets: the per-bucket fused steps over the fp32 gradient buffer."""
    torch.manual_seed(SEED)
    model = _Model(dtype)
    opt = DataParallelOptimizer(model, None, config, bucket_elements=200)
    assert len(opt.buckets) > 1
    for step in range(STEPS):
        opt.zero_grad()
        for p, grad in zip(model.parameters(), _grads(model, step)):
            opt.grad_view(p).copy_(grad)
        opt.step()
    for param, want in zip(model.parameters(), _reference(dtype, config)):
        assert torch.equal(param, want.to(dtype))
