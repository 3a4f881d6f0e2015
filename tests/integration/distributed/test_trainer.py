"""Every layout trains the same model as the single-process trainer: losses, gradients, updates.

Adam is invariant to the scale of the gradient, so equal parameters after a step would not catch
a gradient summed where it should be averaged. The optimizer here uses eps = 1 and lr = 1, which
makes the first updates nearly proportional to the gradient, and the test compares the parameter
updates as well as the gradients.

Gradients are clipped to a global norm well below the model's (the reference is
``torch.nn.utils.clip_grad_norm_`` on the single-process model), so every step's update also checks
that each layout counts every gradient exactly once in the norm: a dense gradient counted on every
dp rank, or an expert's on every replica, would clip by another factor.
"""

import dataclasses

import pytest
import torch
from distributed_harness import run_ranks
from tolerances import assert_close_to_scale, assert_moves_close, in_quadrature, model_tolerance, tolerance

from bench.run.sync_timeline import SyncTimeline
from moe_engine import build_model
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig, Trainer

# Every layout trains on its own gloo ranks: seconds each (the fast lane leaves them to CI).
pytestmark = pytest.mark.slow

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, aux_loss_weight=0.0, shared_expert_hidden=16),
)
# Multi-head latent attention with a query latent (values narrower than queries), and group-limited
# learned routing with sigmoid scores, renormalised and scaled weights (DeepSeek-V3's router).
MLA_CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    seq_len=8,
    dtype="fp32",
    mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=24,
        aux_loss_weight=0.0,
        shared_expert_hidden=16,
        score_func="sigmoid",
        normalize_top_k=True,
        n_groups=2,
        top_groups=1,
        routed_scaling_factor=2.5,
    ),
)
# Blocks 0, 1 and 3 dense, 2 and 4 MoE (a leading dense block, then MoE every second block); a head
# width (12) that is not d_model / n_heads.
INTERLEAVED_CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=5,
    n_heads=4,
    n_kv_heads=2,
    head_dim=12,
    seq_len=8,
    dtype="fp32",
    n_dense_layers=1,
    moe_every=2,
    dense_hidden=40,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, aux_loss_weight=0.0),
)
TIED_CONFIG = dataclasses.replace(INTERLEAVED_CONFIG, tie_embeddings=True)
MODELS = {"gqa": CONFIG, "mla": MLA_CONFIG, "interleaved": INTERLEAVED_CONFIG, "interleaved-tied": TIED_CONFIG}
# The first step's gradient norm is about 1.5 (the test checks that clipping engages).
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0, max_grad_norm=0.1)
SEQUENCES, STEPS = 8, 2
# Fixed, so that a failure replays exactly (the model's init and the batches derive from it).
SEED = 1234
EXPERT_PARAMS = ("experts.gate_up", "experts.down")


def _batches(seed: int, config: ModelConfig = CONFIG):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, config.vocab_size, (SEQUENCES, config.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _layout_rank(parallel: ParallelConfig, seed: int, config: ModelConfig = CONFIG):
    groups = build_process_groups(Layout(parallel))
    rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), seed)
    trainer = ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)
    params = dict(rank_model.module.named_parameters())
    before = {n: _full(p).detach().clone() for n, p in params.items()}
    share = SEQUENCES // parallel.dp
    rows = slice(groups.coords.dp_rank * share, (groups.coords.dp_rank + 1) * share)
    losses, grads, norms, overlapped = [], None, [], []
    for tokens, labels in _batches(seed, config):
        timeline = SyncTimeline()
        if not trainer.fsdp:
            trainer.optimizer.sync_observer = timeline
        loss = trainer.step(tokens[rows], labels[rows])
        losses.append(loss)
        norms.append(trainer.last_grad_norm.clone())
        if grads is None and parallel.optimizer_sharding.value == "none":
            grad_of = getattr(trainer.optimizer, "grad_view", lambda param: param.grad)
            # Clipped in place: the gradient the update used.
            grads = {n: _full(grad_of(p)).clone() for n, p in params.items()}
        if not trainer.fsdp:
            overlapped.append(all(t < timeline.backward_end_s for t in timeline.reduce_launch_s.values()))
    updates = {n: _full(p).detach() - before[n] for n, p in params.items()}
    return {
        "coords": groups.coords,
        "losses": losses,
        "grads": grads,
        "updates": updates,
        "norms": norms,
        "overlapped": overlapped,
    }


def _reference(seed: int, config: ModelConfig = CONFIG):
    model = build_model(config, seed=seed)
    trainer = Trainer(model, OPTIMIZER)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, grads, norms = [], None, []
    for tokens, labels in _batches(seed, config):
        losses.append(trainer.step(tokens, labels))
        norms.append(trainer.last_grad_norm)
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    updates = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return torch.stack(losses), grads, updates, torch.stack(norms), before


