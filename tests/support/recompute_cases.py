"""Recompute against no recompute: a small MoE model (``small_config``), the recompute modes
(``MODES``), a training run of a few steps on one rank (``train_steps``: losses, first-step gradients,
the state before and after), and its comparison within the model's fp32 rounding."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from tolerances import assert_close_to_scale, assert_moves_close, in_quadrature, model_tolerance

from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, RecomputeConfig
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.recompute import is_recomputed
from moe_engine.train import OptimizerConfig

SEED = 2024
STEPS = 2
SEQUENCES = 8


def small_config(routing: str = "random", n_layers: int = 4, **moe) -> ModelConfig:
    moe = {"num_experts": 4, "top_k": 2, "expert_hidden": 24, "shared_expert_hidden": 8, "routing": routing, **moe}
    return ModelConfig(
        vocab_size=96,
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        seq_len=8,
        dtype="fp32",
        qk_norm=True,
        moe=MoEConfig(**moe),
    )


MODES = {
    "full": RecomputeConfig(mode="full"),
    "full-every-2": RecomputeConfig(mode="full", every=2),
    "full-first-1-per-stage": RecomputeConfig(mode="full", first_per_stage=1),
    "attention": RecomputeConfig(mode="selective", parts=["attention"]),
    "experts": RecomputeConfig(mode="selective", parts=["experts"]),
    "norms": RecomputeConfig(mode="selective", parts=["norms"]),
    "all-parts": RecomputeConfig(mode="selective", parts=["attention", "experts", "norms"]),
}


def token_batches():
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        tokens = torch.randint(0, 96, (SEQUENCES, 9), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def whole(tensor):
    """An FSDP parameter's (DTensor's) whole tensor; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train_steps(
    config: ModelConfig, parallel: ParallelConfig, recompute: RecomputeConfig, groups=None, rows=slice(None)
):
    """Losses, first-step gradients, final parameters and buffers of STEPS steps on this rank."""
    rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), SEED, recompute=recompute)
    initial = {n: whole(t).detach().clone() for n, t in rank_model.module.state_dict().items()}
    trainer = ParallelTrainer(rank_model, parallel, groups, OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0))
    # FSDP's gradients are the parameters' own (sharded); the engine's DDP buffers hold them otherwise.
    grad_of = getattr(trainer.optimizer, "grad_view", lambda param: param.grad)
    losses, grads = [], None
    for tokens, labels in token_batches():
        losses.append(trainer.step(tokens[rows], labels[rows]))
        if grads is None:
            grads = {n: whole(grad_of(p)).clone() for n, p in rank_model.module.named_parameters()}
    state = {n: whole(t).detach().clone() for n, t in rank_model.module.state_dict().items()}
    recomputed = sorted(n for n, m in rank_model.module.named_modules() if is_recomputed(m))
    return {
        "losses": losses,
        "grads": grads,
        "initial": initial,
        "state": state,
        "recomputed": recomputed,
        "config": config,
    }


def assert_same_training(got: dict, want: dict) -> None:
    # The recompute runs the same kernels on the same inputs, but autograd may add a parameter's
    # gradient contributions in another order: fp32 rounding of the model's sums at most.
    assert got["losses"][0] is not None
    tokens = SEQUENCES * want["config"].seq_len
    loss_tol = model_tolerance(want["config"], tokens, gradients=False)
    grad_tol = model_tolerance(want["config"], tokens)
    torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(want["losses"]), rtol=loss_tol, atol=0)
    for name, grad in want["grads"].items():
        assert_close_to_scale(got["grads"][name], grad, grad_tol, msg=f"gradient of {name}")
    for name, value in want["state"].items():
        if not value.is_floating_point():
            assert torch.equal(got["state"][name], value), f"state {name}"
            continue
        # lr = 1 and eps = 1 make each update about proportional to its gradient: compare what the two
        # steps moved, each carrying its gradient's rounding.
        moved, want_moved = got["state"][name] - got["initial"][name], value - want["initial"][name]
        assert_moves_close(
            moved, want_moved, in_quadrature(grad_tol, grad_tol), want["initial"][name], STEPS, msg=f"state {name}"
        )
