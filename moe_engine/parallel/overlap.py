"""Overlap across microbatches: one microbatch's expert all-to-alls in flight while another computes.
More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from moe_engine.config import ExpertOverlap, ParallelConfig
from moe_engine.moe import dispatch
from moe_engine.moe.layer import MoELayer
from moe_engine.recompute import is_recomputed

Event = tuple[str, int]
"""A recorded event: ("run", p) when program p takes over, ("done", p) when it finishes."""


class Interleaver:
    """Runs two programs one at a time, switching at each expert all-to-all in flight (docs/schedules-and-recompute.md).

    ``events``, when given a list, records the hand-overs (``Event``), so a test can check what ran while
    each all-to-all was in flight."""

    def __init__(self, events: list[Event] | None = None):
        self.events = events
        self._cv = threading.Condition()
        self._active = -1
        self._done = [False, False]
        self._error: BaseException | None = None

    @property
    def active(self) -> int:
        """The program running now (0 or 1), -1 outside ``run``."""
        return self._active

    def run(self, first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
        """Run ``first`` then, at its first all-to-all, ``second``, alternating; both results."""
        if dispatch.in_flight_hook is not None:
            raise RuntimeError("an overlapped region is already running")
        modes = _get_current_function_mode_stack(), _get_current_dispatch_mode_stack()
        grad = torch.is_grad_enabled()
        stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        results: list[Any] = [None, None]
        self._active, self._done, self._error = 0, [False, False], None
        self._record("run", 0)

        def body(p: int, program: Callable[[], Any]) -> None:
            with self._cv:
                self._cv.wait_for(lambda: self._active == p)
            try:
                if self._error is None:
                    with _entered(modes), torch.set_grad_enabled(grad), _on_stream(stream):
                        results[p] = program()
            except BaseException as error:  # handed to the caller once both threads are joined
                self._error = self._error or error
            finally:
                with self._cv:
                    self._done[p] = True
                    self._record("done", p)
                    if not self._done[1 - p]:
                        self._active = 1 - p
                        self._record("run", 1 - p)
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(p, f), daemon=True) for p, f in enumerate((first, second))]
        dispatch.in_flight_hook = self._hand_over
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            dispatch.in_flight_hook = None
            self._active = -1
        if self._error is not None:
            raise self._error
        return results[0], results[1]

    def _hand_over(self) -> None:
        # Called by the running program (on whatever thread runs it: autograd may run a backward on
        # its device thread) with an all-to-all in flight: the other runs until its own next one.
        with self._cv:
            me = self._active
            other = 1 - me
            if self._done[other] or self._error is not None:
                return
            self._active = other
            self._record("run", other)
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._active == me)

    def _record(self, kind: str, program: int) -> None:
        if self.events is not None:
            self.events.append((kind, program))


@contextlib.contextmanager
def _entered(modes: tuple[list, list]) -> Iterator[None]:
    """The caller's torch function and dispatch modes, entered on this thread (modes are thread-local)."""
    with contextlib.ExitStack() as stack:
        for mode in (*modes[0], *modes[1]):
            stack.enter_context(mode)
        yield


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """The caller's CUDA device and stream on this thread (None: not on CUDA)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def replays_routes(module: torch.nn.Module) -> bool:
    """Whether a block of ``module`` is fully recomputed with MoE layers inside: its recompute sets the
    layers' routing streams back to the forward's and restores them after, a window in which the other
    microbatch's forward would draw from (and count into) the replayed state."""
    return any(is_recomputed(m) and any(isinstance(x, MoELayer) for x in m.modules()) for m in module.modules())


def overlaps_microbatches(parallel: ParallelConfig, module: torch.nn.Module) -> bool:
    """Whether the rank holding ``module`` runs microbatches beside each other (``resolved_overlap``), which
    it does unless a full recompute replays routes (``replays_routes``): then auto runs the plain order,
    and an explicit ``microbatches`` is refused."""
    if parallel.resolved_overlap is not ExpertOverlap.MICROBATCHES:
        return False
    if not replays_routes(module):
        return True
    if parallel.overlap is ExpertOverlap.MICROBATCHES:
        raise ValueError(
            "parallel.overlap: microbatches cannot run beside a full recompute of MoE blocks (the replay swaps "
            "the routing streams the other microbatch draws from); use recompute mode selective, or overlap auto"
        )
    return False
