"""A small MoE model for the data-parallel tests and its single-process reference: the config
(``small_config``), a fixed stream of batches, AdamW on the full batch step by step
(``full_batch_reference``), and the gradient comparison within the model's fp32 rounding."""

import torch
from tolerances import model_tolerance

from moe_engine import ModelConfig, MoEConfig, build_model
from moe_engine.train import MasterWeightAdamW, OptimizerConfig

SEED = 3
BATCH = 4
# Smaller than most parameters: every matrix gets its own bucket, so many buckets launch in backward.
SMALL_BUCKET = 1000
# These tests check the reduction and update arithmetic; clipping has its own tests.
OPT = OptimizerConfig(max_grad_norm=0.0)


def small_config(dtype: str, z_loss_weight: float = 0.001) -> ModelConfig:
    # aux_loss_weight=0: the balance loss is a per-batch statistic, not a mean over tokens.
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        seq_len=8,
        n_dense_layers=1,
        dense_hidden=32,
        qk_norm=True,
        dtype=dtype,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, aux_loss_weight=0.0, z_loss_weight=z_loss_weight),
    )


def token_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    shape = (BATCH, 8)
    return [
        (torch.randint(0, 64, shape, generator=generator), torch.randint(0, 64, shape, generator=generator))
        for _ in range(steps)
    ]


def grads_of(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def full_batch_reference(dtype: str, steps: int, z_loss_weight: float = 0.001) -> dict:
    model = build_model(small_config(dtype, z_loss_weight), seed=SEED)
    opt = MasterWeightAdamW(model.parameters(), OPT)
    initial, grads, history = params_of(model), [], []
    for tokens, labels in token_batches(steps):
        opt.zero_grad()
        model.loss(tokens, labels).backward()
        grads.append(grads_of(model))
        opt.step()
        history.append(params_of(model))
    return {"initial": initial, "grads": grads, "params": history, "state_bytes": opt.state_bytes()}


def assert_grads_match(got: dict, want: dict, tol: float | None = None) -> None:
    """Default: the model's gradients on the full batch against two half batches' reduced, which sum
    the same terms in another order (fp32 rounding of the model's sums)."""
    tol = model_tolerance(small_config("fp32"), BATCH * 8) if tol is None else tol
    for name, grad in want.items():
        assert relative_error(got[name], grad) <= tol, name
