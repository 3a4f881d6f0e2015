"""Each fused op equals the eager composition it replaces, forward and backward, in fp32 and bf16, on
fresh random inputs (the seed is in every failure message; MOE_KERNEL_SEED repeats it), on the device
of the run: the reference path on a CPU, the Triton kernels on CUDA (MOE_TEST_DEVICE=cuda).
The Triton kernels on a CPU, under Triton's interpreter: test_triton_interpreter.py."""

import pytest
import torch
from fused_cases import DTYPES, assert_matches_eager, case_id, cases, run_eager, run_fused

from moe_engine import kernels

OP_FAMILY = {
    "rms_norm": "rms_norm",
    "add_rms_norm": "rms_norm",
    "swiglu": "swiglu",
    "swiglu_packed": "swiglu",
    "linear_cross_entropy": "linear_cross_entropy",
    "rope": "rope",
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_fused_op_equals_eager_composition(case, dtype, device):
    torch_dtype = DTYPES[dtype]
    path = kernels.kernel_paths(device, torch_dtype)[OP_FAMILY[case["op"]]]
    assert path.implementation == ("triton" if device.type == "cuda" else "reference"), path
    got = run_fused(case, torch_dtype, device)
    want = run_eager(case, torch_dtype, device)
    assert_matches_eager(got, want, case, torch_dtype, path.details)


def test_unsupported_dtype_runs_the_reference(device):
    """float64, which no Triton kernel takes, runs the reference path, says why, and gives the eager
    composition's values (RMSNorm computes in fp32 whatever the dtype: fp32 tolerances)."""
    for case in cases():
        path = kernels.kernel_paths(device, torch.float64)[OP_FAMILY[case["op"]]]
        assert path.implementation == "reference"
        assert ("float64" if device.type == "cuda" else device.type) in path.details, path
        assert_matches_eager(
            run_fused(case, torch.float64, device),
            run_eager(case, torch.float64, device),
            case,
            torch.float32,
            path.details,
        )
