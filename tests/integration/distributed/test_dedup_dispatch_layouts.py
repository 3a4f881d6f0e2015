"""Rows per (token, rank) and per (token, node) train the model rows per (token, expert) train, on whole
layouts: ZeRO-1, pipelines, sync and no-sync dispatch; same losses, gradient norms and updates (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed_harness import run_ranks

from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

pytestmark = pytest.mark.slow

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=8, top_k=3, expert_hidden=24, aux_loss_weight=0.01),
)
# eps = 1 and lr = 1: the first updates are nearly proportional to the gradient (Adam would hide its scale).
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0, max_grad_norm=0.1)
SEQUENCES, STEPS, SEED = 8, 2, 4321

LAYOUTS = {
    "ep2-sync": ParallelConfig(dp=2, ep=2, dispatch="sync"),
    "ep2-no-sync-zero1": ParallelConfig(dp=2, ep=2, capacity_factor=4.0, optimizer_sharding="zero1"),
    # Four ranks as two nodes of two.
    "ep4-nodes-sync-zero1": ParallelConfig(dp=4, ep=4, dispatch="sync", ranks_per_node=2, optimizer_sharding="zero1"),
    "ep4-nodes-no-sync-chunks": ParallelConfig(dp=4, ep=4, capacity_factor=4.0, ranks_per_node=2, a2a_chunks=2),
    # Pipelines of two stages, each stage's expert-parallel group two nodes of one rank.
    "pp2-ep2-nodes": ParallelConfig(
        dp=2, ep=2, pp=2, microbatches=2, capacity_factor=4.0, ranks_per_node=1, optimizer_sharding="zero1"
    ),
}


def _batches():
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _train_rank(parallel: ParallelConfig) -> dict:
    groups = build_process_groups(Layout(parallel))
    rows = ["per-expert", "per-rank"] + (["per-node"] if parallel.spans_nodes else [])
    out = {}
    for dispatch_rows in rows:
        variant = dataclasses.replace(parallel, dispatch_rows=dispatch_rows)
        rank_model = build_rank_model(CONFIG, variant, groups, torch.device("cpu"), SEED)
        trainer = ParallelTrainer(rank_model, variant, groups, OPTIMIZER)
        params = dict(rank_model.module.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        share = SEQUENCES // parallel.dp
        batch = slice(groups.coords.dp_rank * share, (groups.coords.dp_rank + 1) * share)
        losses, norms, dropped = [], [], []
        for tokens, labels in _batches():
            loss = trainer.step(tokens[batch], labels[batch])
            losses.append(loss if loss is None else loss.detach())
            norms.append(trainer.last_grad_norm.clone())
            dropped.append(sum(int(layer.last_dropped) for layer in rank_model.moe_layers()))
        out[dispatch_rows] = dict(
            losses=losses,
            norms=torch.stack(norms),
            updates={n: p.detach() - before[n] for n, p in params.items()},
            dropped=dropped,
        )
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dedup_rows_train_like_per_expert_rows(name):
    parallel = LAYOUTS[name]
    ranks = run_ranks(_train_rank, parallel.world_size, parallel, timeout=300)
    for rank, results in enumerate(ranks):
        reference = results["per-expert"]
        assert sum(reference["dropped"]) == 0, "ample capacity"
        assert (reference["norms"] > 2 * OPTIMIZER.max_grad_norm).all(), "clipping engages"
        for rows, got in results.items():
            where = f"rank {rank}, {rows}"
            assert sum(got["dropped"]) == 0, where
            for loss, expected in zip(got["losses"], reference["losses"]):
                assert (loss is None) == (expected is None), where
                if loss is not None:
                    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0, msg=where)
            torch.testing.assert_close(got["norms"], reference["norms"], rtol=1e-5, atol=0, msg=where)
            for param, update in got["updates"].items():
                expected = reference["updates"][param]
                # Relative to the update's size: two steps' roundings of the same sums in another order.
                scale = expected.abs().max().clamp(min=1e-12)
                torch.testing.assert_close(
                    update / scale, expected / scale, rtol=0, atol=1e-4, msg=f"{where}: update of {param}"
                )
