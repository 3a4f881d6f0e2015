"""Count the work of one training step exactly: FLOPs, allocations, ops, host syncs and collectives.
More: docs/step-measurement.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import moe_engine.kernels  # noqa: F401  (registers the moe_engine:: ops the FLOP counter maps)
from bench.metrics import WORK_METRIC_NAMES, entry
from bench.run.collective_log import CollectiveRecorder
from bench.run.memory import TensorMemoryTracker
from moe_engine.host_sync import profile_host_syncs

aten = torch.ops.aten

WORK_METRICS = (*WORK_METRIC_NAMES, "work_flops_ratio")
"""The metrics ``work_metrics`` writes (units and directions in ``bench.metrics``)."""


@dataclass
class StepWork:
    """What one step of one rank did. Every field is an exact count (``seconds`` aside)."""

    matmul_flops: int = 0
    """FLOPs of the matmul-class ops (see the module doc)."""
    flops_by_op: dict[str, int] = field(default_factory=dict)
    """The same by op (``aten.mm``, ``aten._grouped_mm``)."""
    allocated_bytes: int = 0
    """Bytes allocated during the step, freed or not."""
    allocated_by_op: dict[str, int] = field(default_factory=dict)
    """The same by op (CPU only: the CUDA allocator's counter has no op)."""
    allocator: str = ""
    """Where ``allocated_bytes`` comes from: ``tensor-tracker`` (CPU) or ``cuda-allocator``."""
    cuda_block_bytes: int | None = None
    """CUDA: the allocator's blocks handed out during the step (``allocated_bytes.all.allocated``)."""
    aten_ops: int = 0
    """Operators dispatched, backward and collectives included."""
    ops_by_name: dict[str, int] = field(default_factory=dict)
    host_syncs: int = 0
    syncs_by_site: dict[str, int] = field(default_factory=dict)
    """Host syncs by the outermost ATen op they ran inside (the syncing op itself when none)."""
    collectives: list[dict[str, Any]] = field(default_factory=list)
    """``{"op", "group", "calls", "bytes"}`` per kind and group, sorted."""
    seconds: float = 0.0
    """Wall time of the counted step (slowed by the counters; never a metric)."""

    @property
    def collective_calls(self) -> int:
        return sum(c["calls"] for c in self.collectives)

    @property
    def collective_bytes(self) -> int:
        return sum(c["bytes"] for c in self.collectives)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(collective_calls=self.collective_calls, collective_bytes=self.collective_bytes)
        return out


class OpCounter(TorchDispatchMode):
    """Counts every operator dispatched while active, by overload name (``aten.mm.default``)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


class GroupedMMFlops:
    """FLOP formula of ``torch._grouped_mm`` over what its offsets cover, for ``FlopCounterMode``.

    The formula is called with the op's tensors (``_get_raw``: ``FlopCounterMode`` passes shapes
    otherwise) and returns 0; it keeps each call's offsets and its FLOPs per covered unit, and
    ``resolve()`` reads every offsets tensor's last entry at once, after the step. Forms (torch's):

    - 2-D a (M, K) x 3-D b (G, K, N), offsets over M: ``2 * K * N`` per covered row;
    - 3-D a (G, M, K) x 2-D b (K, N), offsets over N: ``2 * M * K`` per covered column;
    - 2-D a (M, K) x 2-D b (K, N), offsets over K (a weight gradient): ``2 * M * N`` per covered k;
    - 3-D x 3-D, no offsets: ``2 * G * M * K * N``.

    ``accumulated`` is the formula of ``moe_engine::grouped_wgrad_accumulate(a, b, offsets, out)``, the
    weight gradient ``_grouped_mm(a^T, b)`` added into ``out`` inside the GEMM; ``resolve`` counts it
    apart (``accumulated_flops``). The engine's offsets are never written in place after the GEMM, so reading them late reads what
    the kernel read.
    """

    _get_raw = True

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, int, bool]] = []
        """Each call's offsets, FLOPs per covered unit, and whether it was an ``accumulated`` call."""
        self.fixed = 0
        self._accumulating = False
        self.accumulated_flops = 0
        """What ``resolve`` found the ``accumulated`` calls did (after it runs)."""
        self.accumulated = self._accumulated_formula()

    def _accumulated_formula(self):
        def formula(a_NM, b_NK, offsets_E, out_EMK, *args, out_val=None, **kwargs) -> int:
            self._accumulating = True
            try:
                return self(a_NM.t(), b_NK, offsets_E)
            finally:
                self._accumulating = False

        formula._get_raw = True  # type: ignore[attr-defined]
        return formula

    def __call__(self, a, b, offs=None, *args, out_val=None, **kwargs) -> int:
        if a.dim() == 3 and b.dim() == 3:
            groups, m, k = a.shape
            self.fixed += 2 * groups * m * k * b.shape[-1]
            return 0
        if a.dim() == 2 and b.dim() == 3:
            per_unit = 2 * a.shape[1] * b.shape[-1]
        elif a.dim() == 3 and b.dim() == 2:
            per_unit = 2 * a.shape[1] * a.shape[2]
        else:
            per_unit = 2 * a.shape[0] * b.shape[1]
        self.pending.append((offs, per_unit, self._accumulating))
        return 0

    def resolve(self) -> int:
        """The FLOPs of every ``_grouped_mm`` call seen (one host read of all the offsets, outside the
        step); those of the ``accumulated`` calls go to ``accumulated_flops``."""
        if not self.pending:
            return self.fixed
        ends = torch.stack([offs[-1].to(torch.int64) for offs, _, _ in self.pending]).tolist()
        flops = [(end * per_unit, accumulated) for end, (_, per_unit, accumulated) in zip(ends, self.pending)]
        self.accumulated_flops = sum(f for f, accumulated in flops if accumulated)
        return self.fixed + sum(f for f, accumulated in flops if not accumulated)


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_attention_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _wgrad_accumulate_flops(a_shape, b_shape, buffer_shape, *args, out_shape=None, **kwargs) -> int:
    # moe_engine::wgrad_accumulate(a_NM, b_NK, out_MK): out += a^T b, a's leading dims the N rows
    return 2 * math.prod(a_shape) * b_shape[-1]


