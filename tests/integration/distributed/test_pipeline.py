"""Pipeline parallelism: every schedule computes the single-process loss and gradients."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from tolerances import assert_close_to_scale, model_tolerance
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine import build_model
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.pipeline import Pipeline

# Each schedule on its own gloo ranks: seconds each (the fast lane leaves them to CI).
pytestmark = pytest.mark.slow

CONFIG = dict(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=dict(num_experts=4, top_k=2, expert_hidden=24, aux_loss_weight=0.0, shared_expert_hidden=16),
)
# Fixed, so that a failure replays exactly (the model's init and the batches derive from it).
SEED = 1234


def _config(fused_kernels: bool = False) -> ModelConfig:
    data = dict(CONFIG)
    return ModelConfig(
        **{k: v for k, v in data.items() if k != "moe"}, moe=MoEConfig(**data["moe"]), fused_kernels=fused_kernels
    )


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def _batch(seed: int):
    tokens = torch.randint(
        0, CONFIG["vocab_size"], (8, CONFIG["seq_len"] + 1), generator=torch.Generator().manual_seed(seed)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _pipeline_rank(parallel: ParallelConfig, seed: int, fused_kernels: bool = False):
    model = build_model(_config(fused_kernels), seed=seed)
    layout = Layout(parallel)
    pipeline = Pipeline(model, parallel, layout.stage_indices(dist.get_rank()), dist.group.WORLD, torch.device("cpu"))
    tokens, labels = _batch(seed)
    with _OpNames() as ops:
        loss = pipeline.step(tokens, labels)
    grads = {
        name: p.grad.clone()
        for module in pipeline.modules
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    return {"loss": loss, "grads": grads, "ops": ops.names}


def _reference(seed: int):
    model = build_model(_config(), seed=seed)
    tokens, labels = _batch(seed)
    loss = model.loss(tokens, labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(pp=2, schedule="gpipe", microbatches=2),
        ParallelConfig(pp=2, schedule="1f1b", microbatches=4),
        ParallelConfig(pp=2, schedule="interleaved1f1b", virtual_stages=2, microbatches=4),
    ],
    ids=["gpipe", "1f1b", "interleaved1f1b"],
)
def test_pipeline_schedules_match_single_process(parallel):
    ranks = run_ranks(_pipeline_rank, parallel.pp, parallel, SEED, timeout=120)
    ref_loss, ref_grads = _reference(SEED)

    assert ranks[0]["loss"] is None  # only the last stage computes the loss
    # Microbatches sum the same terms in another order: fp32 rounding of the model's sums.
    tokens = 8 * CONFIG["seq_len"]
    loss_rtol = model_tolerance(_config(), tokens, gradients=False)
    torch.testing.assert_close(ranks[-1]["loss"], ref_loss, rtol=loss_rtol, atol=0)
    got = {}
    for rank in ranks:
        assert not set(rank["grads"]) & set(got), "a parameter lives on two stages"
        got.update(rank["grads"])
    assert set(got) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert_close_to_scale(got[name], grad, model_tolerance(_config(), tokens), msg=name)


def test_fused_pipeline_keeps_no_logits_and_matches_the_unfused_single_process_step():
    # The last stage ends at the final norm and its loss is the fused LM head + cross-entropy.
    parallel = ParallelConfig(pp=2, schedule="1f1b", microbatches=4)
    ranks = run_ranks(_pipeline_rank, parallel.pp, parallel, SEED, True, timeout=120)
    ref_loss, ref_grads = _reference(SEED)
    last = ranks[-1]
    assert "moe_engine::linear_cross_entropy" in last["ops"]
    assert not {"aten::_log_softmax", "aten::nll_loss_forward"} & last["ops"]
    tokens = 8 * CONFIG["seq_len"]
    torch.testing.assert_close(last["loss"], ref_loss, rtol=model_tolerance(_config(), tokens, gradients=False), atol=0)
    got = {name: g for rank in ranks for name, g in rank["grads"].items()}
    assert set(got) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert_close_to_scale(got[name], grad, model_tolerance(_config(), tokens), msg=f"{name}, seed {SEED}")
