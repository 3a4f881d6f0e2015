"""Tiny models for tests that need a whole training step: ``tiny_bf16_trainer``, a two-block bf16 MoE
model's single-process trainer."""

import torch

from moe_engine import ModelConfig
from moe_engine.config import MoEConfig, ParallelConfig
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model


def tiny_bf16_trainer(seed: int = 20261203) -> tuple[ModelConfig, ParallelTrainer]:
    """The model's config and a trainer of it, its weights drawn from ``seed``."""
    config = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=16,
        dtype="bf16",
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24),
    )
    parallel = ParallelConfig()
    return config, ParallelTrainer(
        build_rank_model(config, parallel, None, torch.device("cpu"), seed=seed), parallel, None
    )
