"""The engine against transformers' Qwen3-MoE: same weights, same logits and gradients (fp32), with
its head width (not hidden_size / heads), per-head QK-norm, interleaved dense blocks and tied
embeddings."""

import pytest

pytest.importorskip("transformers")

import torch
from interop_checks import assert_same_function, perturb_norms
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_engine.interop import qwen3_moe
from moe_engine.interop.qwen3_moe import config_from_transformers, from_transformers


def tiny_config(**overrides) -> Qwen3MoeConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=48,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.05,
        router_aux_loss_coef=0.001,
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        eos_token_id=None,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**overrides)).eval()
    perturb_norms(model)
    return model


CASES = {
    "all-moe": {},
    "sparse-step-2-tied": {"decoder_sparse_step": 2, "tie_word_embeddings": True, "norm_topk_prob": False},
    "leading-dense": {"mlp_only_layers": [0, 1]},
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_logits_and_gradients(case, attn_impl):
    hf_model = tiny_model(attn_implementation=attn_impl, **CASES[case])
    model = from_transformers(hf_model)
    config = model.config
    assert config.head_dim == 24 and config.qk_norm and config.qk_norm_per_head
    expected_moe = {"all-moe": [0, 1, 2, 3], "sparse-step-2-tied": [1, 3], "leading-dense": [2, 3]}[case]
    assert config.moe_layer_indices == expected_moe
    assert config.tie_embeddings is (case == "sparse-step-2-tied")
    assert_same_function(hf_model, model, list(qwen3_moe._model_pairs(config)), vocab=128)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(mlp_only_layers=[1]), r"MoE blocks at \[0, 2, 3\]"),
        (dict(use_sliding_window=True, sliding_window=8), "sliding"),
        (dict(attention_bias=True), "attention_bias"),
        (
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e6,
                    "original_max_position_embeddings": 16,
                }
            ),
            "rope type 'yarn'",
        ),
    ],
)
def test_unsupported_config_is_rejected(overrides, reason):
    with pytest.raises(ValueError, match=reason):
        config_from_transformers(tiny_config(**overrides))
