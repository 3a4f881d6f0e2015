"""The engine against transformers' OLMoE: same weights must give the same outputs and gradients (fp32)."""

import re

import pytest

pytest.importorskip("transformers")

import torch
from tolerances import moe_layer_tolerance
from transformers import OlmoeConfig, OlmoeForCausalLM

from moe_engine.config import Precision
from moe_engine.interop import olmoe
from moe_engine.interop.olmoe import (
    config_from_transformers,
    from_transformers,
    moe_layer_from_transformers,
)

INIT_STD = 0.05


def tiny_config(**overrides) -> OlmoeConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=INIT_STD,
        router_aux_loss_coef=0.02,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    fields.update(overrides)
    return OlmoeConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> OlmoeForCausalLM:
    """A randomly initialised model whose norm weights are perturbed too, so a swapped norm shows."""
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    for layer in model.model.layers:
        # transformers creates the router as zeros and relies on its init to randomise it.
        router = layer.mlp.gate.weight
        assert 0.5 * INIT_STD < router.std().item() < 2 * INIT_STD
    return model


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("experts_impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("backend", ["loop", "torch"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_layer_matches_block(norm_topk_prob, backend, experts_impl):
    block = tiny_model(norm_topk_prob=norm_topk_prob, experts_implementation=experts_impl).model.layers[1].mlp
    layer = moe_layer_from_transformers(block, backend=backend, aux_loss_weight=0.0)
    assert layer.config.normalize_top_k is norm_topk_prob and layer.config.top_k == 2
    assert layer.router.weight.dtype == torch.float32

    torch.manual_seed(1)
    x_ref = torch.randn(2, 16, 64, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_(True)
    grad_out = torch.randn(2, 16, 64)

    y_ref, y = block(x_ref), layer(x)
    # The fp32 layer's rounding: 32 tokens, d_model 64, expert hidden 32.
    assert rel_err(y, y_ref) <= moe_layer_tolerance(32, 64, 32, gradients=False)

    theirs = [x_ref, block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight]
    ours = [x, layer.experts.gate_up, layer.experts.down, layer.router.weight]
    grads_ref = torch.autograd.grad(y_ref, theirs, grad_out)
    grads = torch.autograd.grad(y, ours, grad_out)
    for name, g, g_ref in zip(["input", "gate_up", "down", "router"], grads, grads_ref):
        assert rel_err(g, g_ref) <= moe_layer_tolerance(32, 64, 32), name


def test_moe_layer_takes_loss_weights_and_copies():
    block = tiny_model().model.layers[0].mlp
    layer = moe_layer_from_transformers(block)
    assert layer.config.aux_loss_weight == 0.02 and layer.config.z_loss_weight == 0.0
    assert layer.config.backend.value == "torch"
    assert layer.experts.gate_up.data_ptr() != block.experts.gate_up_proj.data_ptr()
    assert layer.router.weight.data_ptr() != block.gate.weight.data_ptr()


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_model_logits_match(kv_heads, norm_topk_prob, attn_impl):
    hf_model = tiny_model(num_key_value_heads=kv_heads, norm_topk_prob=norm_topk_prob, attn_implementation=attn_impl)
    model = from_transformers(hf_model).eval()
    assert model.config.qk_norm and model.config.dtype is Precision.FP32
    assert model.config.rope_theta == 5000.0 and model.config.n_kv_heads == kv_heads

    torch.manual_seed(2)
    tokens = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        expected = hf_model(tokens, use_cache=False).logits
        actual = model(tokens)
    assert actual.shape == expected.shape
    assert rel_err(actual, expected) <= 1e-4


def test_bf16_keeps_router_fp32():
    model = from_transformers(tiny_model(), dtype="bf16", backend="loop")
    for name, param in model.named_parameters():
        expected = torch.float32 if ".router." in name else torch.bfloat16
        assert param.dtype == expected, name


def test_every_parameter_must_be_assigned(monkeypatch):
    pairs = olmoe._model_pairs
    monkeypatch.setattr(olmoe, "_model_pairs", lambda m: (p for p in pairs(m) if p[0] != "lm_head.weight"))
    with pytest.raises(RuntimeError, match=re.escape("not assigned: lm_head.weight")):
        from_transformers(tiny_model())


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(clip_qkv=8.0), "clip_qkv"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope type 'linear'"),
        (dict(head_dim=8), "head_dim=8"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
)
def test_unsupported_config_is_rejected(overrides, reason):
    with pytest.raises(ValueError, match=reason):
        config_from_transformers(tiny_config(**overrides))


def test_config_mapping():
    config = config_from_transformers(tiny_config(norm_topk_prob=True, rms_norm_eps=1e-6))
    assert (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 2, 4, 2)
    assert (config.vocab_size, config.seq_len, config.norm_eps, config.rope_theta) == (128, 64, 1e-6, 5000.0)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden, moe.normalize_top_k) == (8, 2, 32, True)
    assert (moe.aux_loss_weight, moe.z_loss_weight) == (0.02, 0.0)
