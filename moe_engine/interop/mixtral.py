"""Build engine models from transformers' Mixtral, weight for weight.
More: docs/interop.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from moe_engine.config import ExpertBackendKind, ModelConfig, MoEConfig, Precision, RoutingMode, ScoreFunc
from moe_engine.interop.common import (
    converted_model,
    rope_parameters,
    shared_unsupported,
)
from moe_engine.model import Transformer

if TYPE_CHECKING:
    from transformers import MixtralConfig, MixtralForCausalLM

__all__ = ["config_from_transformers", "from_transformers"]


def config_from_transformers(
    hf_config: MixtralConfig,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
) -> ModelConfig:
    """The engine config of a Mixtral model; raises ValueError for anything the engine would compute differently."""
    problems = shared_unsupported(hf_config)
    if getattr(hf_config, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={hf_config.router_jitter_noise} (no router input noise)")
    if problems:
        raise ValueError("Mixtral config not supported by moe_engine: " + "; ".join(problems))
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None),
        seq_len=hf_config.max_position_embeddings,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_theta=rope_parameters(hf_config)[0],
        norm_eps=hf_config.rms_norm_eps,
        init_std=getattr(hf_config, "initializer_range", 0.02),
        # The configs coerce a string value to its enum (mypy sees only the field types).
        dtype=cast(Precision, dtype),
        moe=MoEConfig(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_hidden=hf_config.intermediate_size,
            score_func=ScoreFunc.SOFTMAX,
            normalize_top_k=True,  # Mixtral always renormalises its top-k weights
            routing=RoutingMode.LEARNED,
            aux_loss_weight=hf_config.router_aux_loss_coef,
            z_loss_weight=0.0,
            backend=cast(ExpertBackendKind, backend),
        ),
    )


def _model_pairs(config: ModelConfig) -> Iterator[tuple[str, str]]:
    yield "embed.weight", "model.embed_tokens.weight"
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        yield f"{ours}.attn_norm.weight", f"{theirs}.input_layernorm.weight"
        yield f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{ours}.attn.{proj}.weight", f"{theirs}.self_attn.{proj}.weight"
        yield f"{ours}.ffn.router.weight", f"{theirs}.mlp.gate.weight"
        yield f"{ours}.ffn.experts.gate_up", f"{theirs}.mlp.experts.gate_up_proj"
        yield f"{ours}.ffn.experts.down", f"{theirs}.mlp.experts.down_proj"
    yield "norm.weight", "model.norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def from_transformers(
    hf_model: MixtralForCausalLM,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
    device: torch.device | str | None = None,
) -> Transformer:
    """An engine model with the weights of a ``MixtralForCausalLM`` (on its device unless told otherwise)."""
    config = config_from_transformers(hf_model.config, dtype=dtype, backend=backend)
    return converted_model(hf_model, config, _model_pairs(config), device)
