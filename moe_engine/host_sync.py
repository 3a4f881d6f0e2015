"""Detect host synchronisation, with two checks that see different things: ``forbid_host_sync()``
refuses a sync where it is issued, ``profile_host_syncs(fn)`` finds the ones inside kernels. What
each sees: docs/compile-and-host-syncs.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(RuntimeError):
    """Raised when code inside ``forbid_host_sync`` would synchronise with the host."""


_SYNCING_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
}


def _is_bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)


class _ForbidFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCING_METHODS:
            raise HostSyncError(f"host synchronisation: {getattr(func, '__name__', func)}")
        if func is torch.where and len(args) + len(kwargs) == 1:
            raise HostSyncError("host synchronisation: torch.where(condition)")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_bool_mask(args[1]):
            raise HostSyncError("host synchronisation: boolean-mask indexing")
        return func(*args, **kwargs)


_SYNCING_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::nonzero_static",
    # Output shapes that depend on device data.
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::bincount",
}

_MASK_INDEXING_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _copies_from_host(func, args, kwargs) -> bool:
    """A blocking copy of host memory to a device (on CUDA: ``memcpy_and_sync``)."""
    name = func._schema.name
    if name == "aten::lift_fresh":
        return True
    if name == "aten::_to_copy":
        source, target = args[0].device, kwargs.get("device")
    elif name == "aten::copy_":
        source, target = args[1].device, args[0].device
    else:
        return False
    non_blocking = kwargs.get("non_blocking", args[2] if name == "aten::copy_" and len(args) > 2 else False)
    return source.type == "cpu" and target is not None and target.type not in ("cpu", "meta") and not non_blocking


def _syncs(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in _SYNCING_OPS:
        return True
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        return kwargs.get("output_size") is None
    if name in _MASK_INDEXING_OPS and len(args) > 1:
        return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


class _ForbidOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            raise HostSyncError(f"host synchronisation: {func._schema.name}")
        if _copies_from_host(func, args, kwargs):
            raise HostSyncError(f"host-to-device copy: {func._schema.name} (make the tensor before the guarded block)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_sync():
    """Inside this block, any host synchronisation raises ``HostSyncError``."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _ForbidFunctions(), _ForbidOps():
            yield
    finally:
        if previous is not None:  # cuda
            torch.cuda.set_sync_debug_mode(previous)


# The CUDA runtime calls that block the host until the device is done (seen with CUDA activity).
_SYNCING_CUDA_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}


@dataclass(frozen=True)
class ProfiledSync:
    """One host-synchronising event of a profiled run."""

    name: str
    """The op or CUDA runtime call, e.g. ``aten::_local_scalar_dense``."""
    stack: tuple[str, ...]
    """The ops it ran inside, innermost first (e.g. ``("aten::item", "aten::_grouped_mm", ...)``)."""

    def inside(self, op: str) -> bool:
        return op in self.stack


MEASURED_REGION = "moe_engine.host_sync.measured"
"""The ``record_function`` label around the function ``profile_host_syncs`` measures."""


def profile_host_syncs(fn: Callable[[], object]) -> list[ProfiledSync]:
    """Run ``fn`` under the profiler; every host sync it issued, at any depth, in order."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        with record_function(MEASURED_REGION):
            fn()
    found = []
    for event in prof.events():
        if event.name in _SYNCING_OPS or event.name in _SYNCING_CUDA_CALLS:
            stack, parent = [], event.cpu_parent
            while parent is not None:
                stack.append(parent.name)
                parent = parent.cpu_parent
            if MEASURED_REGION in stack:
                found.append(ProfiledSync(event.name, tuple(s for s in stack if s != MEASURED_REGION)))
    return found
