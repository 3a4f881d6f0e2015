"""The dispatch gather fused with the MXFP8 quantisation (``moe_engine::gather_rows_mx``) writes the
bytes that a plain per-row loop of copies followed by ``mxfp8.quantize`` (the OCP spec's conversion,
checked in tests/unit/moe_engine/precision) writes, on fresh random inputs (the seed is in every failure message;
MOE_KERNEL_SEED repeats it): on the run's device (the reference path on a CPU) and through the Triton
kernel under TRITON_INTERPRET=1, in fp32 and bf16. The MXFP8 experts that read their operand through
it give the outputs and gradients of the unfused composition, bit for bit, with and without the
padding rows of an expert-parallel receive buffer; a trace sees the one op instead of the gather, and
the projection prices it by hand-computed bytes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fused_cases import DTYPES, SEED
from op_recording import OpRecorder, model_step_ops

from bench.predict.ops import TensorSpec, TracedOp, op_kind, op_work
from bench.results import REPO_ROOT
from moe_engine import ModelConfig, kernels
from moe_engine.kernels import gather_mx
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups, gather_tokens, plan_routing, plan_slots, sort_permutation
from moe_engine.precision.mxfp8.blocks import quantize

HERE = Path(__file__).resolve().parent


# --- inputs --------------------------------------------------------------------------------------------


def _tokens(g: torch.Generator, tokens: int, width: int, special: bool = True) -> torch.Tensor:
    """Rows of mixed magnitudes; with ``special`` a NaN, an Inf, a zero row and fp32 subnormals."""
    x = torch.randn(tokens, width, generator=g) * 10.0 ** torch.randint(-20, 21, (tokens, 1), generator=g)
    if special and tokens >= 4:
        x[0, 3] = float("nan")
        x[1, width - 1] = float("inf")
        x[2] = 0.0
        x[3] = torch.linspace(-1e-40, 1e-40, width)
    return x


def cases(seed: int = SEED) -> list[dict]:
    """name, token rows, the map (assignment, top_k, filled) and end. Edge cases: an expert with no rows,
    dropped assignments and empty slots, padding rows after ``end`` holding NaN, one token, no rows,
    more rows than one program's tile, widths of one block and of three."""
    g = torch.Generator().manual_seed(seed + 7)
    routes = torch.randint(0, 5, (40, 2), generator=g)
    routes[routes == 3] = 4  # expert 3 gets no rows
    local = plan_routing(routes, 5)
    skewed = plan_routing(torch.tensor([[0, 1]] * 5 + [[2, 1]] * 3), 4)
    slots = plan_slots(skewed, 2, 5).rows
    # A receiver's sort: 150 rows, 7 of them padding (local expert id L = 3 sorts them last).
    local_R = torch.randint(0, 3, (150,), generator=g)
    local_R[torch.randperm(150, generator=g)[:7]] = 3
    received = sort_permutation(local_R)
    one = plan_routing(torch.tensor([[1]]), 3)

    def case(name, x, rows, end=None):
        r = rows.assignment_R.numel()
        return {
            "name": name,
            "x": x,
            "assignment": rows.assignment_R,
            "top_k": rows.top_k,
            "filled": rows.filled_R,
            "end": torch.tensor([r if end is None else end], dtype=torch.int32),
        }

    return [
        case("40 tokens, top_k 2, expert 3 empty, width 64", _tokens(g, 40, 64), local.rows),
        case("slots: dropped and empty, width 32", _tokens(g, 8, 32), slots),
        case(
            "received 150 rows, 7 padding, width 96",
            _tokens(g, 150, 96).index_fill_(0, torch.tensor([149]), float("nan")),
            received,
            end=143,
        ),
        case("one token, width 32", _tokens(g, 1, 32, special=False), one.rows),
        case("no rows, width 64", _tokens(g, 3, 64), plan_routing(torch.empty(0, 2, dtype=torch.int64), 4).rows),
        case(
            "width 40: the reference pads it",
            _tokens(g, 6, 40),
            plan_routing(torch.randint(0, 3, (6, 2), generator=g), 3).rows,
        ),
    ]


