"""The streams a chain of exchanges runs on (``moe_engine.moe.dedup_dispatch``).
More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


@dataclass(frozen=True)
class ChainStreams:
    """Where a chain's inside and its experts run; both None off a GPU or without a chain."""

    main: torch.cuda.Stream | None
    """The compute stream: the caller's current stream."""
    side: torch.cuda.Stream | None
    """The chains' stream, one per device."""

    @classmethod
    def for_device(cls, device: torch.device, chained: bool) -> ChainStreams:
        if device.type != "cuda" or not chained:
            return cls(None, None)
        if device not in _SIDE:
            _SIDE[device] = torch.cuda.Stream(device)
        return cls(torch.cuda.current_stream(device), _SIDE[device])

    @contextlib.contextmanager
    def chain(self) -> Iterator[None]:
        """The inside of a chain: after what the compute stream has launched so far."""
        if self.side is None or self.main is None:
            yield
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            yield

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Back on the compute stream, inside a chain: its last wait (which hands over) and the experts."""
        if self.main is None:
            yield
            return
        with torch.cuda.stream(self.main):
            yield
