"""Join a fake world: this process is rank r of N, and collectives do nothing (torch's ``fake`` backend)."""

from __future__ import annotations

import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401


def join_fake_world(rank: int, world_size: int) -> None:
    """Initialise torch.distributed as ``rank`` of ``world_size`` with the ``fake`` backend.

    The fake backend accepts every collective and returns at once without moving data, so the
    rank's code runs unchanged; its outputs are whatever the caller puts there.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; a proxy needs a process of its own")
    # Importing the module registers the backend (it ships with torch but is not imported by default).

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


def leave_fake_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
