"""``moe_engine::grouped_wgrad_accumulate``: out[e] += a[rows of e]^T @ b[rows of e] into an fp32 buffer, one
op. On a CPU (or without a kernel) the reference path, the eager composition the engine ran before: the
same bits as ``out.add_(torch._grouped_mm(a.t(), b, offs=offsets))``, and against a plain per-group fp64
loop within error-analysis tolerances (``tolerances.tolerance``); under MOE_TEST_DEVICE=cuda the same
cases run the Triton kernel. Under fake tensors the op is one op that runs nothing; bad inputs are
refused by name. The Triton kernel on a CPU: tests/integration/toolchains/test_grouped_wgrad_interpreted.py."""

import pytest
import torch
from grouped_wgrad_cases import wgrad_case, wgrad_loop
from tolerances import assert_close_to_scale, tolerance
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine import kernels
from moe_engine.kernels import grouped_wgrad

SEED = 0
M, K = 48, 40
"""Widths of the operands' rows (multiples of 8: torch's grouped GEMM wants 16-byte strides)."""
CASES = {
    # group sizes: uneven, with an empty group first, in the middle and last
    "uneven": [5, 37, 1, 64],
    "empty-first": [0, 20, 9],
    "empty-middle": [17, 0, 0, 30],
    "empty-last": [25, 12, 0],
    "all-empty": [0, 0],
}
PADDING = 6
"""Rows after the last offset, NaN: any that is read shows."""


def _case(counts: list[int], dtype: torch.dtype, device: torch.device, seed: int = SEED):
    """(a_NM, b_NK, offsets_E, out_EMK) with NaN padding rows and a non-zero out, on ``device``."""
    return tuple(t.to(device) for t in wgrad_case(counts, M, K, dtype, seed, PADDING))


def _path(device, dtype):
    return kernels.kernel_paths(device, dtype)["grouped_wgrad_accumulate"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_accumulates_each_group_like_awgrad_loop(device, name, dtype):
    counts = CASES[name]
    a_NM, b_NK, offsets_E, out_EMK = _case(counts, dtype, device)
    before = out_EMK.clone()
    want = wgrad_loop(a_NM, b_NK, counts, before)
    kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    assert out_EMK.dtype == torch.float32 and torch.isfinite(out_EMK).all()
    k = max(max(counts), 1)
    # The reference rounds each product to bf16 before the add; the kernel sums exact products in fp32.
    rounded = dtype == torch.bfloat16 and not _path(device, dtype).fused
    assert_close_to_scale(out_EMK.cpu().double(), want, tolerance(dtype if rounded else torch.float32, k), name)
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.equal(out_EMK[e], before[e]), f"empty group {e} changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["uneven", "empty-middle"])
def test_cpu_path_has_the_bits_of_the_two_pass_composition(name, dtype):
    a_NM, b_NK, offsets_E, out_EMK = _case(CASES[name], dtype, torch.device("cpu"))
    want = out_EMK.clone().add_(torch._grouped_mm(a_NM.t(), b_NK, offs=offsets_E))
    kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    assert torch.equal(out_EMK, want)


def test_operands_with_wider_rows_and_a_strided_last_dim(device):
    """a as columns of a wider tensor (how grad_h's halves arrive), b with a non-unit last stride."""
    counts = [6, 37, 1, 62]  # 106 rows and the padding: b's leading stride a multiple of 16 bytes
    a_wide, b_NK, offsets_E, out_EMK = _case(counts, torch.float32, device)
    g = torch.Generator().manual_seed(SEED + 1)
    a_NM = torch.cat([a_wide, torch.randn(a_wide.shape, generator=g).to(device)], dim=1)[:, :M]
    b_KN = b_NK.t().contiguous()
    want = wgrad_loop(a_NM, b_NK, counts, out_EMK)
    kernels.grouped_wgrad_accumulate(a_NM, b_KN.t(), offsets_E, out_EMK)
    assert_close_to_scale(out_EMK.cpu().double(), want, tolerance(torch.float32, max(counts)))


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))


