"""DDP gradient buffers and the ZeRO-1 optimizer agree with single-process training on the full batch.

Spawned jobs are few and grouped: one 2-rank job (dp=2) runs every model-level check and returns
its tensors; one 4-rank job (dp=4, ep=2) checks the expert-family arithmetic on hand-set gradients.
References are computed here, in the test process.
"""

import pytest
import torch
from tolerances import model_tolerance, tolerance

from moe_engine import ModelConfig, MoEConfig, build_model
from moe_engine.parallel.data_parallel import DataParallelOptimizer, ParamFamily, SyncObserver, param_families
from moe_engine.train import MasterWeightAdamW, OptimizerConfig

# Multi-rank jobs behind the module's fixtures: seconds each (the fast lane leaves them to CI).
pytestmark = pytest.mark.slow

SEED = 3
BATCH = 4
# Smaller than most parameters: every matrix gets its own bucket, so many buckets launch in backward.
SMALL_BUCKET = 1000
# These tests check the reduction and update arithmetic; clipping has its own tests.
OPT = OptimizerConfig(max_grad_norm=0.0)


def _config(dtype: str, z_loss_weight: float = 0.001) -> ModelConfig:
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


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    shape = (BATCH, 8)
    return [
        (torch.randint(0, 64, shape, generator=generator), torch.randint(0, 64, shape, generator=generator))
        for _ in range(steps)
    ]


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# ---- what every rank runs ----


# ---- references and fixtures ----


def _reference(dtype: str, steps: int, z_loss_weight: float = 0.001) -> dict:
    model = build_model(_config(dtype, z_loss_weight), seed=SEED)
    opt = MasterWeightAdamW(model.parameters(), OPT)
    initial, grads, history = _params(model), [], []
    for tokens, labels in _batches(steps):
        opt.zero_grad()
        model.loss(tokens, labels).backward()
        grads.append(_grads(model))
        opt.step()
        history.append(_params(model))
    return {"initial": initial, "grads": grads, "params": history, "state_bytes": opt.state_bytes()}


def _assert_grads_match(got: dict, want: dict, tol: float | None = None) -> None:
    """Default: the model's gradients on the full batch against two half batches' reduced, which sum
    the same terms in another order (fp32 rounding of the model's sums)."""
    tol = model_tolerance(_config("fp32"), BATCH * 8) if tol is None else tol
    for name, grad in want.items():
        assert _relative_error(got[name], grad) <= tol, name


# ---- dp=2 on the model ----


# ---- expert-family arithmetic on hand-set gradients ----


# ---- single process (no collectives) ----


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shard", [False, True])
def test_single_process_is_exactly_master_weight_adamw(dtype, shard):
    reference = _reference(dtype, 2)
    model = build_model(_config(dtype), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT, shard=shard, bucket_elements=SMALL_BUCKET)
    for step, (tokens, labels) in enumerate(_batches(2)):
        opt.zero_grad()
        opt.arm_overlap()
        model.loss(tokens, labels).backward()
        opt.step()
        for name, param in _params(model).items():
            assert torch.equal(param, reference["params"][step][name]), name
    assert opt.state_bytes() == reference["state_bytes"]
    # Without collectives there is no separate reduce-scatter output: the state is all there is.
    assert sum(t.nbytes for t in opt.state_tensors()) == opt.state_bytes()


@pytest.mark.parametrize("grad_dtype", ["fp32", "param"])
def test_parameters_keep_identity_and_become_buffer_views(grad_dtype):
    model = build_model(_config("bf16"), seed=SEED)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    opt = DataParallelOptimizer(model, None, OPT, bucket_elements=SMALL_BUCKET, grad_dtype=grad_dtype)
    for name, param in model.named_parameters():
        original, values = before[name]
        assert param is original and torch.equal(param.detach(), values), name
    for bucket in opt.buckets:
        assert len({p.dtype for p in bucket.params}) == 1
        for param, offset in zip(bucket.params, bucket.offsets):
            assert param.data_ptr() == bucket.param_N[offset:].data_ptr()
            view = opt.grad_view(param)
            assert view.data_ptr() == bucket.grad_N[offset:].data_ptr()
            # fp32 buffers for the bf16 parameters; the router is fp32 either way.
            assert view.dtype == (torch.float32 if grad_dtype == "fp32" else param.dtype)
            assert (param.grad is view) == (view.dtype == param.dtype)
    expert_ids = {id(p) for p in param_families(model)[ParamFamily.EXPERT]}
    assert {id(model.blocks[1].ffn.experts.gate_up), id(model.blocks[1].ffn.experts.down)} == expert_ids
    assert id(model.blocks[1].ffn.router.weight) not in expert_ids


