"""A rank's training state as a torch.distributed.checkpoint (DCP) state dict: save, load, reshard.
The keys, the FSDP2 format and how boxes reach DCP's planner: docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.router import Router

FORMAT_BUFFERS = "buffers"
"""Checkpoint of a ``DataParallelOptimizer`` (plain buffers or ZeRO-1, any ep/pp)."""
FORMAT_FSDP = "fsdp2"
"""Checkpoint of an FSDP2 layout (DCP's state-dict helpers)."""


@dataclass(eq=False)
class GlobalChunk:
    """The box of a whole-model tensor that this rank holds: ``local`` sits at ``offsets`` of ``global_shape``."""

    local: torch.Tensor
    """The rank's values: saved from, and loaded into, in place."""
    global_shape: torch.Size
    """Shape of the tensor over every rank."""
    offsets: torch.Size
    """Where ``local`` starts in it, per dimension."""

    def size(self) -> torch.Size:
        # DCP's load plan compares it with the saved tensor's size.
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self.global_shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


@dataclass(frozen=True)
class Opaque:
    """A value DCP stores whole (pickled) and never walks into: scalars, lists, generator states."""

    value: Any


def _resolve(state_dict: dict[str, Any], index: MetadataIndex, fallback: Callable[[MetadataIndex], Any]) -> Any:
    obj = state_dict.get(index.fqn)
    return obj.local if isinstance(obj, GlobalChunk) else fallback(index)


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also writes ``GlobalChunk`` values."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _resolve(self.state_dict, index, super().lookup_object)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also loads into ``GlobalChunk`` values."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up walks the values and drops any type it does not know: keep the chunks
        # out of its way and put them back (top-level keys flatten to themselves).
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, GlobalChunk)}
        super().set_up_planner({**state_dict, **dict.fromkeys(chunks)}, metadata, is_coordinator)
        self.original_state_dict = state_dict
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _resolve(self.state_dict, index, super().lookup_tensor)


class HostStager(AsyncStager):
    """DCP ``AsyncStager``: a host copy of every tensor of the state dict, taken before ``stage`` returns."""

    @property
    def should_synchronize_after_execute(self) -> bool:
        # ``stage`` copies synchronously: nothing is left to wait for once it returns.
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {key: _host_copy(value) for key, value in state_dict.items()}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns with the copy made."""

    def close(self) -> None:
        """Holds no buffers or threads between saves."""


def _host_copy(value: Any) -> Any:
    if isinstance(value, GlobalChunk):
        return dataclasses.replace(value, local=value.local.detach().to("cpu", copy=True))
    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Naming a rank's tensors by the whole model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Placement:
    """Where a rank's parameter sits in the model's tensor of the same name."""

    fqn: str
    global_shape: torch.Size
    offsets: torch.Size

    @property
    def flat_start(self) -> int:
        """First element of the local tensor in the flattened global one (only dim 0 is ever split)."""
        return self.offsets[0] * math.prod(self.global_shape[1:]) if self.global_shape else 0


def parameter_placements(module: nn.Module) -> dict[int, _Placement]:
    """Every parameter of ``module`` (a model or a rank's stages, under the model's names) by id."""
    placements: dict[int, _Placement] = {}
    for module_name, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{name}" if module_name else name
            shape, offsets = param.shape, torch.Size([0] * param.ndim)
            if isinstance(sub, GroupedExperts):
                shape = torch.Size([sub.total_experts, *param.shape[1:]])
                offsets = torch.Size([sub.global_experts.start, *offsets[1:]])
            placements.setdefault(id(param), _Placement(fqn, shape, offsets))
    return placements


def _chunk(placement: _Placement, local: torch.Tensor) -> GlobalChunk:
    return GlobalChunk(local, placement.global_shape, placement.offsets)


def _flat_chunk(placement: _Placement, local_N: torch.Tensor, start: int) -> GlobalChunk:
    """A run of ``local_N`` elements starting ``start`` elements into the rank's (local) parameter."""
    numel = math.prod(placement.global_shape)
    return GlobalChunk(local_N, torch.Size([numel]), torch.Size([placement.flat_start + start]))


def _routers(module: nn.Module) -> dict[str, Router]:
    return {name: m for name, m in module.named_modules() if isinstance(m, Router)}


def _routing_key(dp_rank: int, name: str) -> str:
    return f"routing/dp{dp_rank}/{name}"


# --------------------------------------------------------------------------------------------
# The state dict of a ParallelTrainer
# --------------------------------------------------------------------------------------------


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Adam state of ``param``, created (zero moments, step 0) when it has none yet, so a load has
    somewhere to write."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _buffer_state(trainer) -> dict[str, Any]:
    """Model, masters and moments of a ``DataParallelOptimizer`` rank, as ``GlobalChunk`` values."""
    module, optimizer = trainer.rank_model.module, trainer.optimizer
    placements = parameter_placements(module)
    state: dict[str, Any] = {}
    for param in module.parameters():
        placement = placements[id(param)]
        state[f"model/{placement.fqn}"] = _chunk(placement, param.detach())
    for name, buffer in module.state_dict(keep_vars=True).items():
        if name not in {p.fqn for p in placements.values()}:
            state[f"model/{name}"] = GlobalChunk(buffer.detach(), buffer.shape, torch.Size([0] * buffer.ndim))
    for seg in optimizer.segments:
        placement = placements[id(seg.param)]
        if seg.master_N is not seg.param_N:
            state[f"optim/master/{placement.fqn}"] = _flat_chunk(placement, seg.master_N, seg.start)
        adam = _adam_state(optimizer.inner, seg.master_N)
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"optim/{moment}/{placement.fqn}"] = _flat_chunk(placement, adam[moment], seg.start)
    return state


