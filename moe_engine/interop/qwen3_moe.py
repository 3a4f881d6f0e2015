"""Build engine models from transformers' Qwen3-MoE, weight for weight.
More: docs/interop.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from moe_engine.config import ExpertBackendKind, ModelConfig, MoEConfig, Precision, RoutingMode, ScoreFunc
from moe_engine.interop.common import (
    converted_model,
    dense_pattern,
    rope_parameters,
    shared_unsupported,
)
from moe_engine.model import Transformer

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["config_from_transformers", "from_transformers"]


def _moe_blocks(hf_config: Qwen3MoeConfig) -> list[bool]:
    """transformers' rule for which decoder layers hold a sparse MoE block."""
    skipped = set(hf_config.mlp_only_layers or [])
    return [
        i not in skipped and hf_config.num_experts > 0 and (i + 1) % hf_config.decoder_sparse_step == 0
        for i in range(hf_config.num_hidden_layers)
    ]


def config_from_transformers(
    hf_config: Qwen3MoeConfig,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
) -> ModelConfig:
    """The engine config of a Qwen3-MoE model; raises ValueError for anything the engine would compute differently."""
    problems = shared_unsupported(hf_config)
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True (attention is over the whole causal context)")
    pattern = dense_pattern(_moe_blocks(hf_config))
    if pattern is None:
        problems.append(
            f"MoE blocks at {[i for i, m in enumerate(_moe_blocks(hf_config)) if m]} (decoder_sparse_step="
            f"{hf_config.decoder_sparse_step}, mlp_only_layers={hf_config.mlp_only_layers}): the engine places MoE "
            "blocks every n-th block after leading dense ones"
        )
    if problems:
        raise ValueError("Qwen3-MoE config not supported by moe_engine: " + "; ".join(problems))
    assert pattern is not None  # no pattern is one of the problems above
    n_dense, every = pattern
    heads = hf_config.num_attention_heads
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        seq_len=hf_config.max_position_embeddings,
        n_dense_layers=n_dense,
        moe_every=every,
        dense_hidden=hf_config.intermediate_size if n_dense or every > 1 else 0,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qk_norm=True,
        qk_norm_per_head=True,
        rope_theta=rope_parameters(hf_config)[0],
        norm_eps=hf_config.rms_norm_eps,
        init_std=getattr(hf_config, "initializer_range", 0.02),
        # The configs coerce a string value to its enum (mypy sees only the field types).
        dtype=cast(Precision, dtype),
        moe=MoEConfig(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_hidden=hf_config.moe_intermediate_size,
            score_func=ScoreFunc.SOFTMAX,
            normalize_top_k=bool(hf_config.norm_topk_prob),
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
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            yield f"{ours}.attn.{proj}.weight", f"{theirs}.self_attn.{proj}.weight"
        if config.is_moe_layer(i):
            yield f"{ours}.ffn.router.weight", f"{theirs}.mlp.gate.weight"
            yield f"{ours}.ffn.experts.gate_up", f"{theirs}.mlp.experts.gate_up_proj"
            yield f"{ours}.ffn.experts.down", f"{theirs}.mlp.experts.down_proj"
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{ours}.ffn.{proj}.weight", f"{theirs}.mlp.{proj}.weight"
    yield "norm.weight", "model.norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def from_transformers(
    hf_model: Qwen3MoeForCausalLM,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
    device: torch.device | str | None = None,
) -> Transformer:
    """An engine model with the weights of a ``Qwen3MoeForCausalLM`` (on its device unless told otherwise)."""
    config = config_from_transformers(hf_model.config, dtype=dtype, backend=backend)
    return converted_model(hf_model, config, _model_pairs(config), device)
