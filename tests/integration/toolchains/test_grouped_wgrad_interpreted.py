"""``moe_engine::grouped_wgrad_accumulate``'s Triton kernel run by Triton's interpreter on CPU tensors, in a
fresh process under TRITON_INTERPRET=1 (it must be set before the kernel is defined), against a plain
per-group fp64 loop: fp32 and bf16 operands added into a non-zero fp32 buffer, groups smaller than a tile
and groups over several row steps, empty groups (first, in the middle, a last one with 0 rows), NaN
padding rows after the last offset, widths that are not multiples of a tile, an operand with wider
rows. Each case runs through the op, with its dtype's config (``grouped_wgrad.CONFIGS``).

Tolerances (``tolerances.tolerance``): fp32 operands, the products summed in fp32 over a group's k rows;
bf16 operands, the same: bf16 x bf16 products are exact in fp32, only their fp32 sums round."""

import subprocess
import sys

import pytest
import torch
from grouped_wgrad_cases import wgrad_case, wgrad_loop
from interpreted_kernels import interpreter_env
from tolerances import assert_close_to_scale, tolerance

from bench.results import REPO_ROOT

_CHILD = """
import sys, torch
from moe_engine import kernels
from moe_engine.kernels import grouped_wgrad

cases = torch.load(sys.argv[1])
outputs = {"paths": {str(d): kernels.kernel_paths("cpu", d)["grouped_wgrad_accumulate"].implementation
                     for d in (torch.float32, torch.bfloat16)}}
for name, (a, b, offsets, out) in cases.items():
    outputs[("a stride", name)] = a.stride()
    result = out.clone()
    grouped_wgrad.grouped_wgrad_accumulate(a, b, offsets, result)  # its dtype's config
    outputs[(name, "op")] = result
torch.save(outputs, sys.argv[2])
"""

M, K = 72, 40
"""Not multiples of any tile: the last M and K tiles are partial."""
CASES = {
    # name: group sizes, operand dtype, rows of a's storage (>= M: a is a column slice of it)
    "fp32-uneven": ([0, 3, 150, 0, 70, 0], torch.float32, M),
    "bf16-uneven": ([0, 3, 150, 0, 70, 0], torch.bfloat16, M),
    "fp32-small-groups": ([5, 1, 0, 17, 9], torch.float32, M),
    "bf16-wide-a": ([40, 0, 129], torch.bfloat16, M + 24),
}
PADDING = 5


def _inputs(counts, dtype, a_width, seed):
    return wgrad_case(counts, M, K, dtype, seed, PADDING, a_width)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grouped_wgrad")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    cases = {
        name: _inputs(counts, dtype, width, seed) for seed, (name, (counts, dtype, width)) in enumerate(CASES.items())
    }
    torch.save(cases, inputs)
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs)]
    run = subprocess.run(command, env=interpreter_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return cases, torch.load(outputs)


def test_the_interpreter_ran_the_kernel(interpreted):
    _, outputs = interpreted
    assert outputs["paths"] == {"torch.float32": "triton", "torch.bfloat16": "triton"}


def _labels(dtype):
    return ["op"]


@pytest.mark.parametrize("name", list(CASES))
def test_each_config_adds_each_group_like_awgrad_loop(interpreted, name):
    cases, outputs = interpreted
    counts, dtype, _ = CASES[name]
    a_NM, b_NK, _, out_EMK = cases[name]
    want = wgrad_loop(a_NM, b_NK, counts, out_EMK)
    assert outputs[("a stride", name)] == a_NM.stride()  # the child got the column slice as it is
    tol = tolerance(torch.float32, max(counts))
    for label in _labels(dtype):
        got = outputs[(name, label)]
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), label
        assert_close_to_scale(got.double(), want, tol, f"{name} {label}")
        for e, count in enumerate(counts):
            if count == 0:
                assert torch.equal(got[e], out_EMK[e]), f"{name} {label}: empty group {e} changed"
