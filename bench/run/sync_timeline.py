"""Host clock readings of a step's gradient collectives, for a proxy's overlap windows.

A ``SyncTimeline`` is a ``moe_engine.parallel.data_parallel.SyncObserver``: set it as an optimizer's
``sync_observer`` before a step and it holds that step's readings (``time.perf_counter``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SyncTimeline:
    """Host clock readings of one step's collectives, for overlap statistics.

    On a fake process group (a proxy) the collectives take no time, so the readings show the
    windows they could hide under: a bucket's reduction launched at t runs under the backward still
    left (``backward_end_s - t``), a gather under the updates still left (``updates_end_s - t``).
    """

    reduce_launch_s: dict[int, float] = field(default_factory=dict)
    """Launch time of each bucket's reduction, by bucket index (launch order = index order)."""
    backward_end_s: float | None = None
    """When the last backward had finished (``finish_grad_sync`` was entered)."""
    reduce_waited_s: float | None = None
    """When every reduction had been waited for."""
    gather_launch_s: dict[int, float] = field(default_factory=dict)
    """Launch time of each bucket's ZeRO-1 gather (its update written), by bucket index."""
    updates_end_s: float | None = None
    """When the last bucket's update had been written."""
    gather_waited_s: float | None = None
    """When every gather had been waited for."""

    def reduce_launched(self, bucket: int) -> None:
        self.reduce_launch_s[bucket] = time.perf_counter()

    def backward_ended(self) -> None:
        self.backward_end_s = time.perf_counter()

    def reductions_waited(self) -> None:
        self.reduce_waited_s = time.perf_counter()

    def gather_launched(self, bucket: int) -> None:
        self.gather_launch_s[bucket] = time.perf_counter()

    def updates_ended(self) -> None:
        self.updates_end_s = time.perf_counter()

    def gathers_waited(self) -> None:
        self.gather_waited_s = time.perf_counter()

    def reduce_windows_s(self) -> list[float]:
        """Per bucket (index order): the backward time left after its reduction launched (0 if after)."""
        if self.backward_end_s is None:
            return []
        return [max(0.0, self.backward_end_s - self.reduce_launch_s[i]) for i in sorted(self.reduce_launch_s)]

    def gather_windows_s(self) -> list[float]:
        """Per bucket: the update time left after its gather launched."""
        if self.updates_end_s is None:
            return []
        return [max(0.0, self.updates_end_s - self.gather_launch_s[i]) for i in sorted(self.gather_launch_s)]
