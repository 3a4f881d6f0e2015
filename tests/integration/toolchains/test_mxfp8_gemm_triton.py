"""The MXFP8 grouped GEMM's Triton ``tl.dot_scaled`` kernel through Triton's own toolchains: run by
Triton's interpreter on CPU in a fresh process under TRITON_INTERPRET=1, against the torch emulation,
once per tuning config; and compiled for sm_100a without a GPU (Triton's bundled ``ptxas``), where the
tiles Blackwell's tuning keeps hold the block-scaled MMA."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from interpreted_kernels import interpreter_env
from tolerances import tolerance

from bench.results import REPO_ROOT
from moe_engine.precision.mxfp8 import gemm as mx

REPO = REPO_ROOT


# The interpreter is chosen when triton.jit runs, so the kernel module is imported in a fresh process.
INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from moe_engine.precision.mxfp8 import gemm as mx

    cases = json.loads(sys.argv[1])
    tuned = mx._mx_grouped_mm_kernel
    configs = tuned.configs
    errors = []
    # Every case once per tuning config, that config alone: each tile is checked, not just the one
    # the tuning would keep.
    for (counts, padding, k, n, transposed, out_dtype), config in [(c, f) for c in cases for f in configs]:
        tuned.configs, tuned.cache = [config], {}
        g = torch.Generator().manual_seed(len(errors))
        m = sum(counts)
        a = torch.randn(m + padding, k, generator=g) * torch.logspace(-3, 3, k)
        a[m:] = float("nan")
        w = torch.randn(len(counts), *((k, n) if transposed else (n, k)), generator=g)
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        a_mx, w_mx = mx.quantize_rows(a), mx.quantize_weight(w, transposed)
        dtype = getattr(torch, out_dtype)
        kernel = mx.grouped_mm(a_mx, w_mx, offsets, dtype, path="triton-dot-scaled").float()
        emulated = mx.grouped_mm(a_mx, w_mx, offsets, dtype, path="torch-emulation").float()
        scale = emulated.abs().max().clamp(min=1e-30)
        errors.append({
            "relative": ((kernel - emulated).abs().max() / scale).item(),
            "padding_zero": bool((kernel[m:] == 0).all()),
            "finite": bool(torch.isfinite(kernel).all()),
        })
    print(json.dumps(errors))
    """
)

INTERPRETER_CASES = [
    # counts, padding, K, N, transposed (dgrad operand), output dtype
    ((70, 0, 5, 33), 7, 96, 80, False, "float32"),  # several row tiles per expert, empty expert, N tail
    ((70, 0, 5, 33), 7, 96, 80, True, "float32"),  # the transposed (strided) weight operand of dgrad
    ((3, 0, 0), 2, 160, 64, False, "float32"),  # K = 160: BLOCK_K 32 across five steps
    ((20, 12), 0, 64, 48, False, "bfloat16"),
]


def test_triton_kernel_in_interpreter_matches_emulation():
    env = interpreter_env()
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT, json.dumps(INTERPRETER_CASES)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == len(INTERPRETER_CASES) * len(mx.GEMM_CONFIGS)
    cases = [case for case in INTERPRETER_CASES for _ in mx.GEMM_CONFIGS]
    for case, error in zip(cases, errors):
        # fp32 output: both accumulate the same exact products in fp32, in other orders over K; bf16
        # output: one rounding apart.
        bound = tolerance(torch.float32, case[2]) if case[-1] == "float32" else 2**-7
        assert error["relative"] < bound, (case, error)
        assert error["padding_zero"] and error["finite"], (case, error)


@pytest.mark.slow
def test_the_engine_tiles_reach_the_scaled_mma_on_sm100(monkeypatch):
    """The GEMM as the engine launches it (its specialisation, each tuning config's tile, warps and
    stages), compiled for sm_100a without a GPU: the tiles Blackwell's tuning keeps hold the
    block-scaled MMA, and the label that IR gives says native."""
    from bench.validate.kernel_compile import compile_launch, describe_launch, unwrap

    a = mx.quantize_rows(torch.randn(256, 256))
    b = mx.quantize_weight(torch.randn(4, 256, 256))
    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    calls, kernel = [], mx._mx_grouped_mm_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((args, kwargs))
                return type("Compiled", (), {"asm": {"ttgir": ""}})()

            return launch

    monkeypatch.setattr(mx, "_mx_grouped_mm_kernel", Recorder())
    mx._triton_grouped_mm(a, b, offsets, torch.bfloat16)
    monkeypatch.undo()  # Triton's compiler resolves the kernel's module globals
    ((args, kwargs),) = calls
    assert {"BLOCK_M", "BLOCK_N", "num_warps"}.isdisjoint(kwargs), "the tuning picks tile and warps"
    tuned = [c for c in kernel.configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) in mx.SCALED_MMA_TILES]
    assert tuned and len(kernel.configs) > len(tuned)
    for config in tuned:
        launch = describe_launch(unwrap(kernel).fn, args, {**kwargs, **config.all_kwargs()})
        compiled = compile_launch(launch, "sm_100a", fn=kernel)
        assert compiled.ok and not compiled.spills and mx.SCALED_MMA in compiled.ir_ops, (config, compiled)
