"""Detecting and joining a launch: torchrun's and Slurm's variables; the default group has a CPU backend on
every device."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.run.launch import Launch, detect_launch, join_launch, process_group_backend


def test_a_cuda_launch_pairs_gloo_for_cpu_tensors_with_nccl(monkeypatch):
    """An NCCL-only default group fails every collective on a CPU tensor (the runner's step loss,
    its gathered records): a CUDA launch must register gloo for CPU beside NCCL."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    device = join_launch(Launch(rank=1, world_size=2, local_rank=1, source="torchrun"), torch.device("cuda"), 60)
    assert device == torch.device("cuda", 1)
    assert calls == ["cpu:gloo,cuda:nccl"]


def test_a_cpu_launch_uses_the_cpu_half_of_the_same_string():
    """Multi-rank runs here use exactly the CPU side of a CUDA launch's backend string, so the tests
    of the multi-rank runner exercise the collectives a GPU run issues on CPU tensors."""
    assert process_group_backend(torch.device("cpu")) == "cpu:gloo"
    assert process_group_backend(torch.device("cuda")).split(",")[0] == process_group_backend(torch.device("cpu"))


def test_launch_detection():
    assert detect_launch({}) is None
    assert detect_launch({"WORLD_SIZE": "1", "RANK": "0"}) is None
    torchrun = detect_launch({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert (torchrun.rank, torchrun.world_size, torchrun.source) == (2, 4, "torchrun")
    slurm = detect_launch({"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.source) == (5, 8, 1, "slurm")