def test_one_op_with_its_four_inputs(device):
    a_NM, b_NK, offsets_E, out_EMK = _case(CASES["uneven"], torch.bfloat16, device)
    with _Recorder() as recorder:
        result = kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    assert result is None
    ((op, args),) = recorder.calls
    assert op == "moe_engine.grouped_wgrad_accumulate.default"
    assert len(args) == 4 and all(got is given for got, given in zip(args, (a_NM, b_NK, offsets_E, out_EMK)))


def test_fake_tensors_run_nothing_and_mutate_nothing():
    a_NM, b_NK, offsets_E, out_EMK = _case(CASES["uneven"], torch.bfloat16, torch.device("cpu"))
    before = out_EMK.clone()
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (a_NM, b_NK, offsets_E, out_EMK)]
        with _Recorder() as recorder:
            result = grouped_wgrad.grouped_wgrad_accumulate_op(*fakes)
    assert result is None
    assert [op for op, _ in recorder.calls] == ["moe_engine.grouped_wgrad_accumulate.default"]
    assert torch.equal(out_EMK, before) and tuple(fakes[3].shape) == tuple(out_EMK.shape)


def test_fake_tensors_refuse_what_the_op_refuses():
    a_NM, b_NK, offsets_E, out_EMK = _case(CASES["uneven"], torch.bfloat16, torch.device("cpu"))
    narrow_EMK = out_EMK[:, :-8].contiguous()
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (a_NM, b_NK, offsets_E, narrow_EMK)]
        with pytest.raises(ValueError, match="out_EMK of shape"):
            kernels.grouped_wgrad_accumulate(*fakes)


def _bad_inputs():
    a_NM, b_NK, offsets_E, out_EMK = _case(CASES["uneven"], torch.float32, torch.device("cpu"))
    wide = torch.zeros(out_EMK.shape[0], M, K + 8)
    return {
        "out not contiguous": ((a_NM, b_NK, offsets_E, wide[:, :, :K]), ValueError, "out_EMK must be contiguous"),
        "out transposed": (
            (a_NM, b_NK, offsets_E, torch.zeros(out_EMK.shape[0], K, M).transpose(1, 2)),
            ValueError,
            "out_EMK must be contiguous",
        ),
        "int64 offsets": ((a_NM, b_NK, offsets_E.long(), out_EMK), TypeError, "offsets_E must be int32"),
        "dtype mismatch": ((a_NM.bfloat16(), b_NK, offsets_E, out_EMK), TypeError, "one dtype expected"),
        "wrong out shape": ((a_NM, b_NK, offsets_E, out_EMK[:, :, :32]), ValueError, r"out_EMK of shape \(4, 48, 40\)"),
        "wrong group count": ((a_NM, b_NK, offsets_E[:3], out_EMK), ValueError, r"out_EMK of shape \(3, 48, 40\)"),
        "rows differ": ((a_NM[:-1], b_NK, offsets_E, out_EMK), ValueError, "need the same N"),
        "3-D operand": ((a_NM[None], b_NK, offsets_E, out_EMK), ValueError, "got 3-D, 2-D, 1-D and 3-D"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_inputs_are_refused_by_name(name):
    args, error, message = _bad_inputs()[name]
    before = args[3].clone()
    with pytest.raises(error, match=message):
        kernels.grouped_wgrad_accumulate(*args)
    assert torch.equal(args[3], before)


def test_paths_say_where_the_op_runs():
    assert _path("cuda", torch.bfloat16).details == "triton (CUDA)"
    assert _path("cuda", torch.float32).fused
    assert _path("cpu", torch.bfloat16).details == "reference: the Triton kernel runs on CUDA devices, not cpu"
    assert "takes float32 and bfloat16, not float16" in _path("cuda", torch.float16).details
    into_bf16 = grouped_wgrad.path("cuda", torch.bfloat16, torch.bfloat16)
    assert not into_bf16.fused and into_bf16.details == "reference: the kernel adds into float32, not bfloat16"


@pytest.mark.cuda
def test_cuda_op_reads_no_offsets_on_the_host(device):
    """After its first call (which compiles the kernel), the op runs without a host sync."""
    if device.type != "cuda":
        pytest.skip("a CUDA test (MOE_TEST_DEVICE=cuda)")
    a_NM, b_NK, offsets_E, out_EMK = _case(CASES["empty-middle"], torch.bfloat16, device)
    kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK.clone())
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK)
    finally:
        torch.cuda.set_sync_debug_mode("default")
