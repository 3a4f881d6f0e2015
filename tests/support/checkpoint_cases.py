"""The checkpoint tests' training run: a small MoE model with random routing, the layouts it runs on
(``LAYOUTS``), each step's global batch (a function of the step alone, so a resumed run reads the same
data), and ``train_steps``: steps on one layout, optionally loaded from and saved to a checkpoint, run
in one process or spawned on each rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a function of the step alone, so a resumed run reads the same data."""
    generator = torch.Generator().manual_seed(SEED * 1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def build_trainer(parallel: ParallelConfig) -> ParallelTrainer:
    groups = build_process_groups(Layout(parallel)) if dist.is_initialized() else None
    rank_model = build_rank_model(CONFIG, parallel, groups, torch.device("cpu"), SEED)
    return ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)


def global_loss(trainer: ParallelTrainer, loss: torch.Tensor | None) -> float:
    if trainer.groups is None:
        return loss.item()
    total = torch.zeros((), dtype=torch.float64) if loss is None else loss.detach().double()
    dist.all_reduce(total)
    return total.item() / trainer.parallel.dp


def rank_params(trainer: ParallelTrainer) -> dict[str, tuple[torch.Size, torch.Tensor]]:
    """This rank's parameters by whole-model name: (offsets, values)."""
    module = trainer.rank_model.module
    if trainer.fsdp:
        return {
            name: (torch.Size([0] * p.ndim), p.full_tensor().detach().clone()) for name, p in module.named_parameters()
        }
    placements = checkpoint.parameter_placements(module)
    return {placements[id(p)].fqn: (placements[id(p)].offsets, p.detach().clone()) for p in module.parameters()}


def train_steps(
    parallel: ParallelConfig,
    steps: range,
    save_to: str | None = None,
    load_from: str | None = None,
    async_save: bool = False,
) -> dict:
    trainer = build_trainer(parallel)
    if load_from:
        extra = checkpoint.load(trainer, load_from, extra_keys=("step",))
        assert extra["step"] == steps.start
    rows = slice(None)
    if trainer.groups is not None:
        share = SEQUENCES // parallel.dp
        rows = slice(trainer.groups.coords.dp_rank * share, (trainer.groups.coords.dp_rank + 1) * share)
    losses = []
    for step in steps:
        tokens, labels = global_batch(step)
        losses.append(global_loss(trainer, trainer.step(tokens[rows], labels[rows])))
    if save_to:
        extra = {"step": steps.stop}
        if async_save:
            checkpoint.async_save(trainer, save_to, extra).result()
        else:
            checkpoint.save(trainer, save_to, extra)
    return {"losses": losses, "params": rank_params(trainer)}
