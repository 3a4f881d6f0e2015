"""Build engine layers and models from transformers' OLMoE, weight for weight.
More: docs/interop.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from moe_engine.config import ExpertBackendKind, ModelConfig, MoEConfig, Precision, RoutingMode, ScoreFunc
from moe_engine.interop.common import copy_weights, rope_parameters
from moe_engine.model import Transformer, cast_parameters
from moe_engine.moe.layer import MoELayer

if TYPE_CHECKING:
    from transformers import OlmoeConfig, OlmoeForCausalLM
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

__all__ = ["config_from_transformers", "from_transformers", "moe_layer_from_transformers"]


def _unsupported(hf_config: Any) -> list[str]:
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None)
    clip_qkv = getattr(hf_config, "clip_qkv", None)
    rope_type = rope_parameters(hf_config)[1]
    checks = [
        (clip_qkv is not None, f"clip_qkv={clip_qkv} (no q/k/v clipping)"),
        (getattr(hf_config, "tie_word_embeddings", False), "tie_word_embeddings=True (lm_head is a separate weight)"),
        (getattr(hf_config, "attention_bias", False), "attention_bias=True (projections have no bias)"),
        (getattr(hf_config, "attention_dropout", 0.0) != 0, "attention_dropout != 0 (no dropout)"),
        (rope_type != "default", f"rope type {rope_type!r} (only the default RoPE)"),
        (
            head_dim is not None and head_dim * heads != hf_config.hidden_size,
            f"head_dim={head_dim} (must be hidden_size / num_attention_heads)",
        ),
        (hf_config.hidden_act != "silu", f"hidden_act={hf_config.hidden_act!r} (experts are SwiGLU)"),
    ]
    return [reason for bad, reason in checks if bad]


def config_from_transformers(
    hf_config: OlmoeConfig,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
) -> ModelConfig:
    """The engine config of an OLMoE model; raises ValueError for anything the engine would compute differently."""
    problems = _unsupported(hf_config)
    if problems:
        raise ValueError("OLMoE config not supported by moe_engine: " + "; ".join(problems))
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=kv_heads,
        seq_len=hf_config.max_position_embeddings,
        qk_norm=True,  # OLMoE always has q_norm/k_norm
        rope_theta=rope_parameters(hf_config)[0],
        norm_eps=hf_config.rms_norm_eps,
        init_std=getattr(hf_config, "initializer_range", 0.02),
        # The configs coerce a string value to its enum (mypy sees only the field types).
        dtype=cast(Precision, dtype),
        moe=MoEConfig(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_hidden=hf_config.intermediate_size,
            score_func=ScoreFunc.SOFTMAX,
            normalize_top_k=bool(hf_config.norm_topk_prob),
            routing=RoutingMode.LEARNED,
            aux_loss_weight=hf_config.router_aux_loss_coef,
            z_loss_weight=0.0,  # transformers' OLMoE has no router z-loss
            backend=cast(ExpertBackendKind, backend),
        ),
    )


def _block_config(block: OlmoeSparseMoeBlock) -> Any:
    for owner in (block, block.experts, block.gate):
        config = getattr(owner, "config", None)
        if config is not None:
            return config
    return None


def moe_layer_from_transformers(
    block: OlmoeSparseMoeBlock,
    *,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
    aux_loss_weight: float | None = None,
    z_loss_weight: float = 0.0,
    layer_idx: int = 0,
) -> MoELayer:
    """An engine MoE layer computing the same function as an ``OlmoeSparseMoeBlock``.

    The aux weight defaults to the block's ``router_aux_loss_coef`` where the block still reaches its
    config. Pass ``aux_loss_weight=0`` to compare gradients: the engine feeds its router loss into
    the backward pass, transformers' block does not.
    """
    num_experts, d_model = block.gate.weight.shape
    config = _block_config(block)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} not supported: the engine's experts are SwiGLU")
    if aux_loss_weight is None:
        aux_loss_weight = config.router_aux_loss_coef if config is not None else MoEConfig.aux_loss_weight
    moe_config = MoEConfig(
        num_experts=num_experts,
        top_k=block.gate.top_k,
        expert_hidden=block.experts.down_proj.shape[-1],
        score_func=ScoreFunc.SOFTMAX,
        normalize_top_k=bool(block.gate.norm_topk_prob),
        routing=RoutingMode.LEARNED,
        aux_loss_weight=aux_loss_weight,
        z_loss_weight=z_loss_weight,
        backend=cast(ExpertBackendKind, backend),  # MoEConfig coerces a string value
    )
    with torch.device(block.gate.weight.device):
        layer = MoELayer(d_model, moe_config, layer_idx)
    # The expert layouts already agree. The router stays fp32 (engine convention), the experts keep
    # the block's dtype.
    for target, source, dtype in (
        (layer.router.weight, block.gate.weight, torch.float32),
        (layer.experts.gate_up, block.experts.gate_up_proj, block.experts.gate_up_proj.dtype),
        (layer.experts.down, block.experts.down_proj, block.experts.down_proj.dtype),
    ):
        target.data = source.detach().to(dtype=dtype, copy=True)
    return layer


def _model_pairs(hf_model: OlmoeForCausalLM) -> Iterator[tuple[str, str]]:
    """(engine parameter name, transformers parameter name) for every weight."""
    yield "embed.weight", "model.embed_tokens.weight"
    for i in range(hf_model.config.num_hidden_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        yield f"{ours}.attn_norm.weight", f"{theirs}.input_layernorm.weight"
        yield f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            yield f"{ours}.attn.{proj}.weight", f"{theirs}.self_attn.{proj}.weight"
        yield f"{ours}.ffn.router.weight", f"{theirs}.mlp.gate.weight"
        yield f"{ours}.ffn.experts.gate_up", f"{theirs}.mlp.experts.gate_up_proj"
        yield f"{ours}.ffn.experts.down", f"{theirs}.mlp.experts.down_proj"
    yield "norm.weight", "model.norm.weight"
    yield "lm_head.weight", "lm_head.weight"


def from_transformers(
    hf_model: OlmoeForCausalLM,
    *,
    dtype: Precision | str = Precision.FP32,
    backend: ExpertBackendKind | str = ExpertBackendKind.TORCH,
    device: torch.device | str | None = None,
) -> Transformer:
    """An engine model with the weights of an ``OlmoeForCausalLM`` (on its device unless told otherwise).

    Every parameter on both sides must be used exactly once (``interop.common.copy_weights``).
    """
    config = config_from_transformers(hf_model.config, dtype=dtype, backend=backend)
    theirs = dict(hf_model.named_parameters(remove_duplicate=False))
    if device is None:
        device = next(iter(theirs.values())).device
    with torch.device(device):
        model = Transformer(config)
    copy_weights(model, theirs, _model_pairs(hf_model))
    return cast_parameters(model, config.dtype)
