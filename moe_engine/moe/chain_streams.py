"""The streams a chain of exchanges runs on (``moe_engine.moe.dedup_dispatch``).

A chain is exchanges with nothing to compute between them but the next one's plan: the per-node
dispatch's inter-node rows, then their spread inside the node. In an overlapped step the chain hands
over to the other program once (``moe_engine.moe.dispatch.HandOver``), so the wait for its first
exchange must not hold the other program's compute. On a GPU that wait is a stream wait: made on
the compute stream, it would queue every kernel the other program launches behind the exchange.
So the inside of a chain runs on a side stream, and only the waits that hand over run on the
compute stream. On the CPU there are no streams: a chain's inner wait blocks the host there.

Buffers that cross between the two streams are recorded on the stream that reads them
(``moe_engine.moe.dispatch._InFlight.wait``), so the caching allocator does not hand them out
again while that stream still reads them.
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
