"""The engine against transformers' DeepSeek-V3: same weights, same logits and gradients (fp32), with
multi-head latent attention (with and without the query latent, interleaved and plain RoPE layouts),
leading dense blocks, a shared expert and group-limited sigmoid routing with its selection bias and
scaling factor."""

import pytest

pytest.importorskip("transformers")

import torch
from interop_checks import assert_same_function, perturb_norms, rel_err
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from moe_engine.interop import deepseek_v3
from moe_engine.interop.deepseek_v3 import config_from_transformers, from_transformers


def tiny_config(**overrides) -> DeepseekV3Config:
    fields = dict(
        hidden_size=64,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.05,
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        eos_token_id=None,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def tiny_model(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_config(**overrides)).eval()
    perturb_norms(model)
    with torch.no_grad():
        # A selection bias that moves the choice (zero after transformers' initialisation).
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


CASES = {
    "q-latent-interleaved": {},
    "no-q-latent-interleaved": {"q_lora_rank": None},
    "q-latent-halves": {"rope_interleave": False},
    "no-groups-tied": {"n_group": 1, "topk_group": 1, "tie_word_embeddings": True, "norm_topk_prob": False},
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_logits_and_gradients(case, attn_impl):
    hf_model = tiny_model(attn_implementation=attn_impl, **CASES[case])
    model = from_transformers(hf_model)
    config = model.config
    assert config.moe_layer_indices == [1, 2] and config.dense_hidden == 48
    assert config.mla.q_lora_rank == CASES[case].get("q_lora_rank", 32)
    assert config.moe.shared_expert_hidden == 2 * 16 and config.moe.routed_scaling_factor == 2.5
    assert config.moe.group_limited is (case != "no-groups-tied")
    bias = model.blocks[1].ffn.router.expert_bias
    assert torch.equal(bias, hf_model.model.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    interleaved = bool(hf_model.config.rope_interleave)
    assert_same_function(hf_model, model, list(deepseek_v3._model_pairs(config, interleaved)), vocab=128)


def test_the_rope_reordering_is_needed():
    """Copied as they are, the interleaved RoPE rows give other logits: the reordering is what the
    test above checks, not a no-op."""
    hf_model = tiny_model()
    model = from_transformers(hf_model)
    tokens = torch.arange(16)[None]
    reference = hf_model(tokens, use_cache=False).logits
    # The criterion of assert_same_function's logits: relative to the largest, not entry by entry.
    assert rel_err(model(tokens), reference) <= 1e-4
    with torch.no_grad():
        for i, layer in enumerate(hf_model.model.layers):
            model.blocks[i].attn.q_b_proj.weight.copy_(layer.self_attn.q_b_proj.weight)
            model.blocks[i].attn.kv_a_proj.weight.copy_(layer.self_attn.kv_a_proj_with_mqa.weight)
    assert not torch.allclose(model(tokens), reference, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
        (
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 40.0,
                    "rope_theta": 1e4,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 16,
                    "beta_fast": 32,
                    "beta_slow": 1,
                }
            ),
            "rope type 'yarn'",
        ),
        (dict(num_key_value_heads=2), "num_key_value_heads=2"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_config_is_rejected(overrides, reason):
    with pytest.raises(ValueError, match=reason):
        config_from_transformers(tiny_config(**overrides))
