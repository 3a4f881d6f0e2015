"""The routing ops (``moe_engine::gather_rows``, ``combine_rows`` and their backwards) equal the eager
composition of ``moe.permute`` differentiated by autograd, forward and backward, in fp32 and bf16, on
fresh random inputs (the seed is in every failure message; MOE_KERNEL_SEED repeats it), on the run's
device (the reference path on a CPU, Triton on CUDA; under Triton's interpreter in
tests/integration/toolchains/test_fused_routing_interpreted.py). Bit for bit where the arithmetic is
the same (``fused_cases.tolerances``). A small MoE model with fused kernels runs them and computes the
unfused model's loss and gradients."""

import dataclasses

import pytest
import torch
from fused_cases import (
    DTYPES,
    MODEL_CONFIG,
    ROUTING_OPS,
    SEED,
    assert_matches_eager,
    case_id,
    model_batch,
    routing_cases,
    run_eager,
    run_fused,
)
from op_recording import OpRecorder, saved_while
from tolerances import assert_close_to_scale, model_tolerance

from moe_engine import ModelConfig, build_model, kernels
from moe_engine.kernels import routing
from moe_engine.moe.permute import combine, gather_tokens, plan_routing, plan_slots

ROUTING_OP_NAMES = {
    f"moe_engine::{name}" for name in ("gather_rows", "gather_rows_backward", "combine_rows", "combine_rows_backward")
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", routing_cases(), ids=case_id)
def test_fused_routing_equals_eager_composition(case, dtype, device):
    torch_dtype = DTYPES[dtype]
    paths = kernels.kernel_paths(device, torch_dtype)
    expected = "triton" if device.type == "cuda" else "reference"
    assert all(paths[op].implementation == expected for op in ROUTING_OPS), paths
    got = run_fused(case, torch_dtype, device)
    assert_matches_eager(got, run_eager(case, torch_dtype, device), case, torch_dtype, paths["combine_rows"].details)


def test_combine_keeps_no_gathered_copy(device):
    """The fused combine saves its inputs (y_RD itself, the weights, the indices); the eager one a
    (T, k, D) gathered copy of the rows."""
    tokens, top_k, width = 12, 2, 32
    g = torch.Generator().manual_seed(SEED)
    expert_TK = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)])
    rows = plan_slots(plan_routing(expert_TK, 4), 2, 10).rows
    rows = dataclasses.replace(
        rows,
        **{
            f.name: getattr(rows, f.name).to(device)
            for f in dataclasses.fields(rows)
            if isinstance(getattr(rows, f.name), torch.Tensor)
        },
    )
    y = torch.randn(rows.assignment_R.numel(), width, device=device, requires_grad=True)
    weight = torch.rand(tokens, top_k, device=device, requires_grad=True)
    saved = saved_while(lambda: combine(y, weight, rows, fused=True))
    assert not any(t.shape == (tokens, top_k, width) for t in saved)
    assert sum(t.numel() for t in saved if t.is_floating_point()) == y.numel() + weight.numel()
    assert any(t.data_ptr() == y.data_ptr() for t in saved)
    eager = saved_while(lambda: combine(y, weight, rows))
    assert any(t.shape == (tokens, top_k, width) for t in eager)


def test_gather_and_combine_run_one_op_each_way_only_when_asked(device):
    x = torch.randn(6, 16, device=device, requires_grad=True)
    weight = torch.rand(6, 2, device=device, requires_grad=True)
    rows = plan_routing(torch.tensor([[0, 1], [1, 2], [2, 0], [0, 3], [3, 1], [2, 3]], device=device), 4).rows
    for fused in (False, True):
        with OpRecorder() as recorder:
            combine(gather_tokens(x, rows, fused) * 2.0, weight, rows, fused).sum().backward()
        assert set(recorder.fused()) == (ROUTING_OP_NAMES if fused else set())
        if fused:
            assert all(n == 1 for n in recorder.fused().values())
            assert not {"aten::bmm", "aten::index_select", "aten::masked_fill_"} & set(recorder.ops)