def test_zero_grad_keeps_views_and_replaced_gradients_are_taken_back():
    model = build_model(_config("fp32"), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT)
    tokens, labels = _batches(1)[0]
    model.loss(tokens, labels).backward()
    views = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)  # what a careless caller might do
    model.loss(tokens, labels).backward()
    grads = _grads(model)
    for name, param in model.named_parameters():
        assert param.grad is views[name], name
    opt.zero_grad()
    assert all(bool((p.grad == 0).all()) for p in model.parameters())
    model.loss(tokens, labels).backward()
    # The same backward of the same model and batch, in the same order: exactly the same numbers.
    _assert_grads_match(_grads(model), grads, tol=0.0)


def test_backward_into_a_reduced_bucket_is_an_error():
    model = build_model(_config("fp32"), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT)
    tokens, labels = _batches(1)[0]
    opt.arm_overlap()
    model.loss(tokens, labels).backward()
    with pytest.raises(RuntimeError, match="a gradient arrived after its bucket was reduced"):
        model.loss(tokens, labels).backward()
    opt.zero_grad()
    model.loss(tokens, labels).backward()  # fine again after zero_grad


def test_a_sync_observer_is_told_each_launch_in_order():
    model = build_model(_config("fp32"), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT, shard=True, bucket_elements=SMALL_BUCKET)
    told = []

    class Observer:
        def __getattr__(self, event: str):
            return lambda *bucket: told.append((event, *bucket))

    opt.sync_observer = Observer()
    tokens, labels = _batches(1)[0]
    opt.arm_overlap()
    model.loss(tokens, labels).backward()
    launched_in_backward = len(told)
    opt.step()
    buckets = range(len(opt.buckets))
    assert told == [
        *[("reduce_launched", i) for i in buckets],
        ("backward_ended",),
        ("reductions_waited",),
        *[("gather_launched", i) for i in buckets],
        ("updates_ended",),
        ("gathers_waited",),
    ]
    # Every parameter gets its gradient in backward, so every reduction launches there.
    assert launched_in_backward == len(opt.buckets) > 1
    assert {event for event, *_ in told} == {name for name in vars(SyncObserver) if not name.startswith("_")}


# ---- gradient precision ----


@pytest.mark.parametrize("grad_dtype", ["fp32", "param"])
def test_microbatch_gradients_accumulate_in_the_buffer_dtype(grad_dtype):
    # Reference: each microbatch's bf16 gradient from autograd, summed by hand in fp32 (or in bf16,
    # in order, for grad_dtype "param"): the buffer must hold exactly that.
    microbatches = 4
    model = build_model(_config("bf16"), seed=SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens, labels = _batches(1)[0]
    per_microbatch = [
        torch.autograd.grad(model.loss(t, target), params)
        for t, target in zip(tokens.chunk(microbatches), labels.chunk(microbatches))
    ]
    opt = DataParallelOptimizer(model, None, OPT, grad_dtype=grad_dtype)
    for t, target in zip(tokens.chunk(microbatches), labels.chunk(microbatches)):
        model.loss(t, target).backward()
    for index, param in enumerate(params):
        dtype = torch.float32 if grad_dtype == "fp32" else param.dtype
        expected = torch.zeros(param.shape, dtype=dtype)
        for grads in per_microbatch:
            expected += grads[index].to(dtype)
        got = opt.grad_view(param)
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if grad_dtype == "fp32":
        # The sums differ from bf16 accumulation somewhere (else the test could not tell them apart).
        bf16_sums = [sum(g[i] for g in per_microbatch[1:]) + per_microbatch[0][i] for i in range(len(params))]
        assert any(
            not torch.equal(opt.grad_view(p), s.float()) for p, s in zip(params, bf16_sums) if s.dtype == torch.bfloat16
        )


def test_clipping_equals_clip_grad_norm_in_one_process():
    model = build_model(_config("fp32"), seed=SEED)
    reference = build_model(_config("fp32"), seed=SEED)
    tokens, labels = _batches(1)[0]
    reference.loss(tokens, labels).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(max_grad_norm=0.05), bucket_elements=SMALL_BUCKET)
    model.loss(tokens, labels).backward()
    opt.finish_grad_sync()
    norm = opt.clip_grad_norm()
    assert want_norm > 0.1, "clipping engages"
    # The same gradients; the norms sum their squares in other groupings (per bucket or per tensor,
    # then over those), and each clipped entry carries the norm's rounding.
    norm_tol = tolerance(torch.float32, max(p.numel() for p in model.parameters()), depth=2)
    torch.testing.assert_close(norm, want_norm, rtol=norm_tol, atol=0)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(opt.grad_view(param), ref.grad, rtol=norm_tol, atol=0, msg=name)