def flop_counter(grouped: GroupedMMFlops) -> FlopCounterMode:
    """torch's FLOP counter with the formulas torch 2.13 lacks (the grouped GEMM, CPU attention)."""
    return FlopCounterMode(
        display=False,
        custom_mapping={
            aten._grouped_mm: grouped,
            torch.ops.moe_engine.grouped_wgrad_accumulate: grouped.accumulated,
            torch.ops.moe_engine.wgrad_accumulate: _wgrad_accumulate_flops,
            aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flops,
        },
    )


def _sync_sites(syncs) -> Counter[str]:
    """Host syncs by the outermost ATen op they ran inside.

    A syncing event inside another is the same sync: each dispatch mode hands an op on by calling
    it again, so the profiler sees ``aten::_local_scalar_dense`` once per mode, nested; and on CUDA
    the runtime's synchronising call sits inside the op that made it.
    """
    names = {s.name for s in syncs}
    sites: Counter[str] = Counter()
    for sync in syncs:
        if names.intersection(sync.stack):
            continue
        outer = [frame for frame in sync.stack if frame.startswith("aten::")]
        sites[outer[-1] if outer else sync.name] += 1
    return sites


def _collective_census(calls, group_labels: dict[str, str]) -> list[dict[str, Any]]:
    census: dict[tuple[str, str], list[int]] = {}
    for call in calls:
        group = group_labels.get(call.group_name, "ranks " + ",".join(map(str, call.ranks)))
        entry = census.setdefault((call.op, group), [0, 0])
        entry[0] += 1
        entry[1] += call.nbytes
    return [
        {"op": op, "group": group, "calls": calls, "bytes": nbytes}
        for (op, group), (calls, nbytes) in sorted(census.items())
    ]


