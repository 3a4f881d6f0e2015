"""Data-parallel gradient synchronisation (DDP grad buffers) and the ZeRO-1 distributed optimizer.
The families' arithmetic, buffers, buckets, overlap, clipping and the optimizer: docs/data-parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from moe_engine.config import GradDtype, OptimizerSharding, ParallelConfig
from moe_engine.moe.experts import GroupedExperts
from moe_engine.parallel.groups import ProcessGroups
from moe_engine.train import OptimizerConfig, build_adamw

# torch 2.13 renamed the flat collectives; older releases only have the first names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ParamFamily(str, Enum):
    """Which reduction a parameter's gradient needs."""

    DENSE = "dense"
    """Replicated on every dp rank: averaged over dp."""
    EXPERT = "expert"
    """Held by one ep rank, replicated over edp: summed over edp, divided by dp."""


def param_families(model: nn.Module) -> dict[ParamFamily, list[nn.Parameter]]:
    """Trainable parameters by family, each list in registration order."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    families: dict[ParamFamily, list[nn.Parameter]] = {ParamFamily.DENSE: [], ParamFamily.EXPERT: []}
    for param in model.parameters():
        if param.requires_grad:
            family = ParamFamily.EXPERT if id(param) in expert_ids else ParamFamily.DENSE
            families[family].append(param)
    return families


@dataclass(frozen=True)
class _FamilyComm:
    """How one family's gradients are reduced on this rank."""

    group: dist.ProcessGroup | None
    """Group the gradients are reduced over (None: a group of one, no collectives)."""
    divisor: int
    """Gradients are scaled by 1/divisor before the sum (dp size for both families)."""

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


def _family_comms(groups: ProcessGroups | None) -> dict[ParamFamily, _FamilyComm]:
    if groups is None:
        return {family: _FamilyComm(None, 1) for family in ParamFamily}
    dp = dist.get_world_size(groups.dp)

    def alone(group):
        # A group of one has nothing to reduce: no collective, and no separate ZeRO-1 output buffer.
        return None if dist.get_world_size(group) == 1 else group

    return {
        ParamFamily.DENSE: _FamilyComm(alone(groups.dp), dp),
        ParamFamily.EXPERT: _FamilyComm(alone(groups.edp), dp),
    }


@dataclass(eq=False)
class _Segment:
    """The part of one parameter inside this rank's share of a bucket: what the inner AdamW updates."""

    family: ParamFamily
    """Family of the parameter (for per-family state accounting)."""
    decay: bool
    """Whether weight decay applies (the parameter is a matrix)."""
    param_N: torch.Tensor
    """View of the flat parameter buffer (model dtype)."""
    grad_N: torch.Tensor
    """View of the reduced gradient (the gradient buffer's dtype)."""
    master_N: torch.Tensor
    """fp32 master: ``param_N`` itself for fp32 parameters, else an fp32 copy."""
    param: nn.Parameter
    """The parameter the segment is part of."""
    start: int
    """Where the segment starts among the parameter's elements (flattened)."""


