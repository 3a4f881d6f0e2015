"""The MoE layer's forward and backward never synchronise with the host."""

import pytest
import torch

from moe_engine import ModelConfig, build_model
from moe_engine.config import ExpertBackendKind, MoEConfig, RoutingMode
from moe_engine.host_sync import HostSyncError, forbid_host_sync
from moe_engine.moe.layer import MoELayer


@pytest.mark.parametrize("routing", list(RoutingMode))
def test_moe_layer_has_no_host_sync(routing, device):
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, expert_hidden=32, routing=routing, shared_expert_hidden=16))
    layer = layer.to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(64, 32, device=device, requires_grad=True)
    with forbid_host_sync():
        y = layer(x)
        y.backward(torch.randn_like(y))
    assert x.grad is not None and layer.experts.gate_up.grad is not None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_training_step_has_no_host_sync(dtype, device):
    config = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, n_dense_layers=1,
        dense_hidden=48, qk_norm=True, dtype=dtype,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, routing="random", expert_bias_rate=0.01),
    )
    model = build_model(config, device=device)
    tokens = torch.randint(0, 64, (2, 16), device=device)
    with forbid_host_sync():
        loss = model.loss(tokens, tokens)
        loss.backward()
        for layer in model.moe_layers():
            layer.update_expert_bias()


def test_reference_backend_is_caught(device):
    """The guard is not blind: the loop reference reads counts on the host and must be caught."""
    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=1, expert_hidden=16, backend=ExpertBackendKind.LOOP))
    layer = layer.to(device)
    with pytest.raises(HostSyncError, match="tolist"):
        with forbid_host_sync():
            layer(torch.randn(8, 16, device=device))


@pytest.mark.parametrize(
    "offence, message",
    [
        (lambda t: t.sum().item(), "item"),
        (lambda t: t.tolist(), "tolist"),
        (lambda t: t.cpu(), "cpu"),
        (lambda t: torch.nonzero(t), "nonzero"),
        (lambda t: t.nonzero(), "nonzero"),
        (lambda t: t[t > 0], "boolean-mask"),
        (lambda t: torch.where(t > 0), "where"),
        (lambda t: bool(t.sum() > 0), "__bool__"),
        (lambda t: t.masked_select(t > 0), "masked_select"),
        (lambda t: torch.unique(t), "unique"),
        (lambda t: torch.bincount((t > 0).long()), "bincount"),
        (lambda t: torch.repeat_interleave((t > 0).long()), "repeat_interleave"),
        (lambda t: t.index_put_((t > 0,), torch.tensor(0.0, device=t.device)), "index_put"),
    ],
)
def test_each_syncing_call_is_caught(offence, message, device):
    t = torch.randn(8, device=device)
    with pytest.raises(HostSyncError, match=message):
        with forbid_host_sync():
            offence(t)


def test_shapes_known_on_the_host_are_allowed(device):
    t = torch.tensor([1, 0, 2], device=device)
    with forbid_host_sync():
        torch.arange(3, device=device).repeat_interleave(t, output_size=3)
        torch.zeros(3, device=device).index_put_((t,), torch.ones(3, device=device))


def test_syncs_inside_autograd_backward_are_caught(device):
    class SyncsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad.max().item()
            return grad

    x = torch.randn(4, device=device, requires_grad=True)
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            SyncsInBackward.apply(x).sum().backward()


def test_guard_restores_normal_operation(device):
    with forbid_host_sync():
        pass
    assert torch.ones(2, device=device).sum().item() == 2.0
