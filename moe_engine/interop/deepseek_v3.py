"""Build engine models from transformers' DeepSeek-V3, weight for weight.
More: docs/interop.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from moe_engine.config import ExpertBackendKind, MLAConfig, ModelConfig, MoEConfig, Precision, RoutingMode, ScoreFunc
from moe_engine.interop.common import (
    Pair,
    converted_model,
    rope_parameters,
    shared_unsupported,
)
from moe_engine.model import Transformer

if TYPE_CHECKING:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

__all__ = ["config_from_transformers", "from_transformers"]

_LATENT_NORM_EPS = 1e-6
"""The epsilon of transformers' ``q_a_layernorm`` and ``kv_a_layernorm`` (its class default)."""


def config_from_transformers(
    hf_config: DeepseekV3Config,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
) -> ModelConfig:
    """The engine config of a DeepSeek-V3 model; raises ValueError for anything the engine would compute differently."""
    problems = shared_unsupported(hf_config)
    if hf_config.rms_norm_eps != _LATENT_NORM_EPS:
        problems.append(
            f"rms_norm_eps={hf_config.rms_norm_eps} (transformers' latent norms use {_LATENT_NORM_EPS}, "
            "the engine one epsilon)"
        )
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        problems.append(f"num_key_value_heads={hf_config.num_key_value_heads} (MLA has one key and value per head)")
    if problems:
        raise ValueError("DeepSeek-V3 config not supported by moe_engine: " + "; ".join(problems))
    # Optional in transformers' annotations, always set in a DeepSeek-V3 config.
    assert hf_config.first_k_dense_replace is not None and hf_config.v_head_dim is not None
    assert hf_config.num_experts_per_tok is not None and hf_config.n_group is not None
    n_dense = min(hf_config.first_k_dense_replace, hf_config.num_hidden_layers)
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_attention_heads,
        seq_len=hf_config.max_position_embeddings,
        n_dense_layers=n_dense,
        dense_hidden=hf_config.intermediate_size if n_dense else 0,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        mla=MLAConfig(
            kv_lora_rank=hf_config.kv_lora_rank,
            q_lora_rank=hf_config.q_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
        ),
        rope_theta=rope_parameters(hf_config)[0],
        norm_eps=hf_config.rms_norm_eps,
        init_std=getattr(hf_config, "initializer_range", 0.02),
        # The configs coerce a string value to its enum (mypy sees only the field types).
        dtype=cast(Precision, dtype),
        moe=MoEConfig(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_hidden=hf_config.moe_intermediate_size,
            shared_expert_hidden=hf_config.n_shared_experts * hf_config.moe_intermediate_size,
            score_func=ScoreFunc.SIGMOID,
            normalize_top_k=bool(hf_config.norm_topk_prob),
            n_groups=hf_config.n_group,
            top_groups=hf_config.topk_group,
            routed_scaling_factor=hf_config.routed_scaling_factor,
            routing=RoutingMode.LEARNED,
            aux_loss_weight=0.0,
            z_loss_weight=0.0,
            backend=cast(ExpertBackendKind, backend),
        ),
    )


def _halves_from_pairs(rows: int, rope_dim: int, rope_start: int, period: int):
    """A transform reordering the RoPE rows of a weight (in blocks of ``period`` rows, RoPE rows at
    [rope_start, rope_start + rope_dim) of each) from interleaved pairs to halves: evens, then odds."""
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    index = torch.arange(rows).view(-1, period)
    index[:, rope_start : rope_start + rope_dim] = index[:, rope_start : rope_start + rope_dim][:, order]

    def transform(weight: torch.Tensor) -> torch.Tensor:
        return weight.index_select(0, index.flatten().to(weight.device))

    return transform


def _model_pairs(config: ModelConfig, interleaved: bool) -> Iterator[Pair]:
    mla, heads = config.mla, config.n_heads
    assert mla is not None  # config_from_transformers always sets it
    rope_dim, qk = mla.qk_rope_head_dim, mla.qk_head_dim
    q_rows = (_halves_from_pairs(heads * qk, rope_dim, mla.qk_nope_head_dim, qk),) if interleaved else ()
    kv_rows = mla.kv_lora_rank + rope_dim
    kv_a = (_halves_from_pairs(kv_rows, rope_dim, mla.kv_lora_rank, kv_rows),) if interleaved else ()
    yield "embed.weight", "model.embed_tokens.weight"
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        yield f"{ours}.attn_norm.weight", f"{theirs}.input_layernorm.weight"
        yield f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"
        attn, their_attn = f"{ours}.attn", f"{theirs}.self_attn"
        if mla.q_lora_rank is None:
            yield (f"{attn}.q_proj.weight", f"{their_attn}.q_proj.weight", *q_rows)
        else:
            yield f"{attn}.q_a_proj.weight", f"{their_attn}.q_a_proj.weight"
            yield f"{attn}.q_a_norm.weight", f"{their_attn}.q_a_layernorm.weight"
            yield (f"{attn}.q_b_proj.weight", f"{their_attn}.q_b_proj.weight", *q_rows)
        yield (f"{attn}.kv_a_proj.weight", f"{their_attn}.kv_a_proj_with_mqa.weight", *kv_a)
        yield f"{attn}.kv_a_norm.weight", f"{their_attn}.kv_a_layernorm.weight"
        yield f"{attn}.kv_b_proj.weight", f"{their_attn}.kv_b_proj.weight"
        yield f"{attn}.o_proj.weight", f"{their_attn}.o_proj.weight"
        if config.is_moe_layer(i):
            yield f"{ours}.ffn.router.weight", f"{theirs}.mlp.gate.weight"
            yield f"{ours}.ffn.router.expert_bias", f"{theirs}.mlp.gate.e_score_correction_bias"
            yield f"{ours}.ffn.experts.gate_up", f"{theirs}.mlp.experts.gate_up_proj"
            yield f"{ours}.ffn.experts.down", f"{theirs}.mlp.experts.down_proj"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{ours}.ffn.shared_expert.{proj}.weight", f"{theirs}.mlp.shared_experts.{proj}.weight"
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{ours}.ffn.{proj}.weight", f"{theirs}.mlp.{proj}.weight"
    yield "norm.weight", "model.norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def from_transformers(
    hf_model: DeepseekV3ForCausalLM,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
    device: torch.device | str | None = None,
) -> Transformer:
    """An engine model with the weights of a ``DeepseekV3ForCausalLM`` (on its device unless told otherwise)."""
    config = config_from_transformers(hf_model.config, dtype=dtype, backend=backend)
    # The selection biases are buffers on both sides.
    their_biases = {n: b for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias")}
    biases = [f"blocks.{i}.ffn.router.expert_bias" for i in range(config.n_layers) if config.is_moe_layer(i)]
    pairs = _model_pairs(config, bool(getattr(hf_model.config, "rope_interleave", False)))
    return converted_model(hf_model, config, pairs, device, their_biases, biases)
