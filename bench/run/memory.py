"""Peak memory of a training step: the CUDA allocator, or tracked tensor bytes and RSS on CPU."""

from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def rss_peak_bytes() -> int:
    """High-water mark of this process's resident set size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class TensorMemoryTracker(TorchDispatchMode):
    """Tracks the bytes of live tensor storages and their peak while active.

    Storages that exist before the block (parameters, gradients, optimizer state) are counted by
    passing them to ``resident``; every storage an op creates inside the block is counted until it
    is freed. Views share their base's storage and are counted once.
    """

    def __init__(self, resident: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        for tensor in resident:
            self._add(tensor)
        self.baseline = self.current
        self.peak = self.current

    def _add(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live and not self._live[key][0].expired():
            return
        nbytes = storage.nbytes()
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self.current += nbytes

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for tensor in tree_leaves(out):
            self._add(tensor)
        self.peak = max(self.peak, self.current)
        return out
