"""What every transformers conversion shares: the checks every architecture makes, the MoE block
pattern, reading a config's RoPE, and copying weights one to one.

Each parameter (and named buffer) on both sides must be used exactly once, so a layout change on
either side fails loudly instead of leaving a randomly initialised weight behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "Pair",
    "converted_model",
    "copy_weights",
    "dense_pattern",
    "rope_parameters",
    "shared_unsupported",
    "tied_parameters",
]

Pair = tuple[str, str] | tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]
"""(engine name, transformers name[, transform of the source before the copy])."""


def rope_parameters(hf_config: Any) -> tuple[float, str]:
    """(theta, rope type) from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return float(params["rope_theta"]), params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    return float(hf_config.rope_theta), scaling.get("rope_type", scaling.get("type", "default"))


def copy_weights(
    model: nn.Module, theirs: Mapping[str, torch.Tensor], pairs: Iterable[Pair], buffers: Iterable[str] = ()
) -> None:
    """Copy ``theirs[their_name]`` into each engine tensor named by ``pairs`` (its parameters, and the
    buffers named in ``buffers``); every engine parameter and every tensor of ``theirs`` must be used
    exactly once."""
    ours: dict[str, torch.Tensor] = dict(model.named_parameters())
    our_buffers = dict(model.named_buffers())
    ours.update({name: our_buffers[name] for name in buffers})
    assigned: set[str] = set()
    used: set[str] = set()
    with torch.no_grad():
        for our_name, their_name, *transform in pairs:
            if our_name in assigned or their_name in used:
                raise RuntimeError(f"{our_name} <- {their_name}: assigned twice")
            if our_name not in ours or their_name not in theirs:
                raise RuntimeError(f"{our_name} <- {their_name}: missing on one side")
            target, source = ours[our_name], theirs[their_name]
            if transform:
                source = transform[0](source)
            if target.shape != source.shape:
                raise RuntimeError(f"{our_name} <- {their_name}: shape {tuple(target.shape)} != {tuple(source.shape)}")
            target.copy_(source)
            assigned.add(our_name)
            used.add(their_name)
    if unassigned := sorted(ours.keys() - assigned):
        raise RuntimeError(f"engine parameters not assigned: {', '.join(unassigned)}")
    if unused := sorted(theirs.keys() - used):
        raise RuntimeError(f"transformers parameters not converted: {', '.join(unused)}")


def shared_unsupported(hf_config: Any) -> list[str]:
    """What no conversion reproduces: biases, dropout, scaled RoPE, activations other than SiLU, sliding windows."""
    rope_type = rope_parameters(hf_config)[1]
    checks = [
        (getattr(hf_config, "attention_bias", False), "attention_bias=True (projections have no bias)"),
        (getattr(hf_config, "attention_dropout", 0.0) != 0, "attention_dropout != 0 (no dropout)"),
        (rope_type != "default", f"rope type {rope_type!r} (only the default RoPE, no YaRN or other scaling)"),
        (hf_config.hidden_act != "silu", f"hidden_act={hf_config.hidden_act!r} (experts are SwiGLU)"),
        (
            getattr(hf_config, "sliding_window", None) is not None,
            f"sliding_window={getattr(hf_config, 'sliding_window', None)} (attention is over the whole causal context)",
        ),
    ]
    return [reason for bad, reason in checks if bad]


def dense_pattern(is_moe: list[bool]) -> tuple[int, int] | None:
    """(n_dense_layers, moe_every) that make exactly these blocks MoE (``ModelConfig.is_moe_layer``),
    or None when no such pair does."""
    n_layers = len(is_moe)
    for n_dense in range(n_layers + 1):
        for every in range(1, max(2, n_layers - n_dense + 1)):
            pattern = [i >= n_dense and (i - n_dense + 1) % every == 0 for i in range(n_layers)]
            if pattern == is_moe:
                return n_dense, every
    return None


def tied_parameters(hf_model: nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """transformers' parameters by name, every alias included; with tied embeddings the LM head's alias
    of the input embedding is dropped (the engine holds that matrix once, as ``embed.weight``)."""
    theirs: dict[str, torch.Tensor] = dict(hf_model.named_parameters(remove_duplicate=False))
    if tied:
        head, embedding = theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"]
        if head is not embedding:
            raise RuntimeError("tie_word_embeddings is set but lm_head.weight is not the embedding's weight")
    return theirs


def converted_model(
    hf_model: nn.Module,
    config,
    pairs: Iterable[Pair],
    device: torch.device | str | None,
    their_buffers: dict[str, torch.Tensor] | None = None,
    buffers: Iterable[str] = (),
):
    """An engine ``Transformer`` of ``config`` with ``hf_model``'s weights copied by ``pairs`` (and
    ``their_buffers`` into the engine buffers named in ``buffers``), on ``hf_model``'s device unless
    ``device`` says otherwise, cast to ``config.dtype``."""
    from moe_engine.model import Transformer, cast_parameters

    theirs = tied_parameters(hf_model, config.tie_embeddings)
    theirs.update(their_buffers or {})
    with torch.device(device or next(iter(theirs.values())).device):
        model = Transformer(config)
    copy_weights(model, theirs, pairs, buffers)
    return cast_parameters(model, config.dtype)
