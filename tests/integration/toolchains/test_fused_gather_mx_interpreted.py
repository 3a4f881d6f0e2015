"""The dispatch gather fused with the MXFP8 quantisation (``moe_engine::gather_rows_mx``) through its
Triton kernel, run by Triton's interpreter on CPU tensors in a fresh process under TRITON_INTERPRET=1
(Triton decides between compiling and interpreting when a kernel is defined): the bytes a plain per-row
loop of copies followed by ``mxfp8.quantize`` writes, in fp32 and bf16, on fresh random inputs (the seed
is in every failure message; MOE_KERNEL_SEED repeats it); and the MXFP8 experts reading through it give
the outputs and gradients of the unfused composition, bit for bit, with and without the padding rows of
an expert-parallel receive buffer."""

import subprocess
import sys

import pytest
import torch
from fused_cases import DTYPES, SEED
from gather_mx_cases import assert_identical, assert_same_bytes, cases
from interpreted_kernels import interpreter_env

from bench.results import REPO_ROOT

SUPPORT = REPO_ROOT / "tests" / "support"

_CHILD = """
import sys, torch
sys.path[:0] = sys.argv[3:]
from fused_cases import DTYPES
from gather_mx_cases import run_case, experts_outputs
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
    env = interpreter_env(MOE_KERNEL_SEED=str(SEED))
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs), str(SUPPORT)]
    run = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs)


def test_interpreter_ran_the_kernel(interpreted):
    assert interpreted["paths"] == {"fp32": "triton", "bf16": "triton"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_interpreted_kernel_equals_a_loop_of_copies_then_quantize(interpreted, case, dtype):
    assert_same_bytes(interpreted[case["name"], dtype], case, DTYPES[dtype])


@pytest.mark.parametrize("padded", [False, True], ids=["local", "received with padding"])
def test_interpreted_mxfp8_experts_give_the_unfused_outputs_and_gradients(interpreted, padded):
    both = interpreted["experts", padded]
    assert_identical(both[True], both[False], "Triton interpreter")
