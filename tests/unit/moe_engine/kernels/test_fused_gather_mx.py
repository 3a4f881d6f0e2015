"""The dispatch gather fused with the MXFP8 quantisation (``moe_engine::gather_rows_mx``) writes the
bytes that a plain per-row loop of copies followed by ``mxfp8.quantize`` (the OCP spec's conversion,
checked in tests/unit/moe_engine/precision) writes, on fresh random inputs (the seed is in every failure
message; MOE_KERNEL_SEED repeats it), on the run's device (the reference path on a CPU), in fp32 and
bf16; the Triton kernel under TRITON_INTERPRET=1 is tested in
tests/integration/toolchains/test_fused_gather_mx_interpreted.py. The MXFP8 experts that read their
operand through it give the outputs and gradients of the unfused composition, bit for bit, with and
without the padding rows of an expert-parallel receive buffer; a trace sees the one op instead of the
gather, and the projection prices it by hand-computed bytes."""

import pytest
import torch
from fused_cases import DTYPES
from gather_mx_cases import assert_identical, assert_same_bytes, cases, experts_outputs, run_case
from op_recording import OpRecorder, model_step_ops

from bench.predict.ops import TensorSpec, TracedOp, op_kind, op_work
from moe_engine import ModelConfig
from moe_engine.kernels import gather_mx
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import plan_routing

# --- the op --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_fused_gather_mx_equals_a_loop_of_copies_then_quantize(case, dtype, device):
    assert_same_bytes(run_case(case, DTYPES[dtype], device), case, DTYPES[dtype])


def test_width_not_a_multiple_of_32_takes_the_reference_and_says_why():
    chosen = gather_mx.path("cuda", torch.bfloat16, 40)
    assert not chosen.fused
    assert chosen.details == "reference: the rows' width 40 is not a multiple of MXFP8's block of 32"
    assert gather_mx.path("cuda", torch.bfloat16, 64).fused


# --- the MXFP8 experts reading through it ----------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["local", "received with padding"])
def test_mxfp8_experts_give_the_unfused_outputs_and_gradients(padded):
    assert_identical(experts_outputs(True, padded), experts_outputs(False, padded), "reference path")


def test_unfused_mxfp8_experts_do_not_run_the_fused_gather():
    experts = GroupedExperts(d_model=32, hidden=32, num_experts=2, backend="mxfp8").to(torch.bfloat16)
    plan = plan_routing(torch.tensor([[0], [1], [1]]), 2)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with OpRecorder() as recorder:
        experts(x, plan.groups, rows=plan.rows)
    assert "moe_engine::gather_rows_mx" not in recorder.ops


# --- the trace and the price ---------------------------------------------------------------------------


def test_mxfp8_moe_model_runs_the_fused_gather_instead_of_the_gather():
    """Each MoE layer of an MXFP8 model with fused kernels: one gather_rows_mx forward, the gather's
    backward once, and no separate gather (the combine's ops stay)."""
    from fused_cases import MODEL_CONFIG

    config = ModelConfig(**{**MODEL_CONFIG, "dtype": "bf16", "moe": {**MODEL_CONFIG["moe"], "backend": "mxfp8"}})
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    fused = model_step_ops(config).fused()
    assert fused.get("moe_engine::gather_rows_mx") == moe_layers
    assert fused.get("moe_engine::gather_rows_backward") == moe_layers
    assert "moe_engine::gather_rows" not in fused
    assert fused.get("moe_engine::combine_rows") == moe_layers


def test_price_of_the_fused_gather_by_hand():
    # R = 48 rows of D = 96 bf16 from 24 tokens (top_k 2), slots with a filled mask.
    op = TracedOp(
        "moe_engine.gather_rows_mx.default",
        (
            TensorSpec((24, 96), "torch.bfloat16"),
            TensorSpec((48,), "torch.int64"),
            TensorSpec((48,), "torch.bool"),
            TensorSpec((1,), "torch.int32"),
        ),
        (TensorSpec((48, 96), "torch.uint8"), TensorSpec((48, 3), "torch.uint8")),
        "forward",
    )
    work = op_work(op)
    assert op_kind(op) == "fused" and work.kernels == 1 and work.flops == 0
    # rows read 48 * 96 * 2, codes 48 * 96, scales 48 * 3, indices 48 * 8 + 48 + 4.
    assert work.nbytes == 48 * 96 * 2 + 48 * 96 + 48 * 3 + 48 * 8 + 48 + 4
