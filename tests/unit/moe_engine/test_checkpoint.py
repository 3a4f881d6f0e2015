"""Checkpoints (``moe_engine.checkpoint``): a run stopped, saved and resumed equals the run never stopped.

Reference: the uninterrupted run of 2N steps in the same processes' code. On the same layout the
resumed run's losses and final parameters must be bit-identical (the optimizer's masters, moments
and step, the routing streams and the data position all come back). On another layout (DCP
reshards) they must agree within fp32 tolerance: the arithmetic is ordered differently. Random
routing throughout, so a routing stream that restarted from its seed would change the routes.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

from moe_engine import checkpoint
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, routing="random", routing_seed=5),
)
OPTIMIZER = OptimizerConfig(lr=1e-2, max_grad_norm=0.5)
SEQUENCES, N = 8, 3
SEED = 4321  # fixed: the model's init and the batches derive from it

LAYOUTS = {
    "single": ParallelConfig(),
    "dp2-zero1": ParallelConfig(dp=2, optimizer_sharding="zero1"),
    "dp2": ParallelConfig(dp=2),
    # Capacity for every token: the same routes as dp2, so a resumed dp2 run continues an ep2 one.
    "ep2-no-sync": ParallelConfig(dp=2, ep=2, dispatch="no-sync", capacity_factor=4.0),
    "pp2-1f1b": ParallelConfig(pp=2, schedule="1f1b", microbatches=2),
    "pp1-microbatches2": ParallelConfig(microbatches=2),
    "fsdp-dp2": ParallelConfig(dp=2, dp_mode="fsdp"),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a function of the step alone, so a resumed run reads the same data."""
    generator = torch.Generator().manual_seed(SEED * 1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _trainer(parallel: ParallelConfig) -> ParallelTrainer:
    groups = build_process_groups(Layout(parallel)) if dist.is_initialized() else None
    rank_model = build_rank_model(CONFIG, parallel, groups, torch.device("cpu"), SEED)
    return ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)


def _global_loss(trainer: ParallelTrainer, loss: torch.Tensor | None) -> float:
    if trainer.groups is None:
        return loss.item()
    total = torch.zeros((), dtype=torch.float64) if loss is None else loss.detach().double()
    dist.all_reduce(total)
    return total.item() / trainer.parallel.dp


def _params(trainer: ParallelTrainer) -> dict[str, tuple[torch.Size, torch.Tensor]]:
    """This rank's parameters by whole-model name: (offsets, values)."""
    module = trainer.rank_model.module
    if trainer.fsdp:
        return {
            name: (torch.Size([0] * p.ndim), p.full_tensor().detach().clone()) for name, p in module.named_parameters()
        }
    placements = checkpoint.parameter_placements(module)
    return {placements[id(p)].fqn: (placements[id(p)].offsets, p.detach().clone()) for p in module.parameters()}


def _train(
    parallel: ParallelConfig,
    steps: range,
    save_to: str | None = None,
    load_from: str | None = None,
    async_save: bool = False,
) -> dict:
    trainer = _trainer(parallel)
    if load_from:
        extra = checkpoint.load(trainer, load_from, extra_keys=("step",))
        assert extra["step"] == steps.start
    rows = slice(None)
    if trainer.groups is not None:
        share = SEQUENCES // parallel.dp
        rows = slice(trainer.groups.coords.dp_rank * share, (trainer.groups.coords.dp_rank + 1) * share)
    losses = []
    for step in steps:
        tokens, labels = _batch(step)
        losses.append(_global_loss(trainer, trainer.step(tokens[rows], labels[rows])))
    if save_to:
        extra = {"step": steps.stop}
        if async_save:
            checkpoint.async_save(trainer, save_to, extra).result()
        else:
            checkpoint.save(trainer, save_to, extra)
    return {"losses": losses, "params": _params(trainer)}


def _run(layout: str, steps: range, save_to: str | None = None, load_from: str | None = None) -> list[dict]:
    parallel = LAYOUTS[layout]
    if parallel.world_size == 1:
        return [_train(parallel, steps, save_to, load_from)]
    return run_ranks(_train, parallel.world_size, parallel, steps, save_to, load_from, timeout=180)


def _assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Whole-model parameters from every rank's boxes."""
    boxes: dict[str, list[tuple[torch.Size, torch.Tensor]]] = {}
    for rank in ranks:
        for name, box in rank["params"].items():
            boxes.setdefault(name, []).append(box)
    full = {}
    for name, parts in boxes.items():
        rows = max(o[0] + t.shape[0] for o, t in parts) if parts[0][1].ndim else None
        out = parts[0][1].new_zeros((rows, *parts[0][1].shape[1:])) if rows is not None else parts[0][1].clone()
        for offsets, tensor in parts:
            if tensor.ndim:
                out[offsets[0] : offsets[0] + tensor.shape[0]] = tensor
        full[name] = out
    return full


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """2N steps on each layout without a stop (computed once per layout)."""
    cache: dict[str, dict] = {}

    def get(layout: str) -> dict:
        if layout not in cache:
            ranks = _run(layout, range(2 * N))
            cache[layout] = {"losses": ranks[0]["losses"], "params": _assemble(ranks)}
        return cache[layout]

    return get


def test_a_checkpoint_of_another_model_shape_is_refused_by_name(tmp_path):
    path = str(tmp_path / "step-1")
    _train(LAYOUTS["single"], range(1), save_to=path)
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
    trainer = _trainer(LAYOUTS["single"])
    for step in range(2):
        trainer.step(*_batch(step))
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
        trainer.step(*_batch(2))
        assert not future.done()
    finally:
        release.set()
    future.result(timeout=60)
    assert len(writers) == 2 and writers[1] is not training
    saved_sync, saved_async = _state_tensors(sync_path), _state_tensors(async_path)
    assert saved_sync.keys() == saved_async.keys() and any(k.startswith("optim/exp_avg/") for k in saved_sync)
    for key, tensor in saved_sync.items():
        assert torch.equal(tensor, saved_async[key]), key