@dataclass(eq=False)
class _Bucket:
    """Whole parameters of one family and dtype whose gradients are reduced by one collective."""

    family: ParamFamily
    """Family of every parameter in the bucket."""
    params: list[nn.Parameter]
    """Parameters in buffer order."""
    offsets: list[int]
    """Start of each parameter inside the bucket."""
    comm: _FamilyComm
    """Group and divisor of the family."""
    shard: bool
    """Reduce-scatter and keep a 1/n share (ZeRO-1) instead of all-reducing."""
    param_N: torch.Tensor
    """View of the flat parameter buffer (padding included)."""
    grad_N: torch.Tensor
    """View of the flat gradient buffer (padding included)."""
    grad_shard_M: torch.Tensor
    """Reduced gradient of this rank's share: the reduce-scatter output, or ``grad_N`` itself."""
    ready: set = field(default_factory=set)
    """Parameters whose gradient is complete this step (armed steps only)."""
    work: dist.Work | None = None
    """In-flight collective."""
    launched: bool = False
    """Whether this step's reduction was issued."""

    @property
    def share(self) -> range:
        """Bucket positions whose update this rank owns."""
        if not self.shard:
            return range(self.grad_N.numel())
        size = self.grad_N.numel() // self.comm.size
        return range(self.comm.rank * size, (self.comm.rank + 1) * size)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    @property
    def counts_toward_norm(self) -> bool:
        """Whether this rank's ``grad_shard_M`` enters the global norm: a share is its owner's alone; a
        replicated bucket is counted on the first rank of its group only."""
        return self.shard or self.comm.rank == 0

    def launch_reduce(self) -> None:
        if self.comm.divisor != 1:
            self.grad_N.div_(self.comm.divisor)
        if self.comm.group is not None:
            if self.shard:
                self.work = _reduce_scatter(self.grad_shard_M, self.grad_N, group=self.comm.group, async_op=True)
            else:
                self.work = dist.all_reduce(self.grad_N, group=self.comm.group, async_op=True)
        self.launched = True

    def launch_gather(self) -> None:
        if self.shard and self.comm.group is not None:
            # In place: the input is this rank's chunk of the output (supported by NCCL and gloo).
            share = self.share
            self.work = _all_gather(
                self.param_N, self.param_N[share.start : share.stop], group=self.comm.group, async_op=True
            )

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def reset(self) -> None:
        self.ready.clear()
        self.launched = False


def _plan_buckets(params: list[nn.Parameter], families: dict[int, ParamFamily], bucket_elements: int):
    """Group parameters (in backward order) into buckets of one family and dtype.

    Returns (key, params) pairs ordered by where each bucket closes in the walk, which approximates
    the order buckets complete in backward and is the fixed launch order.
    """
    open_buckets: dict[tuple, list[nn.Parameter]] = {}
    open_sizes: dict[tuple, int] = {}
    closed: list[tuple[tuple, list[nn.Parameter]]] = []
    for param in params:
        key = (families[id(param)], param.dtype, param.device)
        open_buckets.setdefault(key, []).append(param)
        open_sizes[key] = open_sizes.get(key, 0) + param.numel()
        if open_sizes[key] >= bucket_elements:
            closed.append((key, open_buckets.pop(key)))
            del open_sizes[key]
    closed.extend(open_buckets.items())
    return closed


def _padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def _alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: every parameter view starts on a 16-byte boundary, as CUDA's grouped
    GEMM (and vectorised kernels generally) need of their operands' data pointers."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def _aligned_offsets(params: list[nn.Parameter], dtype: torch.dtype) -> list[int]:
    """Start of each parameter in a bucket, then the end of the last one."""
    offsets, offset = [], 0
    for param in params:
        offsets.append(offset)
        offset = _padded(offset + param.numel(), _alignment(dtype))
    return [*offsets, offsets[-1] + params[-1].numel() if params else 0]