def loop_reference(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One row at a time: the copy, zero where empty or past ``end``, then ``mxfp8.quantize``."""
    x = case["x"].to(dtype)
    rows, width = case["assignment"].numel(), x.shape[1]
    padded = -(-width // 32) * 32
    out = torch.zeros(rows, padded, dtype=dtype)
    for r in range(rows):
        filled = case["filled"] is None or bool(case["filled"][r])
        if filled and r < int(case["end"][0]):
            out[r, :width] = x[int(case["assignment"][r]) // case["top_k"]]
    codes, scales = quantize(out, axis=-1)
    return codes.view(torch.uint8), scales.view(torch.uint8)


def run_case(case: dict, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    filled = None if case["filled"] is None else case["filled"].to(device)
    codes, scales = kernels.gather_rows_mx(
        case["x"].to(device, dtype), case["assignment"].to(device), case["top_k"], filled, case["end"].to(device)
    )
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    return codes.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()


def assert_same_bytes(got, case, dtype):
    want = loop_reference(case, dtype)
    for name, a, b in zip(("codes", "scales"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        bad = (a != b).nonzero()
        assert not len(bad), (
            f"seed {SEED}, {case['name']}, {dtype}: {len(bad)} {name} differ, first at {bad[:3].tolist()}"
        )


# --- the op --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_fused_gather_mx_equals_a_loop_of_copies_then_quantize(case, dtype, device):
    assert_same_bytes(run_case(case, DTYPES[dtype], device), case, DTYPES[dtype])


_CHILD = """
import sys, torch
sys.path[:0] = sys.argv[3:]
from test_fused_gather_mx import DTYPES, run_case, experts_outputs
from moe_engine import kernels
from moe_engine.kernels import dispatch, gather_mx
assert dispatch.interpreted(gather_mx._gather_mx_kernel), "TRITON_INTERPRET=1 did not reach the kernel"
inputs = torch.load(sys.argv[1])
outputs = {"paths": {d: kernels.kernel_paths("cpu", t)["gather_rows_mx"].implementation for d, t in DTYPES.items()}}
for case in inputs["cases"]:
    for d, t in DTYPES.items():
        outputs[case["name"], d] = run_case(case, t)
for padded in (False, True):
    outputs["experts", padded] = {fused: experts_outputs(fused, padded) for fused in (False, True)}
torch.save(outputs, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case through the Triton kernel, and the MXFP8 experts both ways, under Triton's interpreter."""
    folder = tmp_path_factory.mktemp("gather_mx_interpreter")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save({"cases": cases()}, inputs)
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, MOE_KERNEL_SEED=str(SEED))
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs), str(HERE), str(REPO_ROOT / "tests" / "support")]
    run = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs)


def test_interpreter_ran_the_kernel(interpreted):
    assert interpreted["paths"] == {"fp32": "triton", "bf16": "triton"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_interpreted_kernel_equals_a_loop_of_copies_then_quantize(interpreted, case, dtype):
    assert_same_bytes(interpreted[case["name"], dtype], case, DTYPES[dtype])


def test_width_not_a_multiple_of_32_takes_the_reference_and_says_why():
    chosen = gather_mx.path("cuda", torch.bfloat16, 40)
    assert not chosen.fused
    assert chosen.details == "reference: the rows' width 40 is not a multiple of MXFP8's block of 32"
    assert gather_mx.path("cuda", torch.bfloat16, 64).fused


# --- the MXFP8 experts reading through it ----------------------------------------------------------------


def experts_outputs(fused: bool, padded: bool) -> dict[str, torch.Tensor]:
    """Outputs and gradients of bf16 MXFP8 experts on gathered rows: fused, the experts gather
    and quantize in one op; unfused, the rows are gathered first (``gather_tokens``, the same fused
    gather op as the engine's other paths) and the experts quantize them. ``padded``: a receiver's
    buffer, its padding rows NaN."""
    g = torch.Generator().manual_seed(SEED + 11)
    experts = GroupedExperts(d_model=64, hidden=32, num_experts=4, backend="mxfp8", fused_kernels=True)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    experts = experts.to(torch.bfloat16)
    if padded:
        local_R = torch.randint(0, 4, (50,), generator=g)
        local_R[torch.randperm(50, generator=g)[:6]] = 4  # 6 padding rows, after the last offset once sorted
        rows = sort_permutation(local_R)
        counts_E = torch.bincount(local_R, minlength=5)[:4]
        x = torch.randn(50, 64, generator=g)
        x[local_R == 4] = float("nan")
    else:
        plan = plan_routing(torch.randint(0, 4, (30, 2), generator=g), 4)
        rows, counts_E = plan.rows, plan.groups.counts_E
        x = torch.randn(30, 64, generator=g)
    x = x.to(torch.bfloat16).requires_grad_()
    groups = ExpertGroups.from_counts(counts_E)
    if fused:
        y = experts(x, groups, rows=rows)
    else:
        y = experts(gather_tokens(x, rows, fused=True), groups)
    grad_y = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(grad_y)
    return {"y": y.detach(), "grad_x": x.grad, "grad_gate_up": experts.gate_up.grad, "grad_down": experts.down.grad}


def _assert_identical(fused: dict, unfused: dict, where: str):
    for name in unfused:
        a, b = fused[name], unfused[name]
        same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert same, f"seed {SEED}, {where}: {name} differs by up to {(a.float() - b.float()).abs().nan_to_num().max()}"
    assert not unfused["y"].isnan().any() and not unfused["grad_x"].isnan().any()


@pytest.mark.parametrize("padded", [False, True], ids=["local", "received with padding"])
def test_mxfp8_experts_give_the_unfused_outputs_and_gradients(padded):
    _assert_identical(experts_outputs(True, padded), experts_outputs(False, padded), "reference path")


@pytest.mark.parametrize("padded", [False, True], ids=["local", "received with padding"])
def test_interpreted_mxfp8_experts_give_the_unfused_outputs_and_gradients(interpreted, padded):
    both = interpreted["experts", padded]
    _assert_identical(both[True], both[False], "Triton interpreter")


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
