"""Running inside an existing multi-process launch (torchrun or Slurm) instead of starting one.

When ``moe-bench run`` is itself one rank of a launch, every rank walks the same scenario list:
multi-rank scenarios whose world size matches the launch execute in-process across the ranks,
rank 0 writes the results, and the other ranks stay quiet.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Launch:
    """This process's place in a launch."""

    rank: int
    """Global rank."""
    world_size: int
    """Processes in the launch."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    source: str
    """Who launched it: torchrun or slurm."""


def detect_launch(env: dict[str, str] | None = None) -> Launch | None:
    """The launch this process belongs to, from torchrun's or Slurm's environment; None when alone."""
    environ: Mapping[str, str] = os.environ if env is None else env
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        return Launch(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", "0")), "torchrun")
    if int(environ.get("SLURM_NTASKS", "1")) > 1:
        return Launch(
            int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]), int(environ.get("SLURM_LOCALID", "0")), "slurm"
        )
    return None


def join_launch(launch: Launch, device: torch.device, timeout_s: float) -> torch.device:
    """Initialise the default process group for ``launch``; returns this rank's device.

    Slurm does not set the rendezvous address: MASTER_ADDR (e.g. the first host of
    ``scontrol show hostnames``) must be exported; MASTER_PORT defaults to 29500.
    """
    if launch.source == "slurm":
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("running under Slurm: export MASTER_ADDR (the first node's address) before srun")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank))
    if device.type == "cuda":
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(process_group_backend(device), timeout=timedelta(seconds=timeout_s))
    return device


def process_group_backend(device: torch.device) -> str:
    """The default group's backends: gloo for CPU tensors always, NCCL for CUDA tensors on GPUs.

    The runner's own collectives move CPU data on every device (the step loss, the gathered rank
    records, barriers), and NCCL has no CPU backend: an NCCL-only group fails them with "No backend
    type associated with device type cpu". Subgroups made with ``dist.new_group`` inherit the pair.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo"


def leave_launch() -> None:
    """Tear the default group down while every rank is still alive: a gloo group left to the
    interpreter's exit can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
