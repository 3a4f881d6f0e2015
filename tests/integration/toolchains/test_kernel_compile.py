"""The compile check fails where a first GPU run would: a kernel that does not compile, one that spills.

Each compiles a small kernel defined here for sm_90a with Triton's compiler and the bundled ptxas
(seconds on a 2-core CPU machine, no GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from bench.validate.kernel_compile import Launch, compile_launch, describe_launch, failures, targets_for


@triton.jit
def _scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)


@triton.jit
def _does_not_compile(x_ptr, n, BLOCK: tl.constexpr):
    # tl.arange needs a power-of-two length: Triton rejects BLOCK = 48 when it compiles.
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


@triton.jit
def _keeps_a_wide_row(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # The whole row stays live across its reduction: 16,384 fp32 values on one warp's 32 threads.
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols)
    mean = tl.sum(x, axis=0) / BLOCK
    centred = x - mean
    tl.store(y_ptr + cols, centred / tl.sqrt(tl.sum(centred * centred, axis=0) / BLOCK))


def _launch(fn, *args, **kwargs) -> Launch:
    return describe_launch(fn.fn, args, kwargs)


def test_a_launch_is_described_as_the_jit_specialises_it():
    x = torch.empty(64)
    launch = _launch(_scale, x, x[1:], 1, BLOCK=32, num_warps=2)
    assert launch.signature == (("x_ptr", "*fp32"), ("y_ptr", "*fp32"), ("n", "constexpr"), ("BLOCK", "constexpr"))
    assert dict(launch.constexprs) == {"n": 1, "BLOCK": 32} and launch.divisible == ("x_ptr",)
    assert launch.options == (("num_warps", 2),)
    wide = _launch(_scale, x, x, 4096, BLOCK=32)
    assert ("n", "i32") in wide.signature and wide.divisible == ("x_ptr", "y_ptr", "n")
    fp8 = _launch(_scale, x.to(torch.float8_e4m3fn), x, 5, BLOCK=32)
    assert targets_for(fp8, ["sm_90a", "sm_80"]) == ["sm_90a"] and targets_for(wide, ["sm_80"]) == ["sm_80"]


@pytest.mark.slow
def test_a_kernel_that_compiles_passes():
    x = torch.empty(1024)
    launch = _launch(_scale, x, x, 1000, BLOCK=1024, num_warps=4)
    compiled = compile_launch(launch, "sm_90a", fn=_scale)
    assert compiled.ok and 0 < compiled.registers < 255 and not compiled.spills, compiled
    assert failures([(launch, compiled)]) == []


@pytest.mark.slow
def test_a_kernel_that_does_not_compile_fails_the_check():
    x = torch.empty(64)
    launch = _launch(_does_not_compile, x, 48, BLOCK=48)
    compiled = compile_launch(launch, "sm_90a", fn=_does_not_compile)
    assert not compiled.ok
    (failure,) = failures([(launch, compiled)])
    assert "_does_not_compile on sm_90a does not compile" in failure


@pytest.mark.slow
def test_a_kernel_that_spills_fails_the_check():
    x = torch.empty(16384)
    launch = _launch(_keeps_a_wide_row, x, x, BLOCK=16384, num_warps=1)
    compiled = compile_launch(launch, "sm_90a", fn=_keeps_a_wide_row)
    assert compiled.ok and compiled.spills, compiled
    (failure,) = failures([(launch, compiled)])
    assert "_keeps_a_wide_row on sm_90a spills" in failure


def test_an_autotuned_kernel_compiles_as_its_jit_function():
    from triton.runtime.jit import JITFunction

    from bench.validate.kernel_compile import unwrap
    from moe_engine.precision.mxfp8 import gemm as mxfp8_gemm

    tuned = mxfp8_gemm._mx_grouped_mm_kernel
    assert not isinstance(tuned, JITFunction) and unwrap(tuned) is tuned.fn and isinstance(unwrap(tuned), JITFunction)
    assert unwrap(_scale) is _scale


@pytest.mark.parametrize(
    "tile, target, ir_ops, fails",
    [
        ((128, 128), "sm_100a", ["tc_gen5_mma_scaled"], False),
        ((128, 128), "sm_100a", ["tc_gen5_mma"], True),  # a kept tile that lost the scaled MMA
        ((64, 64), "sm_100a", ["tc_gen5_mma"], False),  # a tile Blackwell's tuning does not keep
        ((128, 128), "sm_90a", ["warp_group_dot"], False),  # Hopper has no MX tensor cores
    ],
)
def test_a_kept_mxfp8_tile_without_the_scaled_mma_fails_the_check(tile, target, ir_ops, fails):
    from bench.validate.kernel_compile import MXFP8_GEMM, Compiled

    module, name = MXFP8_GEMM.rsplit(".", 1)
    launch = Launch(module, name, (), (("BLOCK_M", tile[0]), ("BLOCK_N", tile[1])), (), ())
    compiled = Compiled(MXFP8_GEMM, target, True, ir_ops=ir_ops)
    found = failures([(launch, compiled)], tiles=((128, 128), (128, 64)))
    assert bool(found) is fails, found
    assert failures([(launch, compiled)]) == found  # the engine's own list of kept tiles
