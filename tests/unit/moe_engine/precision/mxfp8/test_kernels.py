"""The Triton MXFP8 quantizer equals the torch one byte for byte: in Triton's interpreter on CPU, and on CUDA.

Triton decides between compiling and interpreting when a kernel is defined (at import), from
TRITON_INTERPRET. So the interpreter run happens in a fresh subprocess with TRITON_INTERPRET=1: it
quantizes inputs this process wrote and hands the bytes back for comparison here.
"""

import os
import subprocess
import sys

import pytest
import torch

from bench.results import REPO_ROOT
from moe_engine.precision.mxfp8.blocks import ScaleRounding, quantize
from moe_engine.precision.mxfp8.kernels import _interpreted, quantize_auto, quantize_triton

BLOCK = 32
ROUNDINGS = list(ScaleRounding)
REPO = REPO_ROOT


# --- inputs ------------------------------------------------------------------------------------------------


def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 tensor from int64 bit patterns in [0, 2^32)."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def random_bits_near_block_exponent(g: torch.Generator, n_blocks: int) -> torch.Tensor:
    """Random fp32 bits within 30 binades of a random block exponent (fp32 subnormals included)."""
    top = torch.randint(1, 255, (n_blocks, 1), generator=g)
    exponent = (top - torch.randint(0, 30, (n_blocks, BLOCK), generator=g)).clamp(min=0)
    mantissa = torch.randint(0, 2**23, (n_blocks, BLOCK), generator=g)
    sign = torch.randint(0, 2, (n_blocks, BLOCK), generator=g)
    return _bits_to_float((sign << 31) | (exponent << 23) | mantissa)


def special_blocks() -> torch.Tensor:
    """Zeros (both signs), saturation, ties between E4M3 values, subnormals, fp32 extremes, NaN and Inf."""
    rows = torch.zeros(12, BLOCK)
    rows[1] = -0.0
    rows[2, :6] = torch.tensor([511.0, 464.0, 460.0, 479.0, 480.0, -500.0])  # saturation, the tie 464
    rows[3] = torch.arange(BLOCK) * 2.0**-10 + 2.0**-11  # subnormals and halfway points, shared exponent 0
    rows[3, -1] = 256.0
    rows[4] = torch.arange(BLOCK) * 2.0**-3 + 2.0**-4 + 8  # halfway points among normals
    rows[4, -1] = -256.0
    rows[5] = torch.linspace(-3.4e38, 3.4e38, BLOCK)
    rows[6] = torch.linspace(-1e-40, 1e-40, BLOCK)  # fp32 subnormals only
    rows[7] = torch.linspace(-1, 1, BLOCK) * 2.0**-118
    for row, bad in zip((8, 9, 10, 11), (float("nan"), -float("nan"), float("inf"), -float("inf"))):
        rows[row] = torch.linspace(-5, 7, BLOCK)
        rows[row, 3] = bad
    rows[11, 9] = float("nan")  # Inf and NaN together
    return rows


