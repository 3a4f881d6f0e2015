"""CUDA paths: the grouped-GEMM backend and a training step on the GPU (skipped without one)."""

import contextlib

import pytest
import torch

from moe_engine import ModelConfig, build_model
from moe_engine.config import ExpertBackendKind, MoEConfig, Precision
from moe_engine.host_sync import forbid_host_sync, profile_host_syncs
from moe_engine.model import cast_parameters
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.grouped_gemm import GroupedMMPath, grouped_mm_path
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.permute import ExpertGroups
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
    grad_gpu = grad.cuda().to(dtype)  # a host-to-device copy: outside the guard, which refuses one
    # Sync-free only on the CUTLASS path (bf16 on sm9x/sm10x); fp32 takes torch's host loop.
    fast = grouped_mm_path(x_gpu.device, dtype) is GroupedMMPath.CUTLASS
    with forbid_host_sync() if fast else contextlib.nullcontext():
        y = layer(x_gpu)
        (y * grad_gpu).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    y_ref = reference(x).detach()
    assert ((y.float().cpu() - y_ref).abs().max() / y_ref.abs().max()) < tol
    for (name, p), p_ref in zip(layer.named_parameters(), reference.parameters()):
        err = (p.grad.float().cpu() - p_ref.grad).abs().max() / p_ref.grad.abs().max()
        assert err < tol, name


def test_training_step_on_cuda_learns_without_host_sync():
    config = ModelConfig(
        vocab_size=256,
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=64,
        dtype="bf16",
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_and_empty_groups_on_cuda_match_the_cpu_loop(dtype):
    """Uneven rows per expert and experts with no rows: outputs and gradients equal the CPU loop,
    and empty experts' weight gradients are exactly zero."""
    torch.manual_seed(7)
    counts = torch.tensor([37, 0, 1, 90, 0, 0, 17, 111])
    reference = GroupedExperts(128, 64, 8, ExpertBackendKind.LOOP)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.05)
    experts = GroupedExperts(128, 64, 8, ExpertBackendKind.TORCH)
    experts.load_state_dict(reference.state_dict())
    experts = experts.to(device="cuda", dtype=dtype)
    x = torch.randn(int(counts.sum()), 128)
    grad = torch.randn(int(counts.sum()), 128)

    x_ref = x.clone().requires_grad_()
    (reference(x_ref, ExpertGroups.from_counts(counts)) * grad).sum().backward()
    x_gpu = x.cuda().to(dtype).requires_grad_()
    y = experts(x_gpu, ExpertGroups.from_counts(counts.cuda()))
    (y * grad.cuda().to(dtype)).sum().backward()
    syncs = profile_host_syncs(lambda: experts(x_gpu.detach(), ExpertGroups.from_counts(counts.cuda())))
    if grouped_mm_path(x_gpu.device, dtype) is GroupedMMPath.CUTLASS:
        assert syncs == []

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    y_ref = reference(x, ExpertGroups.from_counts(counts)).detach()
    assert (y.float().cpu() - y_ref).abs().max() / y_ref.abs().max() < tol
    assert (x_gpu.grad.float().cpu() - x_ref.grad).abs().max() / x_ref.grad.abs().max() < tol
    for name in ("gate_up", "down"):
        got, want = getattr(experts, name).grad.float().cpu(), getattr(reference, name).grad
        assert (got - want).abs().max() / want.abs().max() < tol, name
        for e in (1, 4, 5):
            assert torch.equal(got[e], torch.zeros_like(got[e])), f"{name}[{e}] of an expert with no rows"
