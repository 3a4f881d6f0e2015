"""Checkpoint resume on gloo ranks: bit-identical on one layout, resharded on another."""

from __future__ import annotations

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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "dp2-zero1", "ep2-no-sync", "pp2-1f1b", "fsdp-dp2"])
def test_resume_on_the_same_layout_is_bit_identical(layout, uninterrupted, tmp_path):
    path = str(tmp_path / "step-3")
    first = _run(layout, range(N), save_to=path)
    second = _run(layout, range(N, 2 * N), load_from=path)
    reference = uninterrupted(layout)
    assert first[0]["losses"] + second[0]["losses"] == reference["losses"]
    resumed = _assemble(second)
    assert resumed.keys() == reference["params"].keys()
    for name, tensor in reference["params"].items():
        assert torch.equal(resumed[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved, loaded", [("ep2-no-sync", "dp2"), ("pp2-1f1b", "pp1-microbatches2"), ("dp2-zero1", "dp2")]
)
def test_resume_on_another_layout_reshards(saved, loaded, uninterrupted, tmp_path):
    path = str(tmp_path / "step-3")
    _run(saved, range(N), save_to=path)
    second = _run(loaded, range(N, 2 * N), load_from=path)
    reference = uninterrupted(saved)
    torch.testing.assert_close(second[0]["losses"], reference["losses"][N:], rtol=1e-5, atol=1e-5)
    resumed = _assemble(second)
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
