"""Regional compilation (``run.compile``): one ``torch.compile`` region per transformer block, as
torchtitan and OLMo-core compile theirs. What the region is under each recompute mode, the calls left eager and the measured graph breaks:
docs/compile-and-host-syncs.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch._dynamo
from torch import nn

from moe_engine.config import RoutingMode
from moe_engine.moe.layer import MoELayer
from moe_engine.recompute import is_recomputed

EAGER_REASON = "Skip calling `torch.compiler.disable()`d function"
"""Dynamo's reason for a break at a call that ``compile_blocks`` leaves to eager."""

_PACKAGE = Path(__file__).resolve().parent
_STREAM_ROUTING = (RoutingMode.RANDOM, RoutingMode.SKEWED)
"""Routing modes that draw from the router's ``torch.Generator``."""


def compile_blocks(blocks: nn.ModuleList) -> None:
    """Compile each block (after ``apply_recompute``), in place; compilation happens on the first call."""
    for block in blocks:
        for layer in block.modules():
            if isinstance(layer, MoELayer):
                # Replaced on the instance on purpose (the class keeps its methods).
                layer.experts.forward = torch.compiler.disable(layer.experts.forward)  # type: ignore[method-assign]
                if layer.router.config.routing in _STREAM_ROUTING:
                    layer.router.select_experts = torch.compiler.disable(layer.router.select_experts)  # type: ignore[method-assign]
        regions = list(block.children()) if is_recomputed(block) else [block]
        for region in regions:
            region.compile()


def graph_breaks() -> list[tuple[str, str]]:
    """The graph breaks dynamo compiled since its last ``torch._dynamo.reset()``: (where, reason),
    each once, sorted. Where is the innermost engine function at the break (``moe/router.py:forward``),
    the reason dynamo's first line."""
    found = set()
    # What ``torch._dynamo.explain`` reads; it records every break of every compiled frame.
    for reason in torch._dynamo.graph_break_reasons:
        frames = [f for f in reason.user_stack if _PACKAGE in Path(f.filename).resolve().parents]
        frame = frames[-1] if frames else reason.user_stack[-1]
        path = Path(frame.filename).resolve()
        found.add(
            (f"{path.relative_to(_PACKAGE) if frames else path.name}:{frame.name}", reason.reason.splitlines()[0])
        )
    return sorted(found)
