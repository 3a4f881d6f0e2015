"""The small MoE of the proxy-rank tests, and a fake world to build one rank of it in this process."""

from __future__ import annotations

import contextlib

from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, Precision, RoutingMode
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype=Precision.FP32,
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=24, shared_expert_hidden=16, routing=RoutingMode.RANDOM),
)


@contextlib.contextmanager
def fake_rank(parallel: ParallelConfig, rank: int):
    """Rank ``rank`` of a fake world of ``parallel``'s size, for the block: its process groups."""
    join_fake_world(rank, parallel.world_size)
    try:
        yield build_process_groups(Layout(parallel))
    finally:
        leave_fake_world()
