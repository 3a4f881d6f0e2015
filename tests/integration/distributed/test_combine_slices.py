"""Chunked combines receive into slices of one buffer: no operation copies the whole buffer (a
concatenation of the chunks, or a copy into it), in the forward or the backward, on 2 gloo ranks.

The buffer is what the dispatcher hands the weighted combine (``permute.combine``), whatever made
it. Counted: in the forward, every copying op (cat, stack, copy_, clone, _to_copy) whose result has
the buffer's shape; in the backward, every copying op that reads the buffer's gradient whole. (The
backward's concatenation of the send buffer's per-chunk gradients, the dispatch direction, reads
other tensors and is not counted.)
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.distributed as dist
from dedup_dispatch_cases import D_MODEL, batch, sharded
from distributed_harness import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine.moe import dedup_dispatch, dispatch

pytestmark = pytest.mark.slow

COPIES = {torch.ops.aten.cat, torch.ops.aten.stack, torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten._to_copy}
# (rows, kind, capacity factor, chunks): per-expert rows (AllToAllDispatcher) and per-rank rows
# (DedupDispatcher), sync and no-sync; one chunk of per-rank rows combines through the same path.
CASES = [
    ("per-expert", "sync", 1.0, 2),
    ("per-expert", "no-sync", 2.0, 3),
    ("per-rank", "sync", 1.0, 2),
    ("per-rank", "no-sync", 4.0, 2),
    ("per-rank", "sync", 1.0, 1),
]
COMBINING = {"_sync", "_no_sync", "_hop"}
"""The dispatchers' methods whose ``combine`` call takes the exchanged buffer."""


class _Copies(TorchDispatchMode):
    """Each copying op: its result's shape and the storages of the tensors it reads."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in COPIES:
            flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
            read = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor) and a.numel()}
            self.ops.append((tuple(out.shape), read))
        return out


def _copies_job(cases) -> dict:
    rank = dist.get_rank()
    buffers: list[torch.Size] = []
    grads: list[torch.Tensor] = []
    originals = dispatch.combine, dedup_dispatch.combine

    def recording(original):
        def combine(y_ND, *args, **kwargs):
            if inspect.currentframe().f_back.f_code.co_name in COMBINING:
                buffers.append(y_ND.shape)
                # Held to the end of the step: no later tensor takes its storage's address.
                y_ND.register_hook(grads.append)
            return original(y_ND, *args, **kwargs)

        return combine

    dispatch.combine, dedup_dispatch.combine = recording(originals[0]), recording(originals[1])
    out = {}
    try:
        for rows, kind, capacity_factor, chunks in cases:
            layer = sharded(rows, kind, capacity_factor, chunks, None, routing="random")
            x_TD, grad_TD = batch(rank, f"slices-{rows}-{kind}-{chunks}")
            x = x_TD.requires_grad_()
            buffers.clear()
            grads.clear()
            forward: list = []
            backward: list = []
            with _Copies(forward):
                y = layer(x)
            with _Copies(backward):
                (y * grad_TD).sum().backward()
            (shape,) = buffers
            (grad,) = grads
            grad_ptr, grad_numel = grad.untyped_storage().data_ptr(), grad.numel()
            out[rows, kind, chunks] = dict(
                shape=tuple(shape),
                forward=sum(s == shape for s, _ in forward),
                backward=sum(grad_ptr in read and math.prod(s) == grad_numel for s, read in backward),
                grad=x.grad,
            )
    finally:
        dispatch.combine, dedup_dispatch.combine = originals
    return out


def test_no_full_buffer_copy_in_a_chunked_combine():
    for rank, results in enumerate(run_ranks(_copies_job, 2, CASES, timeout=180)):
        for case in CASES:
            got = results[case[0], case[1], case[3]]
            rows, width = got["shape"]
            assert rows > 0 and width == D_MODEL and torch.isfinite(got["grad"]).all(), (rank, case)
            assert (got["forward"], got["backward"]) == (0, 0), (rank, case, got["shape"])
