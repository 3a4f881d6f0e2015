"""The data-parallel optimizer in one process: exactly master-weight AdamW with and without ZeRO-1
sharding, and the gradient buffers' precision. DDP gradient buffers and ZeRO-1 on gloo ranks against
single-process training on the full batch: tests/integration/distributed/test_data_parallel_ranks.py."""

import pytest
import torch
from data_parallel_cases import (
    OPT,
    SEED,
    SMALL_BUCKET,
    assert_grads_match,
    full_batch_reference,
    grads_of,
    params_of,
    small_config,
    token_batches,
)
from tolerances import tolerance

from moe_engine import build_model
from moe_engine.parallel.data_parallel import DataParallelOptimizer, ParamFamily, SyncObserver, param_families
from moe_engine.train import OptimizerConfig

# ---- single process (no collectives) ----


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shard", [False, True])
def test_single_process_is_exactly_master_weight_adamw(dtype, shard):
    reference = full_batch_reference(dtype, 2)
    model = build_model(small_config(dtype), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT, shard=shard, bucket_elements=SMALL_BUCKET)
    for step, (tokens, labels) in enumerate(token_batches(2)):
        opt.zero_grad()
        opt.arm_overlap()
        model.loss(tokens, labels).backward()
        opt.step()
        for name, param in params_of(model).items():
            assert torch.equal(param, reference["params"][step][name]), name
    assert opt.state_bytes() == reference["state_bytes"]
    # Without collectives there is no separate reduce-scatter output: the state is all there is.
    assert sum(t.nbytes for t in opt.state_tensors()) == opt.state_bytes()


@pytest.mark.parametrize("grad_dtype", ["fp32", "param"])
def test_parameters_keep_identity_and_become_buffer_views(grad_dtype):
    model = build_model(small_config("bf16"), seed=SEED)
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
    model = build_model(small_config("fp32"), seed=SEED)
    # Every gradient through .grad: a replaced one reaches the hook, which puts it back.
    opt = DataParallelOptimizer(model, None, OPT, accumulate_in_gemm=False)
    tokens, labels = token_batches(1)[0]
    model.loss(tokens, labels).backward()
    views = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)  # what a careless caller might do
    model.loss(tokens, labels).backward()
    grads = grads_of(model)
    for name, param in model.named_parameters():
        assert param.grad is views[name], name
    opt.zero_grad()
    assert all(bool((p.grad == 0).all()) for p in model.parameters())
    model.loss(tokens, labels).backward()
    # The same backward of the same model and batch, in the same order: exactly the same numbers.
    assert_grads_match(grads_of(model), grads, tol=0.0)


def test_a_cleared_view_is_an_error_where_a_gemm_adds_into_the_buffer():
    """The experts' GEMMs add into the buffer whatever ``.grad`` holds, so ``model.zero_grad()`` would
    leave the last backward's gradients in it: the hook says so rather than training on them."""
    model = build_model(small_config("fp32"), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT)
    tokens, labels = token_batches(1)[0]
    model.loss(tokens, labels).backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"DataParallelOptimizer.zero_grad\(\)"):
        model.loss(tokens, labels).backward()
    opt.zero_grad()
    model.loss(tokens, labels).backward()  # fine after the optimizer's zero_grad


def test_backward_into_a_reduced_bucket_is_an_error():
    model = build_model(small_config("fp32"), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT)
    tokens, labels = token_batches(1)[0]
    opt.arm_overlap()
    model.loss(tokens, labels).backward()
    with pytest.raises(RuntimeError, match="a gradient arrived after its bucket was reduced"):
        model.loss(tokens, labels).backward()
    opt.zero_grad()
    model.loss(tokens, labels).backward()  # fine again after zero_grad


def test_a_sync_observer_is_told_each_launch_in_order():
    model = build_model(small_config("fp32"), seed=SEED)
    opt = DataParallelOptimizer(model, None, OPT, shard=True, bucket_elements=SMALL_BUCKET)
    told = []

    class Observer:
        def __getattr__(self, event: str):
            return lambda *bucket: told.append((event, *bucket))

    opt.sync_observer = Observer()
    tokens, labels = token_batches(1)[0]
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
    model = build_model(small_config("bf16"), seed=SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens, labels = token_batches(1)[0]
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
    model = build_model(small_config("fp32"), seed=SEED)
    reference = build_model(small_config("fp32"), seed=SEED)
    tokens, labels = token_batches(1)[0]
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
