"""The engine against transformers' Mixtral: same weights, same logits and gradients (fp32)."""

import pytest

pytest.importorskip("transformers")

import torch
from interop_checks import assert_same_function, perturb_norms
from transformers import MixtralConfig, MixtralForCausalLM

from moe_engine.interop import mixtral
from moe_engine.interop.mixtral import config_from_transformers, from_transformers


def tiny_config(**overrides) -> MixtralConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.05,
        router_aux_loss_coef=0.02,
        rms_norm_eps=1e-5,
        eos_token_id=None,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    fields.update(overrides)
    return MixtralConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    model = MixtralForCausalLM(tiny_config(**overrides)).eval()
    perturb_norms(model)
    return model


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "overrides", [{}, {"head_dim": 12}, {"tie_word_embeddings": True}], ids=["plain", "head-dim-12", "tied"]
)
def test_model_matches_logits_and_gradients(overrides, attn_impl):
    hf_model = tiny_model(attn_implementation=attn_impl, **overrides)
    model = from_transformers(hf_model)
    config = model.config
    assert config.moe.normalize_top_k and config.rope_theta == 1e6
    assert config.head_dim == overrides.get("head_dim", 16)
    assert config.tie_embeddings is bool(overrides.get("tie_word_embeddings"))
    assert_same_function(hf_model, model, list(mixtral._model_pairs(config)), vocab=128)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(sliding_window=8), "sliding_window=8"),
        (dict(router_jitter_noise=0.1), "router_jitter_noise"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope type 'linear'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
)
def test_unsupported_config_is_rejected(overrides, reason):
    with pytest.raises(ValueError, match=reason):
        config_from_transformers(tiny_config(**overrides))
