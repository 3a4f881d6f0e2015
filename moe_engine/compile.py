"""Regional compilation (``run.compile``): one ``torch.compile`` region per transformer block, as
torchtitan and OLMo-core compile theirs.

Blocks of a class share their compiled code: dynamo guards on a module's class and attributes, not
on its identity (measured: a 4-block model compiles as many frames and graphs as a 1-block one, all
on the first step, with no recompilation later).

The region depends on the recompute applied before (``moe_engine.recompute``):

- none, selective: the block, by ``block.compile()``, which keeps its class and parameter names
  (``torch.compile(block)`` would wrap it in a new module and rename every parameter). Dynamo
  traces the checkpoints that selective recompute put on the attention and the norms into the
  block's graphs.
- full: each child of the block (norms, attention, feed-forward), the same way. The block's
  ``forward`` is then a checkpoint with a ``context_fn`` (the routing streams' replay), which dynamo
  cannot trace, so it runs ``torch.utils.checkpoint`` eagerly, and that runs its function with
  dynamo disabled: compiling the block, or wrapping its ``forward`` in ``torch.compile``, compiles
  nothing (measured: 0 graphs). The children sit under the checkpoint; its forward and its
  recompute in backward both call them, so both run compiled code.

Two calls stay eager on purpose, each a graph break (dynamo's reason: ``EAGER_REASON``):

- the routed experts (``GroupedExperts.forward``). Their custom autograd functions do not compile:
  dynamo cannot trace the grouped GEMM's operand checks (``Tensor.data_ptr``) and falls back to
  eager for the whole dispatch around them, in fragments (measured: 12 graphs a block instead of
  8); inductor's CPU code generation has no ``float8_e8m0fnu`` (the MXFP8 scales), so the MXFP8
  backend fails to compile.
- random and skewed expert selection (``Router.select_experts``). It draws from the router's own
  ``torch.Generator``, which cannot be in a graph: traced, it breaks at ``torch.rand`` every step,
  twice more on the first step (creating and seeding the generator), and recompiles once per layer
  for the layer's seed, past dynamo's recompile limit (8) from the 9th MoE layer on.

Measured graph breaks of a block in a training step (torch 2.13, the 2-block model of
``tests/test_compile.py``, random routing unless the row says otherwise; that test measures them
again, with every recompute mode for the first row, and fails when this table goes stale). A break
is named by the engine function whose call dynamo leaves to eager (``graph_breaks``); graphs are
dynamo's unique graphs, the forward graphs of one block (AOTAutograd derives their backward):

    backend                                  graphs  breaks
    torch grouped-mm                         8       moe/dispatch.py:__call__, moe/router.py:forward
    mxfp8 (emulated on CPU)                  8       moe/dispatch.py:__call__, moe/router.py:forward
    torch grouped-mm, learned routing        6       moe/dispatch.py:__call__
    expert-parallel no-sync dispatch (ep 2)  10      moe/dispatch.py:_run_received, moe/router.py:forward

The expert-parallel all-to-alls compile into the graphs (no break there), and the compiled no-sync
path issues no host sync of its own.
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