def cases() -> dict[str, tuple[torch.Tensor, int, int]]:
    """name -> (input, axis, block)."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.randn(64, BLOCK, generator=g) * 10.0 ** torch.randint(-30, 31, (64, 1), generator=g)
    all_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return {
        "random_fp32": (magnitudes, -1, BLOCK),
        "random_bf16": (magnitudes.bfloat16(), -1, BLOCK),
        "random_fp16": ((magnitudes / magnitudes.abs().amax(-1, keepdim=True) * 1e4).half(), -1, BLOCK),
        "random_bits": (random_bits_near_block_exponent(g, 256), -1, BLOCK),
        "any_bits_with_nan_inf": (_bits_to_float(torch.randint(0, 2**32, (64, BLOCK), generator=g)), -1, BLOCK),
        "special": (special_blocks(), -1, BLOCK),
        "every_bf16": (all_bf16.reshape(-1, 256), -1, BLOCK),
        "axis0": (random_bits_near_block_exponent(g, 64).reshape(64, 32), 0, BLOCK),
        "axis0_bf16": (magnitudes.reshape(128, 16).bfloat16(), 0, BLOCK),
        "axis1_of_3d": (random_bits_near_block_exponent(g, 48).reshape(2, 96, 8), 1, BLOCK),
        # inner 200: two tiles of neighbouring blocks, the second one partly masked.
        "axis1_inner_200_bf16": (random_bits_near_block_exponent(g, 400).reshape(2, 32, 200).bfloat16(), 1, BLOCK),
        "non_contiguous": (magnitudes.reshape(32, 64).t(), -1, BLOCK),
        "block16": (magnitudes, -1, 16),
        "block24_padded_lanes": (magnitudes.reshape(64, 32)[:, :24], -1, 24),
        "empty": (torch.empty(0, 64), -1, BLOCK),
    }


def _codes(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    return data.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()


def assert_same_bytes(got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, axis: int, block: int, rounding):
    data, scales = got
    ref_data, ref_scales = _codes(*quantize(x.cpu(), axis, block, rounding))
    assert data.shape == ref_data.shape and scales.shape == ref_scales.shape
    bad_scales = (scales != ref_scales).nonzero()
    assert len(bad_scales) == 0, f"{len(bad_scales)} scale codes differ, first at {bad_scales[:3].tolist()}"
    bad = (data != ref_data).nonzero()
    if len(bad):
        at = tuple(bad[0].tolist())
        raise AssertionError(
            f"{len(bad)} data codes differ; first at {at}: input {x[at].item()!r}, "
            f"got {data[at].item():#04x}, torch {ref_data[at].item():#04x}"
        )


# --- Triton's interpreter on CPU ----------------------------------------------------------------------------

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
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    command = [sys.executable, "-c", _CHILD, str(inputs), str(outputs)]
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs)


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
@pytest.mark.parametrize("case", list(cases()))
def test_interpreted_kernel_matches_torch(interpreted, case, rounding):
    x, axis, block = cases()[case]
    assert_same_bytes(interpreted[case, rounding.value], x, axis, block, rounding)


# --- checks without a kernel launch -------------------------------------------------------------------------


def test_sizes_must_be_block_multiples():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_triton(torch.randn(4, 48))
    with pytest.raises(ValueError, match="axis 0"):
        quantize_triton(torch.randn(40, 64), axis=0)


def test_rejects_integer_input():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_triton(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.skipif(_interpreted(), reason="under TRITON_INTERPRET=1 CPU tensors are accepted")
def test_cpu_tensor_needs_the_interpreter():
    with pytest.raises(ValueError, match="CUDA tensors"):
        quantize_triton(torch.randn(2, 32))


def test_auto_uses_torch_on_cpu():
    x = torch.randn(4, 64)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(quantize_auto(x), quantize(x)))


# --- compiled on CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
@pytest.mark.parametrize("case", list(cases()))
def test_cuda_kernel_matches_torch(case, rounding):
    x, axis, block = cases()[case]
    got = _codes(*quantize_triton(x.cuda(), axis, block, rounding))
    assert_same_bytes(got, x, axis, block, rounding)  # against the CPU implementation
    on_gpu = _codes(*quantize(x.cuda(), axis, block, rounding))
    assert torch.equal(got[0], on_gpu[0]) and torch.equal(got[1], on_gpu[1])  # and torch on the same device


@pytest.mark.cuda
@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
def test_cuda_kernel_on_many_random_bit_patterns(rounding):
    g = torch.Generator().manual_seed(1)
    near = random_bits_near_block_exponent(g, 1 << 15)
    anything = _bits_to_float(torch.randint(0, 2**32, (1 << 14, BLOCK), generator=g))  # NaN and Inf included
    x = torch.cat([near, anything]).reshape(-1, 4096)
    assert_same_bytes(_codes(*quantize_triton(x.cuda(), rounding=rounding)), x, -1, BLOCK, rounding)
    assert_same_bytes(_codes(*quantize_triton(x.cuda(), axis=0, rounding=rounding)), x, 0, BLOCK, rounding)


@pytest.mark.cuda
def test_cuda_auto_uses_the_kernel():
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    got, expected = quantize_auto(x), quantize_triton(x)
    assert got[0].is_cuda and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected))
