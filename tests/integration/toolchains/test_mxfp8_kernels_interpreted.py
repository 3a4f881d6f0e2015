"""The Triton MXFP8 quantizer (``mxfp8.kernels.quantize_triton``), run by Triton's interpreter on CPU,
equals the torch one byte for byte, under both scale roundings.

Triton decides between compiling and interpreting when a kernel is defined (at import), from
TRITON_INTERPRET. So the interpreter run happens in a fresh subprocess with TRITON_INTERPRET=1: it
quantizes inputs this process wrote and hands the bytes back for comparison here.
"""

import subprocess
import sys

import pytest
import torch
from interpreted_kernels import interpreter_env
from mxfp8_quantize_cases import ROUNDINGS, assert_same_bytes, cases

from bench.results import REPO_ROOT

REPO = REPO_ROOT

_CHILD = """
import sys, torch
from moe_engine.precision.mxfp8 import kernels as mxfp8_triton
assert mxfp8_triton._interpreted(), "TRITON_INTERPRET=1 did not reach the kernel definition"
inputs = torch.load(sys.argv[1])
outputs = {}
for name, (x, axis, block) in inputs.items():
    for rounding in ("floor", "ceil"):
        data, scales = mxfp8_triton.quantize_triton(x, axis, block, rounding)
        outputs[name, rounding] = (data.view(torch.uint8), scales.view(torch.uint8))
torch.save(outputs, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """(name, rounding value) -> (data codes, scale codes) from the kernel run by Triton's interpreter."""
    folder = tmp_path_factory.mktemp("mxfp8_interpreter")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(cases(), inputs)
    env = interpreter_env()
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs)]
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs)


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
@pytest.mark.parametrize("case", list(cases()))
def test_interpreted_kernel_matches_torch(interpreted, case, rounding):
    x, axis, block = cases()[case]
    assert_same_bytes(interpreted[case, rounding.value], x, axis, block, rounding)