@torch.no_grad()
def _build_buckets(
    plan: list[tuple[tuple, list[nn.Parameter]]],
    comms: dict[ParamFamily, _FamilyComm],
    shard: bool,
    grad_dtype: GradDtype,
) -> list[_Bucket]:
    """Allocate one flat parameter and gradient buffer per (family, dtype, device) and re-point params."""
    sizes = [
        _padded(_aligned_offsets(params, key[1])[-1], comms[key[0]].size * _alignment(key[1])) for key, params in plan
    ]
    totals: dict[tuple, int] = {}
    for (key, _), size in zip(plan, sizes):
        totals[key] = totals.get(key, 0) + size

    def grad_buffer_dtype(param_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if grad_dtype is GradDtype.FP32 else param_dtype

    # Offsets are aligned for the parameter's dtype, whose alignment (in elements) is a multiple of
    # fp32's, so the fp32 gradient views are aligned too.
    flat = {
        key: (
            torch.zeros(n, dtype=key[1], device=key[2]),
            torch.zeros(n, dtype=grad_buffer_dtype(key[1]), device=key[2]),
        )
        for key, n in totals.items()
    }
    cursor = dict.fromkeys(totals, 0)
    buckets = []
    for (key, params), size in zip(plan, sizes):
        comm = comms[key[0]]
        param_flat, grad_flat = flat[key]
        start = cursor[key]
        cursor[key] += size
        param_N, grad_N = param_flat[start : start + size], grad_flat[start : start + size]
        *offsets, _ = _aligned_offsets(params, key[1])
        for param, offset in zip(params, offsets):
            _rehome(param, param_N[offset : offset + param.numel()], grad_N[offset : offset + param.numel()])
        separate_output = shard and comm.group is not None
        grad_shard_M = grad_N.new_zeros(size // comm.size) if separate_output else grad_N
        buckets.append(_Bucket(key[0], params, offsets, comm, shard, param_N, grad_N, grad_shard_M))
    return buckets


def _rehome(param: nn.Parameter, param_view: torch.Tensor, grad_view: torch.Tensor) -> None:
    """Move a parameter's values (and any gradient) into buffer views without replacing the object."""
    param_view.copy_(param.data.reshape(-1))
    if param.grad is not None:
        grad_view.copy_(param.grad.reshape(-1))
    param.data = param_view.view_as(param)


def _segments(bucket: _Bucket) -> list[_Segment]:
    """Cut this rank's share of a bucket at parameter boundaries."""
    share = bucket.share
    segments = []
    for param, start in zip(bucket.params, bucket.offsets):
        lo, hi = max(start, share.start), min(start + param.numel(), share.stop)
        if lo >= hi:
            continue
        param_N = bucket.param_N[lo:hi]
        grad_N = bucket.grad_shard_M[lo - share.start : hi - share.start]
        master_N = param_N if param_N.dtype == torch.float32 else param_N.float()
        segments.append(_Segment(bucket.family, param.ndim >= 2, param_N, grad_N, master_N, param, lo - start))
    return segments


class DataParallelOptimizer:
    """DDP gradient buffers with backward overlap, clipping, and AdamW over fp32 masters (optionally ZeRO-1).

    Per step: ``zero_grad()``; ``arm_overlap(m)`` for a step of m backwards; forward/backward each
    microbatch; ``step()`` (which calls ``finish_grad_sync()`` if it was not called). The gradient a
    parameter has accumulated is ``grad_view(param)``; ``param.grad`` is that view when the buffer
    has the parameter's dtype, and None between backwards otherwise. Use ``zero_grad()`` of this
    class, not the model's (a replaced gradient is copied back into its view, but only when its hook
    runs; a weight whose GEMM adds into ``main_grad`` raises instead). With ZeRO-1 only this rank's share of the reduced gradient is kept (in the bucket's
    reduce-scatter output); the view then holds this rank's local, scaled gradient.

    ``accumulate_in_gemm``: each parameter's view is also its ``main_grad``, which the experts' and the
    dense projections' weight-gradient GEMMs add into directly (Megatron's name and convention); False keeps every gradient on the
    way through ``.grad`` (the reference path).
    """

    def __init__(
        self,
        model: nn.Module,
        groups: ProcessGroups | None,
        config: OptimizerConfig,
        shard: bool = False,
        bucket_elements: int = 2**22,
        grad_dtype: GradDtype = GradDtype.FP32,
        accumulate_in_gemm: bool = True,
    ):
        if bucket_elements < 1:
            raise ValueError(f"bucket_elements: must be >= 1, got {bucket_elements}")
        self.shard = shard
        self.max_grad_norm = config.max_grad_norm
        # The norm's squared sum adds up over every rank: experts over ep, stages over pp.
        self._norm_group = None if groups is None or dist.get_world_size() == 1 else dist.group.WORLD
        comms = _family_comms(groups)
        by_family = param_families(model)
        family_of = {id(p): family for family, params in by_family.items() for p in params}
        in_backward_order = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        plan = _plan_buckets(in_backward_order, family_of, bucket_elements)
        self.buckets = _build_buckets(plan, comms, shard, GradDtype(grad_dtype))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._grad_views = {
            id(p): b.grad_N[offset : offset + p.numel()].view_as(p)
            for b in self.buckets
            for p, offset in zip(b.params, b.offsets)
        }
        for param in in_backward_order:
            view = self._grad_views[id(param)]
            param.grad = view if view.dtype == param.dtype else None
            if accumulate_in_gemm and view.dtype == torch.float32:
                # Where a weight's gradient GEMM can add into the buffer itself (the experts', the dense
                # projections'), it does (``moe_engine.weight_grad_split``): no gradient reaches ``.grad``.
                # Only fp32 buffers: the kernel adds in fp32 (a bf16 buffer would take its two-pass path).
                param.main_grad = view  # type: ignore[attr-defined]
            elif hasattr(param, "main_grad"):
                del param.main_grad  # an earlier optimizer's buffer
        self._segments_by_bucket = [_segments(b) for b in self.buckets]
        self.segments = [seg for segments in self._segments_by_bucket for seg in segments]
        self.inner = build_adamw(
            [
                {"params": [s.master_N for s in self.segments if s.decay], "weight_decay": config.weight_decay},
                {"params": [s.master_N for s in self.segments if not s.decay], "weight_decay": 0.0},
            ],
            config,
        )
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in in_backward_order]
        self._backwards: dict[int, int] = {}
        self._expected_backwards = 0
        self._next_launch = 0
        self._synced = False
        self.last_grad_norm: torch.Tensor | None = None
        """The global gradient norm of the last step, before clipping (fp32 scalar on the device)."""
        self.sync_observer: SyncObserver | None = None
        """Told as this optimizer's collectives launch and complete (``SyncObserver``); None: nobody is."""

    @property
    def launched_buckets(self) -> int:
        """Buckets whose reduction was issued this step (for tests and overlap statistics)."""
        return sum(b.launched for b in self.buckets)

    def grad_view(self, param: nn.Parameter) -> torch.Tensor:
        """The gradient ``param`` has accumulated this step, in the gradient buffer's dtype."""
        return self._grad_views[id(param)]

    def arm_overlap(self, backwards: int = 1) -> None:
        """Launch each bucket's reduction once all its parameters have had ``backwards`` gradients this step
        (call after ``zero_grad`` and before the first backward; the gradients must then be final)."""
        if backwards < 1:
            raise ValueError(f"backwards: must be >= 1, got {backwards}")
        self._expected_backwards = backwards

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            # The gradient would land (or, added by its GEMM, has landed) in a buffer that is being or
            # was reduced: this step's gradients are wrong either way.
            raise RuntimeError(
                "a gradient arrived after its bucket was reduced: arm_overlap(m) needs exactly m backwards "
                "per step, and zero_grad() or step() before the next one"
            )
        self._accumulate(param)
        if not self._expected_backwards:
            return
        seen = self._backwards[id(param)] = self._backwards.get(id(param), 0) + 1
        if seen == self._expected_backwards:
            bucket.ready.add(param)
            self._launch_complete_buckets()

    @torch.no_grad()
    def _accumulate(self, param: nn.Parameter) -> None:
        view = self._grad_views[id(param)]
        if param.grad is None:
            # The GEMM added it to ``main_grad``, the view. Where dtypes agree the view was ``.grad``:
            # someone took it away (``model.zero_grad()``), and the buffer they meant to clear was not.
            if view.dtype == param.dtype and getattr(param, "main_grad", None) is view:
                raise RuntimeError(
                    "a parameter's gradient view was replaced by None (model.zero_grad()?) while its GEMM adds "
                    "into the gradient buffer: clear gradients with DataParallelOptimizer.zero_grad()"
                )
            return
        if param.grad is view:
            return
        if view.dtype == param.dtype:
            # Someone replaced the gradient (set_to_none, or an assignment): put it back in the buffer.
            view.copy_(param.grad)
            param.grad = view
        else:
            view.add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def _gather_hookless_grads(self) -> None:
        """Move into the buffer every gradient that reached ``param.grad`` past autograd's accumulator,
        hence past the hooks: torch's zero-bubble weight phase (``stage_backward_weight``) adds the
        weights' gradients to ``.grad`` itself. Where the buffer has the parameter's dtype it added to
        the view in place; otherwise the gradient sits in ``.grad`` until moved here."""
        for bucket in self.buckets:
            for param in bucket.params:
                if param.grad is None or param.grad is self._grad_views[id(param)]:
                    continue
                if bucket.launched:
                    raise RuntimeError("a gradient arrived after its bucket was reduced (past the hooks)")
                self._accumulate(param)

    def _launch_complete_buckets(self) -> None:
        # In the fixed order only: a complete bucket waits for earlier incomplete ones.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, index: int) -> None:
        if self.sync_observer is not None:
            self.sync_observer.reduce_launched(index)
        self.buckets[index].launch_reduce()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch every reduction not launched yet (in order) and wait for all of them."""
        if self._synced:
            return
        self._gather_hookless_grads()
        if self.sync_observer is not None:
            self.sync_observer.backward_ended()
        for index in range(self._next_launch, len(self.buckets)):
            self._launch(index)
        self._next_launch = len(self.buckets)
        for bucket in self.buckets:
            bucket.wait()
        if self.sync_observer is not None:
            self.sync_observer.reductions_waited()
        self._synced = True

    @torch.no_grad()
    def clip_grad_norm(self) -> torch.Tensor:
        """Scale the reduced gradients so their global norm is at most ``max_grad_norm``; returns the norm
        before clipping. Call after ``finish_grad_sync``."""
        shares = [b.grad_shard_M for b in self.buckets if b.grad_shard_M.numel()]
        counted = [g for b in self.buckets if b.counts_toward_norm and (g := b.grad_shard_M).numel()]
        device = shares[0].device if shares else torch.device("cpu")
        square = torch.zeros((), dtype=torch.float32, device=device)
        if counted:
            square = torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float32)).square().sum()
        if self._norm_group is not None:
            dist.all_reduce(square, group=self._norm_group)
        norm = square.sqrt()
        coefficient = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        for dtype in {g.dtype for g in shares}:
            torch._foreach_mul_([g for g in shares if g.dtype == dtype], coefficient.to(dtype))
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """Reduce gradients (if not done), clip, update this rank's share, all-gather it (ZeRO-1)."""
        self.finish_grad_sync()
        if self.max_grad_norm > 0:
            self.last_grad_norm = self.clip_grad_norm()
        # One bucket at a time (AdamW skips parameters without a gradient, and its update is per
        # parameter): the fp32 copies of low-precision gradients and AdamW's temporaries then
        # never exceed one bucket's share, instead of the whole model's. A bucket's gather launches
        # as soon as its share is written, under the next buckets' updates.
        for index, (bucket, segments) in enumerate(zip(self.buckets, self._segments_by_bucket)):
            for seg in segments:
                seg.master_N.grad = seg.grad_N if seg.master_N.dtype == seg.grad_N.dtype else seg.grad_N.float()
            self.inner.step()
            for seg in segments:
                seg.master_N.grad = None
                if seg.master_N is not seg.param_N:
                    seg.param_N.copy_(seg.master_N)
            if self.sync_observer is not None:
                self.sync_observer.gather_launched(index)
            bucket.launch_gather()
        if self.sync_observer is not None:
            self.sync_observer.updates_ended()
        for bucket in self.buckets:
            bucket.wait()
        if self.sync_observer is not None:
            self.sync_observer.gathers_waited()
        self._reset_sync()

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the gradient buffers (the views stay in place) and forget this step's sync state."""
        for bucket in self.buckets:
            bucket.grad_N.zero_()
            for param in bucket.params:
                view = self._grad_views[id(param)]
                param.grad = view if view.dtype == param.dtype else None
        self._reset_sync()

    def _reset_sync(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._backwards.clear()
        self._next_launch = 0
        self._expected_backwards = 0
        self._synced = False

    def bucket_bytes(self) -> list[int]:
        """Bytes each bucket's reduction sends in (the whole gradient bucket, padding included)."""
        return [b.grad_N.numel() * b.grad_N.element_size() for b in self.buckets]

    def state_bytes(self, family: ParamFamily | None = None) -> int:
        """Bytes this rank holds: fp32 masters that are not the parameter itself, plus Adam moments."""
        total = 0
        for seg in self.segments:
            if family is not None and seg.family is not family:
                continue
            if seg.master_N is not seg.param_N:
                total += seg.master_N.numel() * seg.master_N.element_size()
            state = self.inner.state.get(seg.master_N, {})
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.ndim > 0)
        return total

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradient buffers (one view per bucket) and the ZeRO-1 reduce-scatter outputs."""
        tensors = [b.grad_N for b in self.buckets]
        tensors += [b.grad_shard_M for b in self.buckets if b.grad_shard_M is not b.grad_N]
        return tensors

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors the optimizer keeps across steps beyond the parameter and gradient buffers.

        fp32 masters that are not the parameters, Adam moments, and the ZeRO-1 reduce-scatter
        outputs (gradient memory, not counted by ``state_bytes``).
        """
        tensors = [seg.master_N for seg in self.segments if seg.master_N is not seg.param_N]
        moments = (t for state in self.inner.state.values() for t in state.values() if torch.is_tensor(t))
        tensors += [t for t in moments if t.ndim > 0]
        tensors += [b.grad_shard_M for b in self.buckets if b.grad_shard_M is not b.grad_N]
        return tensors

    def remove_hooks(self) -> None:
        """Detach from the model: no hooks, and no ``main_grad`` for a GEMM to add into."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for bucket in self.buckets:
            for param in bucket.params:
                if getattr(param, "main_grad", None) is self._grad_views[id(param)]:
                    del param.main_grad  # type: ignore[attr-defined]


class SyncObserver(Protocol):
    """What a ``DataParallelOptimizer`` tells its ``sync_observer``, on the host, as a step's collectives run.

    Per step, in this order: ``reduce_launched`` per bucket (in index order, during backward for the
    buckets ``arm_overlap`` completes), ``backward_ended`` as ``finish_grad_sync`` starts (before it
    launches what is left), ``reductions_waited``; then in ``step``, ``gather_launched`` per bucket as
    its update is written (only ZeRO-1 issues a gather), ``updates_ended`` and ``gathers_waited``.
    A launch is told just before it is issued; nothing waits for the device.
    """

    def reduce_launched(self, bucket: int) -> None: ...
    def backward_ended(self) -> None: ...
    def reductions_waited(self) -> None: ...
    def gather_launched(self, bucket: int) -> None: ...
    def updates_ended(self) -> None: ...
    def gathers_waited(self) -> None: ...


def build_data_parallel_optimizer(
    model: nn.Module, groups: ProcessGroups | None, config: OptimizerConfig, parallel: ParallelConfig
) -> DataParallelOptimizer:
    """The optimizer a ``ParallelConfig`` asks for (ZeRO-1 or not, its bucket size, its gradient dtype)."""
    return DataParallelOptimizer(
        model,
        groups,
        config,
        shard=parallel.optimizer_sharding is OptimizerSharding.ZERO1,
        bucket_elements=parallel.bucket_elements,
        grad_dtype=parallel.grad_dtype,
        accumulate_in_gemm=parallel.accumulate_in_gemm,
    )
