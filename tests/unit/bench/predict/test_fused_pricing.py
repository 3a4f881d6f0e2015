"""The projection's work and price of the engine's fused ops against hand-computed bytes, FLOPs and
kernels (the formulas of ``bench.predict.fused_ops``, worked out here by hand at small sizes), and a
real trace of the fused loss carrying what its price needs."""

from __future__ import annotations

import re

import pytest
import torch
from profiles import profile_with

import moe_engine.kernels  # noqa: F401  (registers the moe_engine:: ops)
from bench.predict.fused_ops import FUSED_OPS
from bench.predict.ops import TensorSpec, TracedOp, op_kind, op_work
from bench.predict.pricing import op_seconds
from moe_engine.kernels.cross_entropy import linear_cross_entropy


def spec(*shape, dtype="torch.bfloat16"):
    return TensorSpec(tuple(shape), dtype)


def ce_forward(n, d, v, chunk_rows, dtype="torch.bfloat16"):
    return TracedOp(
        "moe_engine.linear_cross_entropy.default",
        (spec(n, d, dtype=dtype), spec(v, d, dtype=dtype), spec(n, dtype="torch.int64")),
        (spec(dtype="torch.float32"), spec(n, dtype="torch.float32")),
        "forward",
        arguments=(("ignore_index", -100), ("chunk_rows", chunk_rows)),
    )


def ce_backward(n, d, v, chunk_rows, dtype="torch.bfloat16"):
    return TracedOp(
        "moe_engine.linear_cross_entropy_backward.default",
        (
            spec(dtype="torch.float32"),
            spec(n, d, dtype=dtype),
            spec(v, d, dtype=dtype),
            spec(n, dtype="torch.int64"),
            spec(n, dtype="torch.float32"),
        ),
        (spec(n, d, dtype=dtype), spec(v, d, dtype=dtype)),
        "backward",
        arguments=(("ignore_index", -100), ("chunk_rows", chunk_rows)),
    )


def test_every_registered_fused_op_has_a_rule():
    registered = {
        name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("moe_engine::")
    }
    assert registered == set(FUSED_OPS)


def test_cross_entropy_forward_by_hand():
    # N = 10 rows, D = 8, V = 50, chunks of 4: c = 3 (4, 4, 2 rows), bf16 (s = 2).
    work = op_work(ce_forward(10, 8, 50, 4))
    assert op_kind(ce_forward(10, 8, 50, 4)) == "fused"
    assert work.flops == 2 * 10 * 50 * 8
    # Per chunk of C rows: GEMM (C*8 + 50*8 + C*50) * 2, loss pass C*50*2 + 16C, two copies of 8C;
    # once: 9N + (N + 8) + 12 (the count), 4N + 4 (sum), 12 (mean).
    chunk = [(c * 8 + 400 + c * 50) * 2 + c * 100 + 16 * c + 16 * c for c in (4, 4, 2)]
    once = 90 + 18 + 12 + 44 + 12
    assert work.nbytes == sum(chunk) + once
    # The docstring's closed form: N D s + c V D s + 2 N V s + 46 N + 36.
    assert work.nbytes == 10 * 8 * 2 + 3 * 50 * 8 * 2 + 2 * 10 * 50 * 2 + 46 * 10 + 36
    assert work.kernels == 4 * 3 + 5


def test_cross_entropy_backward_by_hand():
    work = op_work(ce_backward(10, 8, 50, 4))
    assert work.flops == 6 * 10 * 50 * 8
    # Per chunk: logits GEMM (8C + 400 + 50C) * 2, grad pass 2 * 50C * 2 + 12C + 4, grad_h GEMM
    # (50C + 400 + 8C) * 2, grad_W GEMM (50C + 8C + 800) * 2; once: count 10N + 20, scale 12, zeros 400 * 2.
    per_chunk = sum(
        (58 * c + 400) * 2 + 200 * c + 12 * c + 4 + (58 * c + 400) * 2 + (58 * c + 800) * 2 for c in (4, 4, 2)
    )
    assert work.nbytes == per_chunk + 100 + 20 + 12 + 800
    assert work.nbytes == 3 * 10 * 8 * 2 + (4 * 3 + 1) * 50 * 8 * 2 + 5 * 10 * 50 * 2 + 22 * 10 + 4 * 3 + 32
    assert work.kernels == 4 * 3 + 5


