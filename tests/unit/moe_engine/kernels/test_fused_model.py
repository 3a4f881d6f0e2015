"""A model with ``fused_kernels`` on computes the same loss and gradients as the same model unfused, in
fp32, within the model's error-analysis tolerance (tests/support/tolerances.py), on the run's device. On a CPU
the fused ops take their reference path, on CUDA their Triton kernels (the Triton kernels in a model on
a CPU: test_triton_interpreter.py)."""

import dataclasses

import pytest
import torch
from fused_cases import MODEL_CONFIG, SEED, model_batch
from tolerances import assert_close_to_scale, model_tolerance

from moe_engine import ModelConfig, build_model
from moe_engine.config import MLAConfig

GQA = ModelConfig(**MODEL_CONFIG)
MLA_TIED = dataclasses.replace(
    GQA,
    head_dim=None,
    qk_norm=False,
    n_kv_heads=4,
    tie_embeddings=True,
    n_layers=4,
    moe_every=2,
    mla=MLAConfig(kv_lora_rank=24, q_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=12),
)


def loss_and_grads(config: ModelConfig, device, fused: bool):
    model = build_model(dataclasses.replace(config, fused_kernels=fused), device, seed=7)
    tokens, labels = (t.to(device) for t in model_batch(vocab=config.vocab_size))
    loss = model.loss(tokens, labels)
    loss.backward()
    return model, loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("config", [GQA, MLA_TIED], ids=["gqa-qknorm-untied", "mla-tied-moe-every-2"])
def test_fused_model_equals_unfused_model(config, device):
    fused_model, fused_loss, fused_grads = loss_and_grads(config, device, fused=True)
    _, loss, grads = loss_and_grads(config, device, fused=False)
    expected = "triton" if device.type == "cuda" else "reference"
    assert {p.implementation for p in fused_model.fused_kernel_paths().values()} == {expected}

    tokens = model_batch()[0].numel()
    assert_close_to_scale(fused_loss, loss, model_tolerance(config, tokens, gradients=False), msg=f"loss, seed {SEED}")
    tol = model_tolerance(config, tokens)
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert fused_grads[name] is not None, name
        assert_close_to_scale(fused_grads[name], grad, tol, msg=f"{name}, seed {SEED}")


def test_switch_is_on_by_default_and_off_says_so(device):
    assert ModelConfig().fused_kernels is True
    model = build_model(dataclasses.replace(GQA, fused_kernels=False), device)
    assert not any(getattr(m, "fused_kernels", False) for m in model.modules())
    assert all(p.details == "reference: fused_kernels is off" for p in model.fused_kernel_paths().values())


def test_switch_reaches_every_fused_module(device):
    model = build_model(GQA, device)
    switched = {type(m).__name__ for m in model.modules() if getattr(m, "fused_kernels", False)}
    fused_modules = {"Transformer", "Block", "RMSNorm", "SwiGLU", "GroupedExperts", "RotaryEmbedding", "Router"}
    assert switched == fused_modules | {"MoELayer"}
    assert all(layer.experts.backend.fused_swiglu and layer.dispatcher.fused_kernels for layer in model.moe_layers())
    # The other setting is another model, built from its config, with the same weights.
    off = build_model(dataclasses.replace(GQA, fused_kernels=False), device, seed=1)
    off.load_state_dict(model.state_dict())
    assert not any(getattr(m, "fused_kernels", False) for m in off.modules())
    assert not any(layer.experts.backend.fused_swiglu or layer.dispatcher.fused_kernels for layer in off.moe_layers())


def test_config_round_trip_keeps_the_switch():
    config = ModelConfig(**MODEL_CONFIG)
    assert ModelConfig.from_dict(config.to_dict()).fused_kernels is True


@pytest.mark.parametrize("fused", [False, True])
def test_forward_with_labels_is_the_loss_and_fused_runs_through_the_module(fused, device):
    """``model(tokens, labels)`` is ``model.loss``; with fused kernels ``loss`` calls the module itself, so
    what hooks the model (FSDP's unshard, a tracer's module scopes) sees the fused loss run."""
    model = build_model(dataclasses.replace(GQA, fused_kernels=fused), device, seed=7)
    tokens, labels = (t.to(device) for t in model_batch())
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    loss = model.loss(tokens, labels)
    assert calls == [torch.Size([])] if fused else calls == [torch.Size([2, 16, GQA.vocab_size])]
    assert torch.equal(model(tokens, labels), loss)
