"""Checkpoints (``moe_engine.checkpoint``) in one process: a checkpoint of another model shape is
refused by name, and an async save writes in the background what a sync save writes. A run stopped,
saved and resumed equals the run never stopped (bit-identical on the same layout, within fp32
tolerance on another): on gloo ranks, tests/integration/distributed/test_checkpoint_ranks.py."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from checkpoint_cases import CONFIG, LAYOUTS, OPTIMIZER, SEED, build_trainer, global_batch, train_steps

from moe_engine import checkpoint
from moe_engine.config import ParallelConfig
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model


def test_a_checkpoint_of_another_model_shape_is_refused_by_name(tmp_path):
    path = str(tmp_path / "step-1")
    train_steps(LAYOUTS["single"], range(1), save_to=path)
    wider_model = build_rank_model(
        dataclasses.replace(CONFIG, d_model=48), ParallelConfig(), None, torch.device("cpu"), SEED
    )
    wider = ParallelTrainer(wider_model, ParallelConfig(), None, OPTIMIZER)
    with pytest.raises(
        checkpoint.CheckpointMismatch,
        match=r"model/embed.weight has shape \(96, 32\) in the checkpoint, \(96, 48\) here",
    ):
        checkpoint.load(wider, path)


def _state_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, read whole (single process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(path).with_suffix(".pt")
    dcp_to_torch_save(path, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def test_async_save_writes_in_the_background_what_a_sync_save_writes(tmp_path, monkeypatch):
    """The same state saved both ways holds the same tensors. The async save copies the state to the host
    in the training thread and writes it in another: with its write held on an event, the save returns
    and a training step runs while the write is still pending. How much shorter the stall is than a
    sync save: ``python -m bench.validate.async_save_stall`` (a timing, so not a test)."""
    trainer = build_trainer(LAYOUTS["single"])
    for step in range(2):
        trainer.step(*global_batch(step))
    sync_path, async_path = str(tmp_path / "sync"), str(tmp_path / "async")
    from torch.distributed.checkpoint import FileSystemWriter

    original_write, original_stage = FileSystemWriter.write_data, checkpoint.HostStager.stage
    training = threading.current_thread()
    writers, stagers = [], []
    writing, release = threading.Event(), threading.Event()

    def held_write(self, plan, planner):
        writers.append(threading.current_thread())
        if threading.current_thread() is not training:
            writing.set()
            assert release.wait(timeout=60), "the test never released the write"
        return original_write(self, plan, planner)

    def recorded_stage(self, state_dict):
        stagers.append(threading.current_thread())
        return original_stage(self, state_dict)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write)
    monkeypatch.setattr(checkpoint.HostStager, "stage", recorded_stage)
    checkpoint.save(trainer, sync_path, {"step": 2})
    assert writers == [training]
    try:
        future = checkpoint.async_save(trainer, async_path, {"step": 2})
        assert stagers == [training]  # the host copy is the training thread's stall
        assert writing.wait(timeout=60), "the background write never started"
        # Training goes on while the write waits: the step changes the live tensors, not the staged copy.
        trainer.step(*global_batch(2))
        assert not future.done()
    finally:
        release.set()
    future.result(timeout=60)
    assert len(writers) == 2 and writers[1] is not training
    saved_sync, saved_async = _state_tensors(sync_path), _state_tensors(async_path)
    assert saved_sync.keys() == saved_async.keys() and any(k.startswith("optim/exp_avg/") for k in saved_sync)
    for key, tensor in saved_sync.items():
        assert torch.equal(tensor, saved_async[key]), key
