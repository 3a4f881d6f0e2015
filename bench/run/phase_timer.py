"""Wall-clock time of a training step split into phases, forward and backward, without editing modules.
More: docs/step-measurement.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from moe_engine.model import Block
from moe_engine.modules.attention import Attention
from moe_engine.modules.mla import MultiHeadLatentAttention
from moe_engine.modules.mlp import SwiGLU
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.router import Router

FORWARD = "forward"
BACKWARD = "backward"


def _graph_task_id() -> int:
    """Id of the autograd graph task running on this thread, -1 outside a backward pass."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward pass (a node's backward or a hook)."""
    return _graph_task_id() != -1


class _Marker(torch.autograd.Function):
    """Identity in forward; in backward, reports ``event`` (enter or exit ``phase``) to the timer."""

    @staticmethod
    def forward(ctx, x, timer: PhaseTimer, phase: str, enter: bool):
        ctx.timer, ctx.phase, ctx.enter = timer, phase, enter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.enter:
            ctx.timer._backward_enter(ctx.phase)
        else:
            ctx.timer._exit(ctx.phase, BACKWARD)
        return grad, None, None, None


def _needs_marker(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled()


def _mark_first(value: Any, mark: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, bool]:
    """``value`` with its first tensor requiring grad passed through ``mark``, and whether one was.

    Handles a tensor, a tuple or list (namedtuples included) and a dataclass instance, in element or
    field order, one level deep; anything else comes back unchanged.
    """
    if isinstance(value, torch.Tensor):
        return (mark(value), True) if _needs_marker(value) else (value, False)
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if _needs_marker(item):
                items = list(value)
                items[i] = mark(item)
                if isinstance(value, tuple) and hasattr(value, "_fields"):
                    return type(value)(*items), True
                return type(value)(items), True
        return value, False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.init and _needs_marker(item):
                return dataclasses.replace(value, **{f.name: mark(item)}), True
        return value, False
    return value, False


@dataclasses.dataclass
class _Entry:
    phase: str
    direction: str
    graph_task: int


class PhaseTimer:
    """Exclusive wall-clock time per phase and direction (see docs/step-measurement.md).

    ``clock`` returns seconds; ``synchronize`` runs before every clock read (pass
    ``torch.cuda.synchronize`` on CUDA). Not thread-safe: one forward or backward at a time.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Callable[[], None] = lambda: None,
    ):
        self._clock = clock
        self._synchronize = synchronize
        self._totals: dict[str, dict[str, float]] = {}
        self._stack: list[_Entry] = []
        self._last: float | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._cleanup_queued: set[int] = set()

    # -- accounting -------------------------------------------------------------------------

    @property
    def totals(self) -> dict[str, dict[str, float]]:
        """Seconds per phase: ``{phase: {"forward": s, "backward": s}}`` (a copy), every phase
        instrumented or timed so far, zero where nothing was charged."""
        return {phase: dict(by_direction) for phase, by_direction in self._totals.items()}

    def reset(self) -> None:
        """Zero the totals and forget open phases (instrumentation stays)."""
        for by_direction in self._totals.values():
            by_direction[FORWARD] = by_direction[BACKWARD] = 0.0
        self._stack.clear()
        self._last = None

    def _declare(self, phase: str) -> None:
        self._totals.setdefault(phase, {FORWARD: 0.0, BACKWARD: 0.0})

    def _charge(self) -> None:
        """Read the clock and charge the time since the previous event to the phase on top."""
        self._synchronize()
        now = self._clock()
        if self._stack and self._last is not None:
            top = self._stack[-1]
            self._totals[top.phase][top.direction] += now - self._last
        self._last = now

    def _enter(self, phase: str, direction: str, graph_task: int = -1) -> None:
        self._declare(phase)
        self._charge()
        self._stack.append(_Entry(phase, direction, graph_task))

    def _exit(self, phase: str, direction: str) -> None:
        """Close the innermost open ``phase`` of ``direction``, wherever it sits; ignored if none."""
        for i in range(len(self._stack) - 1, -1, -1):
            entry = self._stack[i]
            if entry.phase == phase and entry.direction == direction:
                self._charge()
                del self._stack[i]
                return

    def _backward_enter(self, phase: str) -> None:
        task = _graph_task_id()
        self._enter(phase, BACKWARD, task)
        if task not in self._cleanup_queued:
            self._cleanup_queued.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(task))

    def _end_of_backward(self, task: int) -> None:
        """Close the phases a finished backward pass left open (it skipped their input markers)."""
        self._cleanup_queued.discard(task)
        if any(entry.graph_task == task for entry in self._stack):
            self._charge()
            self._stack = [entry for entry in self._stack if entry.graph_task != task]

    def _direction_now(self) -> tuple[str, int]:
        task = _graph_task_id()
        return (BACKWARD if task != -1 else FORWARD), task

    # -- public entry points -----------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, phase: str) -> Iterator[None]:
        """Time the enclosed code as ``phase`` (exclusive of phases entered inside it); backward if
        it runs inside an autograd backward pass, else forward."""
        direction, task = self._direction_now()
        self._enter(phase, direction, task)
        try:
            yield
        finally:
            self._exit(phase, direction)

    def instrument(self, module: nn.Module, phase: str, open_ended: bool = False) -> None:
        """Time ``module``'s forward and backward as ``phase`` (see docs/step-measurement.md).

        ``open_ended``: mark the output even when no input takes a gradient; the backward phase then
        runs until the backward pass ends. For a module whose backward is the last work of the pass,
        such as the token embedding.
        """
        self._declare(phase)
        # Per call in flight (a module may be re-entered): the direction entered and whether the
        # input got a marker, so that the forward hook marks the output only when it did.
        calls: list[tuple[str, bool]] = []

        def mark_exit(x: torch.Tensor) -> torch.Tensor:
            return _Marker.apply(x, self, phase, False)

        def mark_enter(x: torch.Tensor) -> torch.Tensor:
            return _Marker.apply(x, self, phase, True)

        def pre_hook(mod, args, kwargs):
            direction, task = self._direction_now()
            new_args, marked = _mark_first(tuple(args), mark_exit)
            new_kwargs = kwargs
            if not marked and kwargs:
                new_values, marked = _mark_first(list(kwargs.values()), mark_exit)
                new_kwargs = dict(zip(kwargs.keys(), new_values))
            calls.append((direction, marked))
            self._enter(phase, direction, task)
            return new_args, new_kwargs

        def post_hook(mod, args, output):
            direction, input_marked = calls.pop() if calls else (self._direction_now()[0], False)
            self._exit(phase, direction)
            if not (input_marked or open_ended):
                return None
            new_output, marked = _mark_first(output, mark_enter)
            return new_output if marked else None

        self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        # Prepended: other forward hooks on the module (registered before or after) run outside the phase.
        self._handles.append(module.register_forward_hook(post_hook, prepend=True))

    def remove(self) -> None:
        """Remove every hook this timer registered (totals are kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def instrument_model(timer: PhaseTimer, module: nn.Module) -> None:
    """Instrument an engine model (or any module containing engine blocks) by module type.

    Block -> "block" (norms, residual adds), Attention and MultiHeadLatentAttention -> "attention",
    Router -> "router", GroupedExperts -> "experts" (the gather of their rows into expert order included),
    MoELayer -> "dispatch" (its exclusive remainder: routing plan, all-to-all, combine), an MoE layer's
    shared expert -> "shared_expert", a block's dense SwiGLU ``ffn`` -> "dense_ffn". Embedding, final norm
    and LM head are left to the caller's "other".
    """
    # Imported here so that the timer itself depends on torch only.

    for sub in module.modules():
        if isinstance(sub, Block):
            timer.instrument(sub, "block")
            if isinstance(sub.ffn, SwiGLU):
                timer.instrument(sub.ffn, "dense_ffn")
        elif isinstance(sub, (Attention, MultiHeadLatentAttention)):
            timer.instrument(sub, "attention")
        elif isinstance(sub, Router):
            timer.instrument(sub, "router")
        elif isinstance(sub, GroupedExperts):
            timer.instrument(sub, "experts")
        elif isinstance(sub, MoELayer):
            timer.instrument(sub, "dispatch")
            if sub.shared_expert is not None:
                timer.instrument(sub.shared_expert, "shared_expert")
