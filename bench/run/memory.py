"""Memory: the peak of a training step (the CUDA allocator, or tracked tensor bytes and RSS on CPU), and
the check before an execute scenario starts that its plan fits the memory its ranks have free."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.units import format_gib

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


# Memory check before an execute scenario starts. It is refused (recorded oom, nothing started) when
# its planned memory is more than (1 + MEMORY_MARGIN) times what the device has free. The plan's
# tensor total has come out 0.3-4.3% below the measured peak on every layout proxy-check ran
# (docs/measurements/proxy-check-2core-cpu.json), and a process needs its RSS on top of its tensors
# (libraries, allocator caches, a CUDA context), so a plan over the available memory does not fit.
# The 10% allowance is for layouts the plan was not checked against, where it may overcount: such a
# scenario runs and its own run decides. ``moe-bench run --force`` skips the refusal.
MEMORY_MARGIN = 0.10


@dataclass(frozen=True)
class RankMemory:
    """One rank's planned memory and the memory it draws on."""

    rank: int
    host: str
    """The host the rank runs on (only compared, never recorded)."""
    device: str
    """``cpu`` (the ranks of a host share its RAM) or ``cuda:<i>`` (one GPU's memory)."""
    planned: int
    """The plan's memory_total of the rank's pipeline stage, bytes."""
    available: int
    """What the device had free when asked, bytes."""
    source: str
    """Where ``available`` comes from."""


# The free memory of the GPUs is asked in a process of its own, which exits with its answer: asking in
# the runner would create a CUDA context on every GPU (about 0.5 GB each) and hold it for the whole
# suite, memory the workers then lack. Inside a launch each rank asks for its own GPU, which it uses anyway.
_CUDA_FREE_QUERY = (
    "import json, sys, torch; "
    "sys.stdout.write(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(int(sys.argv[1]))]))"
)
CUDA_FREE_SOURCE = "free memory of the GPU, torch.cuda.mem_get_info in a short-lived process"


def cuda_free_bytes(count: int, timeout: float = 120) -> list[int]:
    """The free memory of GPUs 0 to ``count - 1``, bytes, without a CUDA context in this process."""
    command = [sys.executable, "-c", _CUDA_FREE_QUERY, str(count)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        raise OSError(f"the GPU memory query did not answer within {timeout:g} s") from err
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"the GPU memory query exited with code {done.returncode}: {last}")
    return [int(b) for b in json.loads(done.stdout.strip().splitlines()[-1])]


def memory_shortfall(ranks: list[RankMemory], margin: float = MEMORY_MARGIN) -> tuple[str | None, list[dict]]:
    """Why the ranks cannot fit (the memory pool furthest over), or None; and every pool's figures.

    A pool is a GPU, or the RAM of a host, which the CPU ranks on that host share: its ranks' plans
    add up against what it has free.
    """
    hosts = list(dict.fromkeys(r.host for r in ranks))
    pools: dict[str, list[RankMemory]] = {}
    for r in ranks:
        where = "this host" if len(hosts) == 1 else f"node {hosts.index(r.host)}"
        label = f"{where}'s memory" if r.device == "cpu" else (r.device if len(hosts) == 1 else f"{where} {r.device}")
        pools.setdefault(label, []).append(r)
    rows, worst = [], None
    for label, members in pools.items():
        planned, available = sum(m.planned for m in members), min(m.available for m in members)
        rows.append(
            {
                "pool": label,
                "ranks": len(members),
                "planned_bytes": planned,
                "available_bytes": available,
                "source": members[0].source,
            }
        )
        if planned > available * (1 + margin) and (worst is None or planned / available > worst[0]):
            worst = (planned / max(available, 1), label, members, planned, available)
    if worst is None:
        return None, rows
    _, label, members, planned, available = worst
    if len(members) == 1:
        reason = f"planned {format_gib(planned, decimals=1)} per rank, {format_gib(available, decimals=1)} available"
    else:
        reason = (
            f"planned {format_gib(planned, decimals=1)} for the {len(members)} ranks sharing {label} "
            f"({format_gib(max(m.planned for m in members), decimals=1)} on the most loaded), {format_gib(available, decimals=1)} available"
        )
    return f"{reason} ({members[0].source}); not started", rows
