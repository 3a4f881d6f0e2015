"""Peak memory of a training step: the CUDA allocator, or tracked tensor bytes and RSS on CPU."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# torch.tensor, torch.as_tensor and torch.from_numpy build their tensor outside the dispatcher and
# hand it to this op: its output aliases its input, and is new.
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def rss_peak_bytes() -> int:
    """High-water mark of this process's resident set size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class TensorMemoryTracker(TorchDispatchMode):
    """Tracks the bytes of live tensor storages and their peak while active.

    Storages that exist before the block (parameters, gradients, optimizer state) are counted by
    passing them to ``resident``; every storage an op creates inside the block is counted until it
    is freed. A storage is counted by its bytes (``untyped_storage().nbytes()``), once however many
    tensors view it: views, in-place ops and ``out=`` ops add nothing unless they grow a tracked
    storage (``resize_``, an ``out=`` tensor resized to its result), which adds the growth. A storage
    from before the block that was not passed as resident is never counted, whatever views or
    updates it. Meta tensors take no memory and are not counted.

    ``baseline``: the resident bytes. ``current``: the live bytes now (storages freed since the last
    op already subtracted). ``peak``: the most live bytes at the end of any op (the outputs of an op
    and every storage still alive then); it may be lowered by hand, to start measuring a new part.
    ``allocated``: every byte allocated inside the block, freed or not (each new storage's bytes and
    the growth of tracked ones, never lowered by a free); ``allocated_by_op`` splits it by the op that
    allocated (``"aten.clone.default"``).
    """

    def __init__(self, resident: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._bytes = 0
        self.allocated = 0
        self.allocated_by_op: dict[str, int] = {}
        for tensor in resident:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._track(tensor.untyped_storage())
        self.baseline = self._bytes
        self.peak = self._bytes

    @property
    def current(self) -> int:
        """Bytes of the tracked storages alive now."""
        self._sweep()
        return self._bytes

    def _track(self, storage: torch.UntypedStorage) -> int:
        """Count ``storage``, or what it grew by since it was last seen; returns the change in bytes."""
        # The weak reference keeps a dead storage's address from being reused until it is swept, so a
        # key still in the table is this very storage.
        key, nbytes = storage._cdata, storage.nbytes()
        ref, counted = self._live.get(key, (None, 0))
        self._live[key] = (StorageWeakRef(storage) if ref is None else ref, nbytes)
        self._bytes += nbytes - counted
        return nbytes - counted

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self._bytes -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._sweep()
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage._cdata not in self._live:
                if inputs is None:
                    inputs = {
                        t.untyped_storage()._cdata
                        for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor) and t.device.type != "meta"
                    }
                if storage._cdata in inputs and func is not _LIFT_FRESH:
                    continue  # a view of, or an update to, a storage from before the block
            grown = self._track(storage)
            if grown > 0:
                self.allocated += grown
                name = str(func)
                self.allocated_by_op[name] = self.allocated_by_op.get(name, 0) + grown
        self.peak = max(self.peak, self._bytes)
        return out
