"""CUDA paths: the grouped-GEMM backend and a training step on the GPU (skipped without one)."""

import pytest
import torch

from moe_engine import ModelConfig, build_model
from moe_engine.config import ExpertBackendKind, MoEConfig, Precision
from moe_engine.host_sync import forbid_host_sync
from moe_engine.model import cast_parameters
from moe_engine.moe.layer import MoELayer
from moe_engine.train import Trainer

pytestmark = pytest.mark.cuda


def _layer(backend, seed=0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(256, MoEConfig(num_experts=16, top_k=4, expert_hidden=128, routing="balanced", backend=backend))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_backend_on_cuda_matches_cpu_reference(dtype):
    reference = _layer(ExpertBackendKind.LOOP)
    layer = _layer(ExpertBackendKind.TORCH)
    if dtype == torch.bfloat16:
        cast_parameters(layer, Precision.BF16)
    layer = layer.cuda()
    x = torch.randn(1024, 256)
    grad = torch.randn(1024, 256)

    x_ref = x.clone().requires_grad_()
    # Balanced routing is deterministic, so both devices route identically.
    (reference(x_ref) * grad).sum().backward()

    x_gpu = x.cuda().to(dtype).requires_grad_()
    with forbid_host_sync():
        y = layer(x_gpu)
        (y * grad.cuda().to(dtype)).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    y_ref = reference(x).detach()
    assert ((y.float().cpu() - y_ref).abs().max() / y_ref.abs().max()) < tol
    for (name, p), p_ref in zip(layer.named_parameters(), reference.parameters()):
        err = (p.grad.float().cpu() - p_ref.grad).abs().max() / p_ref.grad.abs().max()
        assert err < tol, name


def test_training_step_on_cuda_learns_without_host_sync():
    config = ModelConfig(
        vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, dtype="bf16",
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=128),
    )
    model = build_model(config, device="cuda")
    trainer = Trainer(model)
    tokens = torch.randint(0, 256, (4, 64), device="cuda")
    losses = []
    for step in range(30):
        if step == 5:
            with forbid_host_sync():
                losses.append(model.loss(tokens, tokens.roll(-1, 1)))
        losses.append(trainer.step(tokens, tokens.roll(-1, 1)))
    values = torch.stack(losses).float().cpu()
    assert torch.isfinite(values).all()
    assert values[-1] < 0.7 * values[0]
