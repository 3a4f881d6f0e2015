"""Trace one rank's training step at the scenario's full size without allocating it.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from bench.predict.ops import REGIONS, TensorSpec, TracedOp
from bench.run.collective_log import CollectiveRecorder
from bench.run.proxy.rank.build import build_proxy_rank
from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
from bench.scenario import Scenario
from moe_engine.config import DataParallelMode
from moe_engine.parallel.groups import ProcessGroups, build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

logger = logging.getLogger(__name__)

SHADOW_MAX_ELEMENTS = 1 << 22
"""A tensor gets a real shadow only up to this size: routing metadata is T * k or T * E elements."""

PROGRESS_EVERY_S = 15.0
"""A long trace reports its ops in a line this often (``trace_step``'s default ``on_ops``)."""

OPS_REPORT_EVERY = 1024
"""A trace tells ``on_ops`` its count of ops each time it grows by this many."""

ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1
"""The sequence number autograd gives a leaf's gradient accumulator (so that it runs first)."""


class UntraceableStep(RuntimeError):
    """The step reads a value on the host that the trace cannot know."""


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(s) for s in t.shape), str(t.dtype))


# An op's arguments nest tensors only in lists, tuples and dicts; walking those directly costs a sixth
# of a pytree flatten, and a traced step walks them a few times for each of its ~10^5 ops.
def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _map_tensors(fn, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(fn, v) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    return value


def _scalar_arguments(func, args, kwargs) -> tuple[tuple[str, Any], ...]:
    named = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, (bool, int, float)):
            named.append((arg.name, value))
    return tuple(named)


