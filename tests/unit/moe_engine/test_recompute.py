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
from recompute_cases import MODES, SEED, assert_same_training, small_config, token_batches, train_steps

from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, RecomputeConfig
from moe_engine.parallel.trainer import build_rank_model


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("routing", ["random", "skewed", "learned"])
def test_single_process_recompute_trains_like_no_recompute(mode, routing):
    # The aux-loss-free bias moves with the load counts: a recompute counted as a forward would move it.
    config = small_config(routing, expert_bias_rate=0.01 if routing == "learned" else 0.0)
    parallel = ParallelConfig(microbatches=2)
    reference = train_steps(config, parallel, RecomputeConfig())
    got = train_steps(config, parallel, MODES[mode])
    assert reference["recomputed"] == [] and got["recomputed"], "the mode recomputes something"
    assert_same_training(got, reference)


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
    reference = train_steps(config, parallel, RecomputeConfig())
    got = train_steps(config, parallel, MODES[mode])
    assert got["recomputed"], "the mode recomputes something"
    assert_same_training(got, reference)


def _layer_statistics(recompute: RecomputeConfig) -> list[dict]:
    """The MoE layers' load counts and last-forward statistics after two microbatches' forward and backward."""
    model = build_rank_model(
        small_config(), ParallelConfig(), None, torch.device("cpu"), SEED, recompute=recompute
    ).model
    # Without early stopping the recompute runs the whole block forward, the statistics' updates
    # included (with it, torch stops once the last saved tensor is rebuilt, which hides the question).
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for tokens, labels in token_batches():
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
    config = small_config(n_layers=6)
    parallel = ParallelConfig()
    full_every_2 = train_steps(config, parallel, RecomputeConfig(mode="full", every=2))["recomputed"]
    assert full_every_2 == ["blocks.0", "blocks.2", "blocks.4"]
    parts = train_steps(config, parallel, RecomputeConfig(mode="selective", parts=["attention", "experts"]))[
        "recomputed"
    ]
    assert parts == sorted(f"blocks.{i}.{p}" for i in range(6) for p in ("attn", "ffn.experts"))


def _saved_bytes(recompute: RecomputeConfig) -> int:
    """Bytes autograd keeps from one forward (counted once per storage)."""
    config = small_config()
    rank_model = build_rank_model(config, ParallelConfig(), None, torch.device("cpu"), SEED, recompute=recompute)
    tokens, _ = next(token_batches())
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