def _fsdp_state(trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.rank_model.module, trainer.optimizer)
    return {"fsdp/model": model_sd, "fsdp/optim": optim_sd}


def _optimizer_scalars(trainer) -> dict[str, Any]:
    inner = trainer.optimizer if trainer.fsdp else trainer.optimizer.inner
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    return {"optim/step": Opaque(max(steps, default=0.0)), "optim/lr": Opaque([g["lr"] for g in inner.param_groups])}


def checkpoint_format(trainer) -> str:
    return FORMAT_FSDP if trainer.fsdp else FORMAT_BUFFERS


def trainer_state(trainer, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dict DCP saves for this rank of ``trainer`` (a ``ParallelTrainer``): live references,
    plus ``extra`` as ``train/<key>`` entries (every rank passes the same)."""
    state = _fsdp_state(trainer) if trainer.fsdp else _buffer_state(trainer)
    state.update(_optimizer_scalars(trainer))
    dp_rank = trainer.groups.coords.dp_rank if trainer.groups else 0
    for name, router in _routers(trainer.rank_model.module).items():
        routing = router.routing_state()
        if routing is not None:
            device, generator_state = routing
            state[_routing_key(dp_rank, name)] = Opaque((str(device), generator_state))
    for key, value in (extra or {}).items():
        state[f"train/{key}"] = Opaque(value)
    return state


# --------------------------------------------------------------------------------------------
# Save and load
# --------------------------------------------------------------------------------------------


def save(
    trainer, path: str | Path, extra: dict[str, Any] | None = None, process_group: dist.ProcessGroup | None = None
) -> None:
    """Write this rank's share of the training state into ``path`` (every rank calls it); returns when
    the checkpoint, metadata included, is complete."""
    dcp.save(
        trainer_state(trainer, extra),
        checkpoint_id=str(path),
        planner=ChunkSavePlanner(),
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )


def async_save(
    trainer, path: str | Path, extra: dict[str, Any] | None = None, process_group: dist.ProcessGroup | None = None
) -> Future:
    """Copy the state to the host and write it in a background thread; the future completes with the
    checkpoint. ``process_group`` should be one that training does not use (a gloo group of its own):
    the background thread runs DCP's collectives on it while training runs its own."""
    response = dcp.async_save(
        trainer_state(trainer, extra),
        checkpoint_id=str(path),
        planner=ChunkSavePlanner(),
        process_group=process_group,
        async_stager=HostStager(),
        no_dist=not dist.is_initialized(),
    )
    # An AsyncSaveResponse comes only from a stager whose ``stage`` returns a future; HostStager's copies in place.
    return cast(Future, response)


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit this model or layout (one line, naming the first difference)."""


def _check_fits(state: dict[str, Any], metadata) -> None:
    saved = metadata.state_dict_metadata
    for key, value in state.items():
        if not isinstance(value, GlobalChunk):
            continue
        if key not in saved:
            raise CheckpointMismatch(f"{key} is not in the checkpoint")
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != tuple(value.global_shape):
            raise CheckpointMismatch(
                f"{key} has shape {tuple(size)} in the checkpoint, {tuple(value.global_shape)} here"
            )


def load(
    trainer, path: str | Path, extra_keys: tuple[str, ...] = (), process_group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``trainer`` (every rank calls it), resharding as needed;
    returns the ``train/<key>`` entries named in ``extra_keys``."""
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    fsdp_saved = any(key.startswith("fsdp/") for key in saved)
    if fsdp_saved != trainer.fsdp:
        kinds = {True: "an FSDP2 layout", False: "a layout without FSDP"}
        raise CheckpointMismatch(f"saved by {kinds[fsdp_saved]}: it loads only into {kinds[fsdp_saved]}")
    state = trainer_state(trainer)
    _check_fits(state, metadata)
    # A routing stream the checkpoint lacks (a dp rank it did not have, a stream not yet started)
    # starts from its seed; train/ entries are read as asked.
    state = {k: v for k, v in state.items() if not k.startswith("routing/") and not k.startswith("train/")}
    for name in _routers(trainer.rank_model.module):
        key = _routing_key(trainer.groups.coords.dp_rank if trainer.groups else 0, name)
        if key in saved:
            state[key] = None
    for key in extra_keys:
        state[f"train/{key}"] = None
    dcp.load(
        state,
        storage_reader=reader,
        planner=ChunkLoadPlanner(),
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )
    _apply_loaded(trainer, state)
    return {key: state[f"train/{key}"].value for key in extra_keys}


@torch.no_grad()
def _apply_loaded(trainer, state: dict[str, Any]) -> None:
    """What loading in place cannot do: scalars, the FSDP helpers' apply step, routing streams, and the
    copies (bf16 parameters from their masters) the optimizer keeps in step."""
    step, lrs = float(state["optim/step"].value), state["optim/lr"].value
    if trainer.fsdp:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            trainer.rank_model.module,
            trainer.optimizer,
            model_state_dict=state["fsdp/model"],
            optim_state_dict=state["fsdp/optim"],
        )
        inner = trainer.optimizer
    else:
        inner = trainer.optimizer.inner
        for seg in trainer.optimizer.segments:
            if seg.master_N is not seg.param_N:
                seg.param_N.copy_(seg.master_N)
    for group, lr in zip(inner.param_groups, lrs):
        group["lr"] = lr
    for adam in inner.state.values():
        if "step" in adam:
            adam["step"].fill_(step)
    routers = _routers(trainer.rank_model.module)
    dp_rank = trainer.groups.coords.dp_rank if trainer.groups else 0
    for name, router in routers.items():
        saved = state.get(_routing_key(dp_rank, name))
        if saved is not None:
            device, generator_state = saved.value
            router.set_routing_state((torch.device(device), generator_state))
