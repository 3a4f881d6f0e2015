"""FSDP2 mode computes the single-process loss, gradients and AdamW update."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from tolerances import assert_close_to_scale, assert_moves_close, in_quadrature, model_tolerance

from moe_engine import build_model
from moe_engine.config import ModelConfig, MoEConfig
from moe_engine.parallel.fsdp import apply_fsdp
from moe_engine.train import MasterWeightAdamW, OptimizerConfig, adamw_param_groups

# FSDP2 on gloo ranks: seconds (the fast lane leaves it to CI).
pytestmark = pytest.mark.slow

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, aux_loss_weight=0.0),
)
# eps = 1 keeps Adam's update proportional to the gradient: with the usual eps, gradients of 1e-8
# (equal here to 1e-10) become updates of +-lr whose last digits depend on summation order.
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.1)
STEPS = 2
# Fixed, so that a failure replays exactly (the model's init and the batches derive from it).
SEED = 1234


def _batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _fsdp_rank(seed: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = apply_fsdp(build_model(CONFIG, seed=seed), dist.group.WORLD, torch.float32)
    optimizer = torch.optim.AdamW(
        adamw_param_groups(list(model.parameters()), OPTIMIZER),
        lr=OPTIMIZER.lr,
        betas=OPTIMIZER.betas,
        eps=OPTIMIZER.eps,
    )
    losses, first_grads = [], None
    for tokens, labels in _batches(seed):
        share = tokens.shape[0] // world
        rows = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        loss = model.loss(tokens[rows], labels[rows])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean / world)
        if first_grads is None:
            first_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizer.step()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    local_elements = sum(p.to_local().numel() for p in model.parameters())
    return {"losses": losses, "grads": first_grads, "params": params, "local_elements": local_elements}


def _reference(seed: int):
    model = build_model(CONFIG, seed=seed)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = MasterWeightAdamW(model.parameters(), OPTIMIZER)
    losses, first_grads = [], None
    for tokens, labels in _batches(seed):
        optimizer.zero_grad()
        loss = model.loss(tokens, labels)
        loss.backward()
        losses.append(loss.detach())
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, first_grads, dict(model.named_parameters()), initial


def test_fsdp_matches_single_process_and_shards_parameters():
    ranks = run_ranks(_fsdp_rank, 2, SEED, timeout=120)
    losses, grads, params, initial = _reference(SEED)
    total = sum(p.numel() for p in params.values())
    # Half batches summed and reduced: fp32 rounding of the model's sums, in another order.
    tokens = 8 * CONFIG.seq_len
    loss_tol, grad_tol = model_tolerance(CONFIG, tokens, gradients=False), model_tolerance(CONFIG, tokens)
    for rank in ranks:
        torch.testing.assert_close(torch.stack(rank["losses"]), torch.stack(losses), rtol=loss_tol, atol=0)
        for name, grad in grads.items():
            assert_close_to_scale(rank["grads"][name], grad, grad_tol, msg=name)
        # With eps = 1 each step moves a parameter about in proportion to its gradient: compare the
        # moves of the two steps, each carrying its gradient's rounding.
        for name, param in params.items():
            assert_moves_close(
                rank["params"][name] - initial[name],
                param.detach() - initial[name],
                in_quadrature(grad_tol, grad_tol),
                initial[name],
                STEPS,
                msg=name,
            )
        # Each rank holds about half of every parameter (dim-0 shards, uneven ones padded).
        assert total / 2 <= rank["local_elements"] <= total / 2 + 64
    assert ranks[0]["local_elements"] + ranks[1]["local_elements"] == total