def test_one_chunk_when_chunk_rows_covers_the_rows():
    work = op_work(ce_forward(10, 8, 50, 64, dtype="torch.float32"))
    assert work.kernels == 4 + 5
    assert work.nbytes == 10 * 8 * 4 + 50 * 8 * 4 + 2 * 10 * 50 * 4 + 46 * 10 + 36


def test_one_pass_ops_move_their_tensors_once():
    x, w = spec(6, 32), spec(32)
    norm = TracedOp(
        "moe_engine.rms_norm.default",
        (x, w),
        (x, spec(6, dtype="torch.float32")),
        "forward",
        arguments=(("eps", 1e-6),),
    )
    work = op_work(norm)
    assert (work.kind, work.flops, work.kernels) == ("fused", 0.0, 1)
    assert work.nbytes == 6 * 32 * 2 + 32 * 2 + 6 * 32 * 2 + 6 * 4
    swiglu = TracedOp(
        "moe_engine.swiglu_packed_backward.default", (spec(6, 64), spec(6, 32)), (spec(6, 32), spec(6, 64)), "backward"
    )
    assert op_work(swiglu).nbytes == 2 * (6 * 64 + 6 * 32) * 2
    backward = TracedOp(
        "moe_engine.rms_norm_backward.default", (x, x, x, w, spec(6, dtype="torch.float32")), (x, w), "backward"
    )
    # The row kernel, the partial sums' reduction and their cast to bf16.
    assert op_work(backward).kernels == 3


def test_unknown_fused_op_names_the_file_to_extend():
    with pytest.raises(ValueError, match=re.escape("bench/predict/fused_ops.py")):
        op_work(TracedOp("moe_engine.router_topk.default", (spec(4, 8),), (spec(4, 2),), "forward"))


def test_cross_entropy_price_is_its_gemms_plus_its_passes_by_hand():
    p = profile_with(
        **{
            "peak_tflops.bf16": 1000.0,
            "hbm_gbps": 2000.0,
            "efficiency.gemm": 0.5,
            "efficiency.memory": 0.8,
            "efficiency.launch_overhead_us": 5.0,
        }
    )
    # One chunk of 4096 rows, D 4096, V 131072: the logits GEMM is compute-bound.
    n, d, v = 4096, 4096, 131072
    work = op_work(ce_forward(n, d, v, n))
    gemm = 2 * n * v * d / 500e12
    loss_pass = (n * v * 2 + 16 * n) / 1600e9
    small = (8 * n * 2 + 9 * n + n + 8 + 12 + 4 * n + 4 + 12) / 1600e9
    assert op_seconds(work, p) == pytest.approx(gemm + loss_pass + small + 9 * 5e-6)
    # Twice the rows at the same chunk: two chunks, twice the seconds but for the once-only kernels.
    two = op_work(ce_forward(2 * n, d, v, n))
    assert op_seconds(two, p) == pytest.approx(
        2 * (gemm + loss_pass + 16 * n / 1600e9 + 4 * 5e-6)
        + (9 * 2 * n + 2 * n + 8 + 12 + 8 * n + 4 + 12) / 1600e9
        + 5 * 5e-6
    )


def test_trace_records_the_chunking_the_loss_runs():
    from bench.run.trace import _scalar_arguments

    torch.manual_seed(0)
    h, w = torch.randn(2, 5, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (2, 5))
    seen = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "moe_engine":
                seen.append(dict(_scalar_arguments(func, args, kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Record():
        linear_cross_entropy(h, w, labels)
    # 10 rows, D 16, V 40: the default chunk (a power of two near N / ceil(V / D) = 10 / 3) is 4 rows.
    assert seen == [{"ignore_index": -100, "chunk_rows": 4}]