def _expected(reference: torch.Tensor, name: str, parallel: ParallelConfig, ep_rank: int) -> torch.Tensor:
    if parallel.ep > 1 and name.endswith(EXPERT_PARAMS):
        # Every model here has CONFIG's expert count.
        experts = Layout(parallel).local_experts(ep_rank, CONFIG.moe.num_experts)
        return reference[experts.start : experts.stop]
    return reference


LAYOUTS = {
    "dp2": ParallelConfig(dp=2),
    "dp2-microbatches2": ParallelConfig(dp=2, microbatches=2),
    "ep2-sync": ParallelConfig(dp=2, ep=2, dispatch="sync"),
    "ep2-no-sync": ParallelConfig(dp=2, ep=2, dispatch="no-sync", capacity_factor=2.0),
    "ep2-zero1": ParallelConfig(dp=2, ep=2, dispatch="no-sync", capacity_factor=2.0, optimizer_sharding="zero1"),
    "dp4-ep2": ParallelConfig(dp=4, ep=2, dispatch="no-sync", capacity_factor=2.0),
    "pp2-ep2": ParallelConfig(dp=2, ep=2, pp=2, schedule="1f1b", microbatches=2, capacity_factor=2.0),
    "pp2-interleaved-zero1": ParallelConfig(
        pp=2, schedule="interleaved1f1b", virtual_stages=2, microbatches=4, optimizer_sharding="zero1"
    ),
    "fsdp-dp2": ParallelConfig(dp=2, dp_mode="fsdp"),
}


# The other models on a few layouts each, between them dp, ep (both dispatches), ZeRO-1, pp (1f1b and
# interleaved, where a pipeline rank of the interleaved model holds no MoE block) and FSDP.
CASES = [pytest.param("gqa", name, id=name) for name in LAYOUTS] + [
    pytest.param(model, name, id=f"{model}-{name}", marks=pytest.mark.slow)
    for model, name in [
        ("mla", "ep2-zero1"),
        ("mla", "pp2-ep2"),
        ("interleaved", "pp2-interleaved-zero1"),
        ("interleaved-tied", "dp2-microbatches2"),
        ("interleaved-tied", "fsdp-dp2"),
    ]
]


@pytest.mark.parametrize("model, name", CASES)
def test_layout_trains_like_the_single_process_model(model, name):
    parallel, config = LAYOUTS[name], MODELS[model]
    ranks = run_ranks(_layout_rank, parallel.world_size, parallel, SEED, config, timeout=180)
    ref_losses, ref_grads, ref_updates, ref_norms, ref_before = _reference(SEED, config)
    assert (ref_norms > 2 * OPTIMIZER.max_grad_norm).all(), "clipping engages at every step"

    # The step's loss is the mean of the last pipeline stage's local losses over dp.
    last_stage = [r for r in ranks if r["coords"].pp_rank == parallel.pp - 1]
    assert all(r["losses"][0] is None for r in ranks if r["coords"].pp_rank != parallel.pp - 1)
    losses = torch.stack([torch.stack(r["losses"]) for r in last_stage]).mean(dim=0)
    # Every layout sums the same terms in another order: fp32 rounding of the model's sums. The norm
    # adds its own sums of squares (within each tensor, then over the tensors), and each of the two
    # steps' updates (about proportional to the clipped gradient, eps = 1) carries both roundings.
    tokens = SEQUENCES * config.seq_len
    grad_tol = model_tolerance(config, tokens)
    largest = max(g.numel() for g in ref_grads.values())
    norm_tol = in_quadrature(grad_tol, tolerance(torch.float32, largest, depth=2))
    update_tol = in_quadrature(grad_tol, norm_tol, grad_tol, norm_tol)
    torch.testing.assert_close(losses, ref_losses, rtol=model_tolerance(config, tokens, gradients=False), atol=0)

    seen = set()
    for rank in ranks:
        # Every rank of the layout clips by the same, global norm.
        torch.testing.assert_close(torch.stack(rank["norms"]), ref_norms, rtol=norm_tol, atol=0)
        # Buckets reduce while the last microbatch's backward runs, whatever the microbatch count.
        assert all(rank["overlapped"]), "every bucket launched before backward ended"
        ep_rank = rank["coords"].ep_rank
        seen |= set(rank["updates"])
        for param_name, update in rank["updates"].items():
            expected = _expected(ref_updates[param_name], param_name, parallel, ep_rank)
            params = _expected(ref_before[param_name], param_name, parallel, ep_rank)
            assert_moves_close(update, expected, update_tol, params, STEPS, msg=f"update of {param_name}")
        if rank["grads"] is not None:
            for param_name, grad in rank["grads"].items():
                expected = _expected(ref_grads[param_name], param_name, parallel, ep_rank)
                # Clipped in place: the clip factor's rounding on top of the gradient's.
                clipped_tol = in_quadrature(grad_tol, norm_tol)
                assert_close_to_scale(grad, expected, clipped_tol, msg=f"gradient of {param_name}")
    assert seen == set(ref_updates), "every parameter lives on some rank"
