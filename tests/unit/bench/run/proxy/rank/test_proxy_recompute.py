"""A proxy rank under activation recompute: the same training (routing replayed, the simulated peers' too),
less activation memory.

A fully recomputed block runs its forward again in backward; its router and the ``SimulatedPeers``
routers that stand for the other ep ranks draw from their own generators, which the recompute must set
back (``Dispatcher.routing_streams``) or the replayed forward routes differently from the first.
"""

import contextlib

import pytest
import torch
from tolerances import model_tolerance

from bench.run.memory import TensorMemoryTracker
from bench.run.proxy.rank.build import build_proxy_rank
from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, RecomputeConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=24, shared_expert_hidden=16, routing="random"),
)
FULL = RecomputeConfig(mode="full")
SELECTIVE = RecomputeConfig(mode="selective", parts=["experts", "attention"])
LAYOUTS = {
    # 2 microbatches: the second microbatch's forward runs after the first one's backward recomputed, so
    # a stream the recompute left moved would route it differently.
    "dp2-ep2-nosync": (dict(dp=2, ep=2, dispatch="no-sync", capacity_factor=1.0, microbatches=2), 1),
    "dp2-ep2-sync": (dict(dp=2, ep=2, dispatch="sync", microbatches=2), 0),
    "dp2-ep2-pp2-1f1b": (dict(dp=2, ep=2, pp=2, schedule="1f1b", microbatches=2), 3),
}


@contextlib.contextmanager
def proxy_trainer(layout: dict, rank: int, recompute: RecomputeConfig | None):
    parallel = ParallelConfig.from_dict(layout)
    join_fake_world(rank, parallel.world_size)
    try:
        groups = build_process_groups(Layout(parallel))
        rank_model = build_proxy_rank(CONFIG, parallel, groups, torch.device("cpu"), seed=0, recompute=recompute)
        yield ParallelTrainer(rank_model, parallel, groups)
    finally:
        leave_fake_world()


def batches(steps: int, sequences: int = 4):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG.vocab_size, (sequences, CONFIG.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def losses(layout: dict, rank: int, recompute: RecomputeConfig | None, steps: int = 3) -> list[float]:
    with proxy_trainer(layout, rank, recompute) as trainer:
        out = []
        for tokens, labels in batches(steps):
            loss = trainer.step(tokens, labels)
            # A middle pipeline stage has no loss: its last parameter tells the updates apart instead.
            out.append(float(loss) if loss is not None else float(next(trainer.rank_model.module.parameters()).sum()))
        return out


@pytest.mark.parametrize("recompute", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_recomputing_proxy_rank_trains_as_one_that_keeps_its_activations(name, recompute):
    layout, rank = LAYOUTS[name]
    kept = losses(layout, rank, None)
    # The recompute runs the same kernels on the same inputs: the same numbers, up to fp32 rounding at most
    # (autograd may add a parameter's gradient contributions in another order, and the later steps'
    # losses carry that).
    rtol = model_tolerance(CONFIG, tokens=4 * CONFIG.seq_len, gradients=False)
    torch.testing.assert_close(losses(layout, rank, recompute), kept, rtol=rtol, atol=0)


def test_recompute_lowers_the_proxy_rank_s_tracked_activation_peak():
    layout, rank = LAYOUTS["dp2-ep2-nosync"]
    transient = {}
    for mode, recompute in (("none", None), ("selective", SELECTIVE), ("full", FULL)):
        with proxy_trainer(layout, rank, recompute) as trainer:
            # The first step creates the optimizer state; the second is measured.
            first, second = batches(2, sequences=16)
            trainer.step(*first)
            step, measured = trainer.optimizer.step, {}
            with TensorMemoryTracker(trainer.resident_tensors()) as tracker:

                def peak_then_step(tracker=tracker, measured=measured, step=step):
                    measured["forward_backward"] = tracker.peak - tracker.baseline
                    step()

                trainer.optimizer.step = peak_then_step
                trainer.step(*second)
            transient[mode] = measured["forward_backward"]
    # Full recompute keeps each block's input only; selective keeps everything but the attention's and
    # the experts' insides.
    assert transient["full"] < transient["selective"] < transient["none"]