def count_step_work(
    step: Callable[[], object],
    device: torch.device,
    resident: Iterable[torch.Tensor] = (),
    group_labels: dict[str, str] | None = None,
) -> StepWork:
    """Run ``step()`` once under every counter; what it did (see the module doc).

    ``resident``: tensors that live across steps (parameters, gradients, optimizer state): the CPU
    tracker counts their growth only. ``group_labels``: process group name -> label (``dp``) for the
    collective census; an unlabelled group is named by its ranks.
    """
    grouped = GroupedMMFlops()
    flops = flop_counter(grouped)
    recorder = CollectiveRecorder()
    ops = OpCounter()
    tracker = TensorMemoryTracker(resident) if device.type != "cuda" else None
    cuda_before = _cuda_allocated(device)

    def counted() -> None:
        with flops, recorder, tracker if tracker is not None else contextlib.nullcontext(), ops:
            step()

    start = time.perf_counter()
    syncs = profile_host_syncs(counted)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    blocks = None
    if tracker is None:  # read before anything below allocates
        allocated, blocks = (after - before for after, before in zip(_cuda_allocated(device), cuda_before))
        allocated_by_op, allocator = {}, "cuda-allocator"
    else:
        allocated, allocated_by_op, allocator = tracker.allocated, dict(tracker.allocated_by_op), "tensor-tracker"

    by_op = {str(packet): int(n) for packet, n in flops.get_flop_counts().get("Global", {}).items() if n}
    grouped_flops = grouped.resolve()
    if grouped_flops:
        by_op["aten._grouped_mm"] = grouped_flops
    if grouped.accumulated_flops:
        by_op["moe_engine.grouped_wgrad_accumulate"] = grouped.accumulated_flops
    sites = _sync_sites(syncs)
    return StepWork(
        matmul_flops=sum(by_op.values()),
        flops_by_op=dict(sorted(by_op.items())),
        allocated_bytes=int(allocated),
        allocated_by_op=dict(sorted(allocated_by_op.items())),
        allocator=allocator,
        cuda_block_bytes=blocks,
        aten_ops=sum(ops.counts.values()),
        ops_by_name=dict(sorted(ops.counts.items())),
        host_syncs=sum(sites.values()),
        syncs_by_site=dict(sorted(sites.items())),
        collectives=_collective_census(recorder.calls, group_labels or {}),
        seconds=seconds,
    )


def _cuda_allocated(device: torch.device) -> tuple[int, int]:
    """(bytes requested, bytes of blocks handed out) by the CUDA caching allocator so far."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    blocks = int(stats.get("allocated_bytes.all.allocated", 0))
    return int(stats.get("requested_bytes.all.allocated", blocks)), blocks


def work_metrics(ranks: list[dict[str, Any]], formula_flops: float) -> dict[str, dict]:
    """The ``work_*`` metrics of a step from every rank's census (``StepWork.to_dict`` plus
    ``formula_flops``): sums over the ranks, each one exact sample (``spread: null``).

    ``formula_flops`` is ``moe_engine.flops.training_flops_per_token`` times the step's tokens.
    ``work_flops_ratio`` = executed matmul FLOPs / formula FLOPs: above 1 where the engine computes
    what the formula leaves out (attention counted over the full score matrix where the formula
    halves it for the causal mask, the router's GEMM) or computes twice (recomputation); below 1
    where the formula counts work that did not run (tokens dropped at a no-sync dispatch's
    capacity, kernels outside the dispatcher). Reported, not gated: the FLOPs are.
    """
    total = {
        name: sum(r[name] for r in ranks)
        for name in (
            "matmul_flops",
            "allocated_bytes",
            "aten_ops",
            "host_syncs",
            "collective_calls",
            "collective_bytes",
        )
    }
    values = {f"work_{name}": value for name, value in total.items()}
    values["work_flops_ratio"] = total["matmul_flops"] / formula_flops if formula_flops else 0.0
    return {name: entry(name, [values[name]]) for name in WORK_METRICS}
