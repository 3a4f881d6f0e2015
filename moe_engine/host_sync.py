"""Detect host synchronisation: a context manager that turns every host sync into an error.

On every device it intercepts, at the Python level, ``Tensor.item/tolist/cpu/numpy``, truth tests
of tensors, ``nonzero``, one-argument ``where`` and boolean-mask indexing, and at the dispatcher
level (which also sees C++ autograd backward) the ops that read device data on the host
(``aten._local_scalar_dense``, ``aten.nonzero``, ``aten.masked_select``) and the ops whose output
shape depends on device data (``unique``, ``bincount``, ``repeat_interleave`` without
``output_size``, indexing with a boolean mask). On CUDA it also sets
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

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
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
