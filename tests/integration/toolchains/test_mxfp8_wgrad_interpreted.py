"""The MXFP8 weight gradients' Triton kernels run by Triton's interpreter on CPU tensors, in a fresh process
under TRITON_INTERPRET=1 (set before the kernels are defined): the token-block quantizer against the torch
composition byte for byte (fp32 and bf16 rows, empty experts, NaN padding rows, an expert over several
blocks), and the grouped GEMM against a per-expert fp64 loop over the specification's values, added into a
non-zero fp32 buffer and handed back in fp32 and bf16, every buffer guarded and every output poisoned
(``fused_cases.poisoned_run``); and the GEMM as the engine launches it, compiled for sm_100a without a GPU,
holding Blackwell's block-scaled MMA.

Tolerances: the kernel sums exact E4M3 x E4M3 products in fp32 (``tolerances.tolerance`` over an expert's
rows); a bf16 output is one rounding (2^-8 of the largest value) from that."""

import subprocess
import sys

import pytest
import torch
from interpreted_kernels import interpreter_env
from mxfp8_wgrad_cases import CASES, token_operand, wgrad_loop
from tolerances import tolerance

from bench.results import REPO_ROOT

_CHILD = """
import sys, torch
from fused_cases import poisoned_run
from moe_engine.precision.mxfp8 import wgrad
from moe_engine.precision.mxfp8.token_blocks import quantize_token_blocks_reference, quantize_token_blocks_triton

cases = torch.load(sys.argv[1])
outputs = {}
for name, (a_NX, b_NY, offsets_E, out_EXY) in cases.items():
    references = [quantize_token_blocks_reference(t, offsets_E) for t in (a_NX, b_NY)]
    # Every buffer the kernels see has a poisoned tail, and every output they allocate starts as NaN (or
    # the largest integer): an element left unwritten or a row mask off by one fails every time.
    with poisoned_run() as guards:
        offsets = guards.copy(offsets_E)
        blocked = [quantize_token_blocks_triton(guards.copy(t), offsets) for t in (a_NX, b_NY)]
        added = guards.copy(out_EXY)
        wgrad.grouped_wgrad(*blocked, added, path="triton-dot-scaled")
        handed_back = {
            dtype: wgrad.grouped_wgrad(*blocked, out_dtype=dtype, path="triton-dot-scaled").clone()
            for dtype in (torch.float32, torch.bfloat16)
        }
        added = added.clone()
    n = int(offsets_E[-1]) if len(offsets_E) else 0  # the padding rows' codes are left unwritten
    for operand, kernel, reference in zip("ab", blocked, references):
        outputs[(name, operand, "codes equal")] = torch.equal(kernel.data_NK[:n].view(torch.uint8), reference.data_NK[:n].view(torch.uint8))
        outputs[(name, operand, "scales equal")] = torch.equal(kernel.scales_BK.view(torch.uint8), reference.scales_BK.view(torch.uint8))
    outputs[(name, "added")] = added
    for dtype, out in handed_back.items():
        outputs[(name, str(dtype))] = out
torch.save(outputs, sys.argv[2])
"""


def _inputs():
    cases = {}
    for seed, (name, (counts, padding, width, x_width)) in enumerate(sorted(CASES.items())):
        for dtype in (torch.float32, torch.bfloat16):
            a_NX, offsets_E = token_operand(counts, padding, x_width, dtype, seed)
            b_NY, _ = token_operand(counts, padding, width, dtype, seed + 100)
            out_EXY = torch.randn(len(counts), x_width, width, generator=torch.Generator().manual_seed(seed)) * 1e-3
            cases[f"{name}-{str(dtype).removeprefix('torch.')}"] = (a_NX, b_NY, offsets_E, out_EXY)
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mxfp8_wgrad")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    cases = _inputs()
    torch.save(cases, inputs)
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs)]
    run = subprocess.run(command, env=interpreter_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return cases, torch.load(outputs)


def _counts(name: str) -> list[int]:
    return CASES[name.rsplit("-", 1)[0]][0]


def test_the_quantizer_writes_the_compositions_bytes(interpreted):
    cases, outputs = interpreted
    for name in cases:
        for operand in ("a", "b"):
            assert outputs[(name, operand, "codes equal")] and outputs[(name, operand, "scales equal")], (name, operand)


def _relative(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-300)).item()


def test_the_gemm_adds_each_experts_product(interpreted):
    cases, outputs = interpreted
    for name, (a_NX, b_NY, _, out_EXY) in cases.items():
        counts = _counts(name)
        product = wgrad_loop(a_NX, b_NY, counts)
        added = outputs[(name, "added")]
        for e, count in enumerate(counts):
            if count == 0:
                assert torch.equal(added[e], out_EXY[e]), (name, e)
            else:
                want = out_EXY[e].double() + product[e]
                assert _relative(added[e], want) < tolerance(torch.float32, count), (name, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_hands_back_each_experts_product(interpreted, dtype):
    cases, outputs = interpreted
    for name, (a_NX, b_NY, _, _) in cases.items():
        counts = _counts(name)
        got = outputs[(name, str(dtype))]
        assert got.dtype == dtype
        product = wgrad_loop(a_NX, b_NY, counts)
        for e, count in enumerate(counts):
            if count == 0:
                assert not got[e].any(), (name, e)
            else:
                bound = tolerance(torch.float32, count) if dtype == torch.float32 else 2**-8
                assert _relative(got[e], product[e]) < bound, (name, e)


@pytest.mark.slow
def test_the_engine_launch_reaches_the_scaled_mma_on_sm100(monkeypatch):
    """The weight-gradient GEMM as the engine launches it (its fixed tile, warps and stages), compiled for
    sm_100a without a GPU: its IR holds the block-scaled MMA, with no spills."""
    from bench.validate.kernel_compile import SCALED_MMA, compile_launch, describe_launch, unwrap
    from moe_engine.precision.mxfp8 import wgrad
    from moe_engine.precision.mxfp8.token_blocks import quantize_token_blocks

    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    a = quantize_token_blocks(torch.randn(256, 256), offsets)
    b = quantize_token_blocks(torch.randn(256, 128), offsets)
    calls, kernel = [], wgrad._mx_wgrad_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((args, kwargs))

            return launch

    monkeypatch.setattr(wgrad, "_mx_wgrad_kernel", Recorder())
    wgrad._triton_wgrad(a, b, torch.zeros(4, 256, 128), torch.float32)
    monkeypatch.undo()  # Triton's compiler resolves the kernel's module globals
    ((args, kwargs),) = calls
    launch = describe_launch(unwrap(kernel).fn, args, kwargs)
    compiled = compile_launch(launch, "sm_100a", fn=kernel)
    assert compiled.ok and not compiled.spills and SCALED_MMA in compiled.ir_ops, compiled