def test_routing_path_rules():
    assert routing.path("cuda", torch.bfloat16, op="combine_rows").details == "triton (CUDA)"
    assert routing.path("cuda", torch.bfloat16, weight_dtype=torch.float32, op="combine_rows").fused
    half = routing.path("cuda", torch.bfloat16, weight_dtype=torch.float16, op="combine_rows")
    assert not half.fused and "float32 or bfloat16 weights, not float16" in half.details
    mixed = routing.path("cuda", torch.bfloat16, torch.float32)
    assert not mixed.fused and "one dtype for all rows, not bfloat16, float32" in mixed.details
    assert routing.path("cpu", torch.float32).details == "reference: the Triton kernel runs on CUDA devices, not cpu"


def test_unsupported_dtype_runs_the_reference(device):
    for case in routing_cases()[:2]:
        got, want = run_fused(case, torch.float64, device), run_eager(case, torch.float64, device)
        assert_matches_eager(got, want, case, torch.float64, "float64")


def test_fused_moe_model_runs_the_routing_ops_and_equals_unfused(device):
    """fp32, on the run's device: the fused model's step runs each routing op once per MoE layer each way
    (and no eager bmm), with the unfused model's loss and gradients."""
    config = ModelConfig(**MODEL_CONFIG)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    tokens, labels = (t.to(device) for t in model_batch(vocab=config.vocab_size))
    results = {}
    for fused in (True, False):
        model = build_model(dataclasses.replace(config, fused_kernels=fused), device, seed=7)
        with OpRecorder() as recorder:
            loss = model.loss(tokens, labels)
            loss.backward()
        routed = {n: c for n, c in recorder.fused().items() if n in ROUTING_OP_NAMES}
        assert routed == ({name: moe_layers for name in ROUTING_OP_NAMES} if fused else {})
        if fused:
            assert "aten::bmm" not in recorder.ops
        results[fused] = (loss.detach(), {name: p.grad for name, p in model.named_parameters()})
    (fused_loss, fused_grads), (loss, grads) = results[True], results[False]
    assert_close_to_scale(
        fused_loss, loss, model_tolerance(config, tokens.numel(), gradients=False), msg=f"loss, seed {SEED}"
    )
    tol = model_tolerance(config, tokens.numel())
    for name, grad in grads.items():
        assert_close_to_scale(fused_grads[name], grad, tol, msg=f"{name}, seed {SEED}")


def test_routing_ops_are_priced_by_the_rows_they_move():
    """bench.predict.fused_ops's rules by hand: T 6 tokens, k 2 (N 12), R 10 slots, D 32, bf16 rows, fp32
    weights, both masks."""
    from bench.predict.ops import TensorSpec, TracedOp, op_work

    def spec(*shape, dtype="torch.bfloat16"):
        return TensorSpec(tuple(shape), dtype)

    x, rows, weight = spec(6, 32), spec(10, 32), spec(6, 2, dtype="torch.float32")
    row, assignment = spec(12, dtype="torch.int64"), spec(10, dtype="torch.int64")
    filled, kept = spec(10, dtype="torch.bool"), spec(12, dtype="torch.bool")
    index = 12 * 8 + 10 * 8 + 10 + 12
    cases = {
        "gather_rows": ((x, assignment, row, filled, kept), (rows,), 2 * 10 * 32 * 2, 0),
        "gather_rows_backward": ((rows, row, kept), (x,), (12 + 6) * 32 * 2, 0),
        "combine_rows": (
            (rows, weight, row, assignment, kept, filled),
            (x,),
            (12 + 6) * 32 * 2 + 6 * 2 * 4,
            2 * 12 * 32,
        ),
        "combine_rows_backward": (
            (x, rows, weight, row, assignment, kept, filled),
            (rows, weight),
            (6 + 12 + 10) * 32 * 2 + 2 * 6 * 2 * 4,
            4 * 12 * 32,
        ),
    }
    for name, (inputs, outputs, moved, flops) in cases.items():
        work = op_work(TracedOp(f"moe_engine.{name}.default", inputs, outputs, "forward"))
        ops_index = sum(t.nbytes for t in inputs if t.dtype in ("torch.int64", "torch.bool"))
        assert (work.kind, work.kernels, work.flops) == ("fused", 1, flops), name
        assert work.nbytes == moved + ops_index, name
    assert (
        sum(t.nbytes for t in cases["combine_rows"][0] if t.dtype != "torch.bfloat16" and t.dtype != "torch.float32")
        == index
    )
