"""Activation recompute trains exactly like keeping the activations, and keeps fewer of them.

The reference is the same model without recompute: fp32, the same seed, the same batches. Random
routing draws from each router's own generator, which ``torch.utils.checkpoint`` does not restore,
so these tests route at random: a recompute that re-drew the routes would send tokens to other
experts in backward and give other gradients (or other shapes under expert parallelism).
"""

from __future__ import annotations

import pytest
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


def _config(routing: str = "random", n_layers: int = 4, **moe) -> ModelConfig:
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


def _batches():
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        tokens = torch.randint(0, 96, (SEQUENCES, 9), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _train(config: ModelConfig, parallel: ParallelConfig, recompute: RecomputeConfig, groups=None, rows=slice(None)):
    """Losses, first-step gradients, final parameters and buffers of STEPS steps on this rank."""
    rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), SEED, recompute=recompute)
    initial = {n: _full(t).detach().clone() for n, t in rank_model.module.state_dict().items()}
    trainer = ParallelTrainer(rank_model, parallel, groups, OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0))
    # FSDP's gradients are the parameters' own (sharded); the engine's DDP buffers hold them otherwise.
    grad_of = getattr(trainer.optimizer, "grad_view", lambda param: param.grad)
    losses, grads = [], None
    for tokens, labels in _batches():
        losses.append(trainer.step(tokens[rows], labels[rows]))
        if grads is None:
            grads = {n: _full(grad_of(p)).clone() for n, p in rank_model.module.named_parameters()}
    state = {n: _full(t).detach().clone() for n, t in rank_model.module.state_dict().items()}
    recomputed = sorted(n for n, m in rank_model.module.named_modules() if is_recomputed(m))
    return {
        "losses": losses,
        "grads": grads,
        "initial": initial,
        "state": state,
        "recomputed": recomputed,
        "config": config,
    }


def _assert_same_training(got: dict, want: dict) -> None:
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


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("routing", ["random", "skewed", "learned"])
def test_single_process_recompute_trains_like_no_recompute(mode, routing):
    # The aux-loss-free bias moves with the load counts: a recompute counted as a forward would move it.
    config = _config(routing, expert_bias_rate=0.01 if routing == "learned" else 0.0)
    parallel = ParallelConfig(microbatches=2)
    reference = _train(config, parallel, RecomputeConfig())
    got = _train(config, parallel, MODES[mode])
    assert reference["recomputed"] == [] and got["recomputed"], "the mode recomputes something"
    _assert_same_training(got, reference)


def _public_architecture_config() -> ModelConfig:
    """MLA with a query latent, a leading dense block and MoE every second block after it, tied
    embeddings, group-limited learned routing with the expert bias moving."""
    return ModelConfig(
        vocab_size=96,
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        seq_len=8,
        dtype="fp32",
        n_dense_layers=1,
        moe_every=2,
        dense_hidden=40,
        tie_embeddings=True,
        mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=24,
            shared_expert_hidden=8,
            score_func="sigmoid",
            n_groups=2,
            top_groups=1,
            routed_scaling_factor=2.5,
            expert_bias_rate=0.01,
        ),
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_recompute_of_mla_interleaved_tied_model_trains_like_no_recompute(mode):
    config = _public_architecture_config()
    parallel = ParallelConfig(microbatches=2)
    reference = _train(config, parallel, RecomputeConfig())
    got = _train(config, parallel, MODES[mode])
    assert got["recomputed"], "the mode recomputes something"
    _assert_same_training(got, reference)


def _layer_statistics(recompute: RecomputeConfig) -> list[dict]:
    """The MoE layers' load counts and last-forward statistics after two microbatches' forward and backward."""
    model = build_rank_model(_config(), ParallelConfig(), None, torch.device("cpu"), SEED, recompute=recompute).model
    # Without early stopping the recompute runs the whole block forward, the statistics' updates
    # included (with it, torch stops once the last saved tensor is rebuilt, which hides the question).
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for tokens, labels in _batches():
            model.loss(tokens, labels).backward()
    return [
        {"load": layer.tokens_per_expert.clone(), "counts": layer.last_counts_E, "loss": layer.last_router_loss}
        for layer in model.moe_layers()
    ]


def test_a_recompute_is_not_counted_as_a_forward():
    # Doubled loads would not change the sign rule of the expert bias, so compare the counts themselves.
    reference, got = _layer_statistics(RecomputeConfig()), _layer_statistics(MODES["full"])
    for want, have in zip(reference, got):
        for key in want:
            torch.testing.assert_close(have[key], want[key], rtol=0, atol=0, msg=key)


def test_the_chosen_blocks_and_parts_are_the_ones_recomputed():
    config = _config(n_layers=6)
    parallel = ParallelConfig()
    full_every_2 = _train(config, parallel, RecomputeConfig(mode="full", every=2))["recomputed"]
    assert full_every_2 == ["blocks.0", "blocks.2", "blocks.4"]
    parts = _train(config, parallel, RecomputeConfig(mode="selective", parts=["attention", "experts"]))["recomputed"]
    assert parts == sorted(f"blocks.{i}.{p}" for i in range(6) for p in ("attn", "ffn.experts"))


def _saved_bytes(recompute: RecomputeConfig) -> int:
    """Bytes autograd keeps from one forward (counted once per storage)."""
    config = _config()
    rank_model = build_rank_model(config, ParallelConfig(), None, torch.device("cpu"), SEED, recompute=recompute)
    tokens, _ = next(_batches())
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rank_model.model(tokens).float().sum().backward()
    return sum(storages.values())


def test_recompute_keeps_fewer_activations():
    none = _saved_bytes(RecomputeConfig())
    full = _saved_bytes(MODES["full"])
    selective = {part: _saved_bytes(MODES[part]) for part in ("attention", "experts", "norms")}
    # Full recompute keeps a block's input only, while its recompute in backward runs under the
    # hooks too (counted here): still well under keeping everything.
    assert full < 0.8 * none, (full, none)
    for part, saved in selective.items():
        assert saved < none, (part, saved, none)


# ---- several ranks: the same layout with and without recompute ----
