"""Activation recompute: chosen blocks (or parts of them) keep only their inputs and run forward again
in backward, through ``torch.utils.checkpoint`` (non-reentrant).
More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_engine.config import RecomputeConfig, RecomputeMode, RecomputePart
from moe_engine.moe.layer import MoELayer, forward_leaves_no_trace, routing_streams

if TYPE_CHECKING:
    from moe_engine.model import Block


def _checkpointed(forward, context_fn=None):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    run.recomputed = True  # type: ignore[attr-defined]  # a marker attribute on the wrapper, read by is_recomputed
    return run


def _replay_context(block: nn.Module):
    """``context_fn`` for a fully recomputed block: forward saves the routing streams, recompute replays them."""
    layers = [m for m in block.modules() if isinstance(m, MoELayer)]

    def context_fn():
        at_forward: list = []

        @contextlib.contextmanager
        def forward_context():
            at_forward[:] = [router.routing_state() for router in routing_streams(layers)]
            yield

        @contextlib.contextmanager
        def recompute_context():
            with forward_leaves_no_trace(layers):
                for router, state in zip(routing_streams(layers), at_forward):
                    router.set_routing_state(state)
                yield

        return forward_context(), recompute_context()

    return context_fn


def _part_modules(block: Block, part: RecomputePart) -> list[nn.Module]:
    if part is RecomputePart.ATTENTION:
        return [block.attn]
    if part is RecomputePart.NORMS:
        return [block.attn_norm, block.ffn_norm]
    # Dense blocks have no routed experts: nothing to recompute there.
    return [block.ffn.experts] if isinstance(block.ffn, MoELayer) else []


def apply_recompute(blocks: nn.ModuleList, config: RecomputeConfig, stages: list[range]) -> list[int]:
    """Make the chosen blocks of ``blocks`` (the whole model's, by index) recompute in backward.

    ``stages``: every pipeline stage's block indices (``[range(n_layers)]`` without pipelining), for
    ``first_per_stage``. Returns the indices of the recomputed blocks.
    """
    chosen = config.blocks(stages)
    for index in chosen:
        block = blocks[index]
        if config.mode is RecomputeMode.FULL:
            block.forward = _checkpointed(block.forward, _replay_context(block))
        else:
            for part in config.parts:
                # model.blocks holds Blocks; ModuleList's items are typed as plain modules.
                for module in _part_modules(cast("Block", block), part):
                    module.forward = _checkpointed(module.forward)
    return chosen


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``apply_recompute`` made this module's forward recompute in backward."""
    return getattr(module.__dict__.get("forward"), "recomputed", False)