class ModuleLocator:
    """Where each op of a traced step runs, as ``TracedOp.location`` records it.

    - Inside a named scope (``scope``: the optimizer's step, the gradient sync, the proxy's
      fabrication of its peers' traffic, the expert-bias update): ``@name``, the innermost scope.
    - Inside an FSDP ``record_function`` scope (``FSDP::...``, FSDP2's gathers, reductions and their
      copies): ``@fsdp``.
    - Inside a module's forward, a recomputed one in the backward included: the class names of the
      modules on the call stack, outermost first, joined by ``/`` (``Transformer/Block/MoELayer/Router``);
      after a child's forward has returned, the innermost module's name is followed by ``>`` and the
      child's (``MoELayer>GroupedExperts``: the MoE layer's own ops after its experts ran). Global
      forward pre- and post-hooks keep the stack.
    - In the backward otherwise: the location at which the autograd node running the op was created
      in the forward. Autograd numbers the nodes a thread creates in order (the sequence number); the
      locator keeps the location at each number where it changed, so each backward op lands where
      the forward op that made its node ran. A leaf's gradient accumulator (sequence number
      ``ACCUMULATE_GRAD_SEQUENCE_NR``, where the gradient buffers' hooks run): ``@accumulate_grad``.
    - Anywhere else (the trainer's own code, outside every module and scope): ``""``.

    A fully recomputed block is re-entered through its forward function, not its module call: its
    children's ops get their own locations, its own few (the residual adds) the location of the node
    whose saved tensor started the recompute.
    """

    def __init__(self):
        self._frames: list[list] = []
        """[class name, the last child whose forward returned (or None)] per module on the stack."""
        self._scopes: list[str] = []
        self._sequence_nrs: list[int] = []
        self._locations: list[str] = []
        self.current = ""
        """The module stack's location now."""
        self._handles: list = []

    def __enter__(self) -> Self:
        self._handles = [
            register_module_forward_pre_hook(self._entered),
            register_module_forward_hook(self._returned, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _entered(self, module, args) -> None:
        self._frames.append([type(module).__name__, None])
        self._moved()

    def _returned(self, module, args, output) -> None:
        name = self._frames.pop()[0]
        if self._frames:
            self._frames[-1][1] = name
        self._moved()

    def _moved(self) -> None:
        location = "/".join(frame[0] for frame in self._frames)
        if self._frames and self._frames[-1][1] is not None:
            location += ">" + self._frames[-1][1]
        self.current = location
        # Nodes created from now on are numbered from here: the latest location at a number wins.
        number = torch._C._autograd._get_sequence_nr()
        if self._sequence_nrs and self._sequence_nrs[-1] == number:
            self._locations[-1] = location
        else:
            self._sequence_nrs.append(number)
            self._locations.append(location)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def locate(self, node, in_fsdp: bool) -> str:
        """The location of an op dispatched now, inside autograd ``node`` (None in the forward)."""
        if self._scopes:
            return "@" + self._scopes[-1]
        if in_fsdp:
            return "@fsdp"
        if self._frames or node is None:
            return self.current
        number = node._sequence_nr()
        if number == ACCUMULATE_GRAD_SEQUENCE_NR:
            return "@accumulate_grad"
        i = bisect.bisect_right(self._sequence_nrs, number) - 1
        return self._locations[i] if i >= 0 else ""


class StepTracer(TorchDispatchMode):
    """Records ``TracedOp``s; keeps real shadows of small fake tensors (docs/projection-formulas.md)."""

    def __init__(self, on_ops: Callable[[int, str], None] = lambda count, stage: None):
        super().__init__()
        self.ops: list[TracedOp] = []
        self.stage = "other"
        self.recording = True
        """False while the rank is built: shadows are kept (a device mesh reads its ranks), ops not recorded."""
        self.locator = ModuleLocator()
        self._shadows = WeakIdKeyDictionary()
        self._regions: list[tuple[str, int]] = []
        self._region_calls = 0
        self._collectives = CollectiveRecorder()
        self._on_ops = on_ops

    # ---- shadows -------------------------------------------------------------------------------

    def _shadow(self, t):
        if isinstance(t, FakeTensor):
            return self._shadows.get(t)
        return t

    def _run_shadow(self, func, args, kwargs, out) -> None:
        inputs = _tensors((args, kwargs))
        fakes = [t for t in inputs if isinstance(t, FakeTensor)]
        outs = [t for t in _tensors(out) if isinstance(t, FakeTensor)]
        if not outs and fakes and all(self._shadows.get(t) is not None for t in fakes):
            # An in-place op that returns nothing (torch._foreach_add_ of the optimizer's step counts):
            # run it on the shadows, which it updates in place.
            real_args, real_kwargs = _map_tensors(self._shadow, (args, kwargs))
            with unset_fake_temporarily():
                func(*real_args, **real_kwargs)
            return
        if not outs or any(t.numel() > SHADOW_MAX_ELEMENTS for t in outs):
            self._forget_written(func, args, kwargs)
            return
        if not self.recording and any(t.is_floating_point() for t in outs):
            # While the rank is built: integer metadata only (a device mesh's ranks), not the weights.
            return
        if any(self._shadows.get(t) is None for t in fakes):
            if func is torch.ops.aten.copy_.default and self._shadows.get(args[1]) is not None:
                # A copy overwrites its destination: the source's shadow is all it needs.
                with unset_fake_temporarily():
                    self._shadows[args[0]] = self._shadows[args[1]].to(args[0].dtype).clone().expand(args[0].shape)
                return
            self._forget_written(func, args, kwargs)
            return
        real_args, real_kwargs = _map_tensors(self._shadow, (args, kwargs))
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        for fake, real in zip(_tensors(out), _tensors(real_out)):
            if not isinstance(fake, FakeTensor):
                continue
            if real.dtype == fake.dtype and real.shape == fake.shape:
                self._shadows[fake] = real
            else:
                self._shadows.pop(fake, None)

    def _data_dependent(self, func, args, kwargs):
        """An op whose output shape depends on values (nonzero): run on the shadows, faked from the result."""
        inputs = [t for t in _tensors((args, kwargs)) if isinstance(t, FakeTensor)]
        if not inputs or any(self._shadows.get(t) is None for t in inputs):
            raise UntraceableStep(f"{func} needs the values of tensors whose values the trace does not know")
        real_args, real_kwargs = _map_tensors(self._shadow, (args, kwargs))
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        fake_mode = inputs[0].fake_mode
        out = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, real_out)
        for fake, real in zip(_tensors(out), _tensors(real_out)):
            self._shadows[fake] = real
        return out

    def _forget_written(self, func, args, kwargs) -> None:
        # An in-place op whose inputs are not all known leaves its destination unknown too.
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in _tensors(value):
                    self._shadows.pop(t, None)

    def _host_read(self, t: torch.Tensor):
        shadow = self._shadows.get(t)
        if shadow is None:
            raise UntraceableStep(
                "the step reads a tensor's value on the host that depends on activations (e.g. the "
                "split sizes of sync dispatch under learned routing); a traced step knows routes only "
                "from the random, balanced and skewed routing modes"
            )
        with unset_fake_temporarily():
            return shadow.item()

    # ---- recording -----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            value = self._host_read(args[0])
            self._record(func, args, kwargs, None)
            return value
        self._track_region(func, args)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self._data_dependent(func, args, kwargs)
            self._record(func, args, kwargs, out)
            return out
        writes_in_place = not _tensors(out) and any(isinstance(t, FakeTensor) for t in _tensors((args, kwargs)))
        if (
            writes_in_place
            or any(isinstance(t, FakeTensor) for t in _tensors(out))
            or func._schema.name == "aten::copy_"
        ):
            self._run_shadow(func, args, kwargs, out)
        self._record(func, args, kwargs, out)
        return out

    def _track_region(self, func, args) -> None:
        name = func._schema.name
        if name == "profiler::_record_function_enter_new":
            self._region_calls += 1
            self._regions.append((args[0], self._region_calls))
        elif name == "profiler::_record_function_exit" and self._regions:
            self._regions.pop()

    def _record(self, func, args, kwargs, out) -> None:
        if not self.recording or func.namespace == "prim":
            # Metadata queries that only the fake mode issues (prim.device): no kernel either way.
            return
        collective = None
        if func.namespace == "c10d":
            before = len(self._collectives.calls)
            self._collectives._record(func, args, kwargs)
            if len(self._collectives.calls) == before:
                return
            call = self._collectives.calls[-1]
            collective = {
                "op": call.op,
                "ranks": list(call.ranks),
                "nbytes": call.nbytes,
                "group_name": call.group_name,
            }
        node = torch._C._current_autograd_node()
        stage = "backward" if node is not None else self.stage
        group_rows = self._group_rows(func, args, kwargs)
        region, region_call = next(((r, c) for r, c in reversed(self._regions) if r in REGIONS), (None, None))
        in_fsdp = bool(self._regions) and any(r.startswith("FSDP::") for r, _ in self._regions)
        self.ops.append(
            TracedOp(
                name=str(func),
                inputs=tuple(_spec(t) for t in _tensors((args, kwargs))),
                outputs=tuple(_spec(t) for t in _tensors(out)),
                stage=stage,
                region=region,
                region_call=region_call,
                group_rows=group_rows,
                arguments=_scalar_arguments(func, args, kwargs) if func.namespace in ("aten", "moe_engine") else (),
                collective=collective,
                location=self.locator.locate(node, in_fsdp),
            )
        )
        if len(self.ops) % OPS_REPORT_EVERY == 0:
            self._on_ops(len(self.ops), stage)

    def _group_rows(self, func, args, kwargs) -> tuple[int, ...] | None:
        if func is torch.ops.aten._grouped_mm.default:
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
        elif str(func) == "moe_engine.grouped_wgrad_accumulate.default":
            offs = args[2] if len(args) > 2 else kwargs.get("offsets_E")
        else:
            return None
        if offs is None:
            return None
        offs = self._shadow(offs)
        if offs is None:
            return None
        with unset_fake_temporarily():
            ends = [int(v) for v in offs.tolist()]
        return tuple(b - a for a, b in zip([0, *ends[:-1]], ends))

    @contextlib.contextmanager
    def in_stage(self, stage: str, scope: str | None = None) -> Iterator[None]:
        """Ops inside are of ``stage`` (outside autograd's backward), and of location ``@scope`` if given."""
        previous, self.stage = self.stage, stage
        try:
            with self.locator.scope(scope) if scope else contextlib.nullcontext():
                yield
        finally:
            self.stage = previous


# ---- the rank's step ---------------------------------------------------------------------------


@dataclass
class StepTrace:
    """One optimizer step of one rank, as traced."""

    ops: list[TracedOp]
    """Every op in dispatch order."""
    rank: int
    """Global rank traced."""
    world_size: int
    """Ranks of the layout."""
    microbatches: int
    """Microbatches of the step."""
    tokens_per_step: int
    """Global tokens of one step."""
    group_phases: dict[str, str]
    """Process group name -> projection phase of its collectives (expert, pipeline, grad)."""
    family_groups: dict[str, str] = field(default_factory=dict)
    """dense / expert -> the group name their gradients reduce over."""
    groups: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """dp / ep / edp / pp -> the rank's group of that kind: (its name, its global ranks)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "microbatches": self.microbatches,
            "tokens_per_step": self.tokens_per_step,
            "ops": len(self.ops),
        }


def _materialize(module: nn.Module, device: torch.device) -> None:
    """``Module.to_empty`` for fake tensors (which cannot be swapped into an existing parameter)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = torch.empty_like(buffer, device=device)


@contextlib.contextmanager
def _fake_to_empty(fake: bool) -> Iterator[None]:
    if not fake:
        yield
        return
    original = nn.Module.to_empty

    def to_empty(self, *, device, recurse=True):
        _materialize(self, torch.device(device))
        return self

    # Patched on the class: the engine's builders call to_empty on modules made inside this context.
    nn.Module.to_empty = to_empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to_empty = original  # type: ignore[method-assign]


def _batch(scenario: Scenario, dp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = scenario.model.seq_len
    sequences = scenario.run.tokens_per_step // dp // seq_len
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, scenario.model.vocab_size, (sequences, seq_len), generator=generator)
    labels = torch.randint(0, scenario.model.vocab_size, (sequences, seq_len), generator=generator)
    return tokens, labels


def group_phases(groups: ProcessGroups) -> dict[str, str]:
    """Process group name -> projection phase of its collectives (``bench.predict.projection``)."""
    phases: dict[str, str] = {
        groups.dp.group_name: "grad",
        groups.edp.group_name: "grad",
        groups.ep.group_name: "expert",
        groups.pp.group_name: "pipeline",
    }
    nodes = getattr(groups, "nodes", None)
    if nodes is not None:
        # Node-aware dispatch's two levels of the expert group.
        phases |= {nodes.intra.group_name: "expert", nodes.inter.group_name: "expert"}
    return phases


def rank_groups(groups: ProcessGroups) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``StepTrace.groups`` of a rank's process groups."""
    kinds = [("dp", groups.dp), ("ep", groups.ep), ("edp", groups.edp), ("pp", groups.pp)]
    nodes = getattr(groups, "nodes", None)
    if nodes is not None:
        kinds += [("ep_intra", nodes.intra), ("ep_inter", nodes.inter)]
    return {kind: (group.group_name, tuple(dist.get_process_group_ranks(group))) for kind, group in kinds}


def _build_rank(scenario: Scenario, groups: ProcessGroups, seed: int):
    parallel = scenario.parallel_config
    if parallel.dp_mode is DataParallelMode.FSDP:
        # FSDP needs no peers simulated (the engine's FSDP mode has no expert parallelism): the real
        # build path, whose gathers and reduce-scatters move nothing on the fake world.
        return build_rank_model(
            scenario.model, parallel, groups, torch.device("cpu"), seed, recompute=scenario.recompute
        )
    return build_proxy_rank(scenario.model, parallel, groups, torch.device("cpu"), seed, recompute=scenario.recompute)


def _in_stage(owner, method: str, tracer: StepTracer, stage: str | None, scope: str) -> None:
    """``owner.method`` runs in ``stage`` (None: the caller's) and scope ``scope`` while traced."""
    original = getattr(owner, method)

    def staged(*args, **kwargs):
        with tracer.in_stage(stage or tracer.stage, scope):
            return original(*args, **kwargs)

    setattr(owner, method, staged)


def _locate_parts(trainer: ParallelTrainer, rank_model, tracer: StepTracer) -> None:
    """Name the parts of the step that run outside the model's modules (``ModuleLocator``): the
    optimizer's zeroing and step, its gradient sync inside the step, the expert-bias update, and the
    proxy's fabrication of its peers' traffic (the engine's ``fabrication`` seam)."""
    optimizer = trainer.optimizer
    for method, stage, scope in (("zero_grad", "other", "optimizer"), ("step", "optimizer", "optimizer")):
        _in_stage(optimizer, method, tracer, stage, scope)
    if hasattr(optimizer, "finish_grad_sync"):
        _in_stage(optimizer, "finish_grad_sync", tracer, None, "grad_sync")
    if hasattr(trainer, "_update_expert_bias"):
        _in_stage(trainer, "_update_expert_bias", tracer, None, "expert_bias")
    fabricators = [layer.dispatcher for layer in rank_model.moe_layers()]
    if rank_model.pipeline is not None:
        fabricators.append(rank_model.pipeline)
    for owner in fabricators:
        if hasattr(owner, "fabrication"):
            owner.fabrication = lambda: tracer.locator.scope("proxy_peers")


@contextlib.contextmanager
def rank_trainer(scenario: Scenario, rank: int = 0) -> Iterator[tuple[ParallelTrainer, torch.Tensor, torch.Tensor]]:
    """``rank`` of ``scenario``'s layout built for real as a proxy rank on a fake world, with its trainer
    and its batch: (trainer, tokens, labels). The scenario must fit this machine."""
    parallel = scenario.parallel_config
    seed = scenario.spec["routing"]["seed"]
    join_fake_world(rank, scenario.world_size)
    try:
        groups = build_process_groups(Layout(parallel))
        trainer = ParallelTrainer(_build_rank(scenario, groups, seed), parallel, groups, scenario.optimizer)
        yield (trainer, *_batch(scenario, parallel.dp, seed))
    finally:
        leave_fake_world()


def _ops_lines() -> Callable[[int, str], None]:
    """An ``on_ops`` that logs a line at most every ``PROGRESS_EVERY_S``."""
    started = reported = time.perf_counter()

    def on_ops(count: int, stage: str) -> None:
        nonlocal reported
        now = time.perf_counter()
        if now - reported >= PROGRESS_EVERY_S:
            reported = now
            logger.info(f"{count:,} ops traced ({stage}), {now - started:.0f}s")

    return on_ops


def trace_step(
    scenario: Scenario,
    rank: int = 0,
    fake: bool = True,
    on_ops: Callable[[int, str], None] | None = None,
) -> StepTrace:
    """Trace one optimizer step of ``rank`` of ``scenario``'s layout at its own sizes.

    ``fake`` False runs the step for real (the scenario must fit this machine). The process must not
    be in a process group: it joins a fake world for the duration. It logs what it builds and traces;
    ``on_ops`` (count, stage) takes its count of ops as it grows (default: a logged line now and then).
    """
    parallel = scenario.parallel_config
    world = scenario.world_size
    seed = scenario.spec["routing"]["seed"]
    threads = torch.get_num_threads()
    join_fake_world(rank, world)
    try:
        # The real work of a trace is the shadows': small tensors, on which intra-op threads only add
        # synchronisation; on a busy host it costs ~100x (a stable argsort of 32k routes: 2 ms on one
        # thread, 170 ms on two), and a traced step is made of ~10^5 such ops.
        torch.set_num_threads(1)
        groups = build_process_groups(Layout(parallel))
        tracer = StepTracer(on_ops or _ops_lines())
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        with mode, _fake_to_empty(fake), tracer:
            logger.info(f"building rank {rank}'s share ({'fake tensors' if fake else 'real tensors'})")
            tracer.recording = False
            rank_model = _build_rank(scenario, groups, seed)
            trainer = ParallelTrainer(rank_model, parallel, groups, scenario.optimizer)
            tracer.recording = True
            tokens, labels = _batch(scenario, parallel.dp, seed)
            # Once-per-step work outside the microbatches (zeroing the gradient buffers, the update)
            # gets its stage, and each part of the step outside the model its location.
            _locate_parts(trainer, rank_model, tracer)
            logger.info(f"tracing one step of {parallel.microbatches} microbatches")
            with tracer.in_stage("forward"), tracer.locator:
                trainer.step(tokens, labels)
        assert parallel.microbatches is not None  # ParallelConfig.__post_init__ resolves None to pp
        return StepTrace(
            ops=tracer.ops,
            rank=rank,
            world_size=world,
            microbatches=parallel.microbatches,
            tokens_per_step=scenario.run.tokens_per_step,
            group_phases=group_phases(groups),
            family_groups={"dense": groups.dp.group_name, "expert": groups.edp.group_name},
            groups=rank_groups(groups),
        )
    finally:
        leave_fake_world()
        torch.set_num_threads(threads)


def retarget(trace: StepTrace, scenario: Scenario, rank: int) -> StepTrace:
    """``trace`` as ``rank`` of ``scenario``'s layout records it, for a rank that runs the same ops.

    Each collective moves to ``rank``'s group of the same kind (one on the whole world stays); a message
    goes to or comes from the rank as many stages away as the traced one's. Only what names ranks and
    groups changes.
    """
    layout = Layout(scenario.parallel_config)
    join_fake_world(rank, scenario.world_size)
    try:
        groups = build_process_groups(layout)
        mine, phases = rank_groups(groups), group_phases(groups)
        family: dict[str, str] = {"dense": groups.dp.group_name, "expert": groups.edp.group_name}
    finally:
        leave_fake_world()
    kind_of = {name: kind for kind, (name, _) in trace.groups.items()}
    shift = layout.coords(rank).pp_rank - layout.coords(trace.rank).pp_rank
    traced_pp = trace.groups["pp"][1]

    def moved(op: TracedOp) -> TracedOp:
        call = op.collective
        assert call is not None  # only collectives are moved
        if call["group_name"] not in kind_of:
            if call["ranks"] != list(range(scenario.world_size)):
                raise ValueError(f"{op.name} on group {call['group_name']}, neither the world nor one of the rank's")
            return op
        name, ranks = mine[kind_of[call["group_name"]]]
        if call["op"] in ("send", "recv"):
            ranks = (rank, ranks[traced_pp.index(call["ranks"][1]) + shift])
        return dataclasses.replace(op, collective={**call, "ranks": list(ranks), "group_name": name})

    return dataclasses.replace(
        trace,
        ops=[moved(op) if op.collective is not None else op for op in trace.ops],
        rank=rank,
        group_phases=phases,
        family_groups=family,
        groups=mine,
    )
