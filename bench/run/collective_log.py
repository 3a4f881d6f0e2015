"""Record every torch.distributed collective a rank issues: the op, its group and its bytes.
More: docs/step-measurement.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# c10d op name -> (collective, which argument's tensors count as its bytes)
_OPS = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "barrier": ("barrier", None),
}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank issued it."""

    op: str
    """all_to_all, all_reduce, reduce_scatter, all_gather, broadcast, barrier, send or recv."""
    ranks: tuple[int, ...]
    """Global ranks of the group; for send and recv, (this rank, the peer)."""
    nbytes: int
    """Bytes, by the module's conventions."""
    group_name: str
    """The process group's name (tells the dp, ep, edp and pp groups apart when their ranks coincide)."""


def _argument(func, args, kwargs, name: str):
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    raise KeyError(f"{func} has no argument {name!r}")


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


class CollectiveRecorder(TorchDispatchMode):
    """Appends a ``CollectiveCall`` to ``calls`` for every collective issued while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[-1]
        if name not in _OPS:
            return
        op, data_arg = _OPS[name]
        group = dist.ProcessGroup.unbox(_argument(func, args, kwargs, "process_group"))
        ranks = tuple(dist.get_process_group_ranks(group))
        if op in ("send", "recv"):
            peer = _argument(func, args, kwargs, "dst" if op == "send" else "src")
            ranks = (ranks[group.rank()], ranks[peer])
        nbytes = 0 if data_arg is None else _nbytes(_argument(func, args, kwargs, data_arg))
        self.calls.append(CollectiveCall(op, ranks, nbytes, group.group_name))
