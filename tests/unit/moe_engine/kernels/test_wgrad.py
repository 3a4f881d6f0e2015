"""``moe_engine::wgrad_accumulate``: out += a^T @ b into an fp32 buffer, one op. On a CPU the reference
path, the same bits as the ``.grad`` path (autograd's linear weight gradient, then the add), and against
an fp64 product within error-analysis tolerances (``tolerances.tolerance``); under MOE_TEST_DEVICE=cuda
the same cases run cuBLAS through ``torch.addmm``, which sums bf16 products in fp32. Under fake tensors
the op is one op that runs nothing; bad inputs are refused by name."""

import pytest
import torch
from tolerances import assert_close_to_scale, tolerance
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine import kernels
from moe_engine.kernels import wgrad

SEED = 3
N, M, K = 37, 24, 20


def _case(dtype, device, n=N):
    g = torch.Generator().manual_seed(SEED)
    a_NM = torch.randn(n, M, generator=g).to(dtype).to(device)
    b_NK = torch.randn(n, K, generator=g).to(dtype).to(device)
    out_MK = torch.randn(M, K, generator=g).to(device)
    return a_NM, b_NK, out_MK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_accumulates_the_product(device, dtype):
    a_NM, b_NK, out_MK = _case(dtype, device)
    want = out_MK.double().cpu() + a_NM.double().cpu().t() @ b_NK.double().cpu()
    kernels.wgrad_accumulate(a_NM, b_NK, out_MK)
    assert out_MK.dtype == torch.float32
    # The CPU rounds the product to bf16 before the add; cuBLAS sums the exact products in fp32.
    rounded = dtype == torch.bfloat16 and device.type == "cpu"
    assert_close_to_scale(out_MK.cpu().double(), want, tolerance(dtype if rounded else torch.float32, N))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_path_has_the_bits_of_autograds_linear_and_the_add(dtype):
    a_NM, b_NK, out_MK = _case(dtype, torch.device("cpu"))
    weight_MK = torch.zeros(M, K, dtype=dtype, requires_grad=True)
    torch.nn.functional.linear(b_NK, weight_MK).backward(a_NM)
    want = out_MK.clone().add_(weight_MK.grad)
    kernels.wgrad_accumulate(a_NM, b_NK, out_MK)
    assert torch.equal(out_MK, want)
    assert torch.equal(wgrad.weight_grad(a_NM, b_NK), weight_MK.grad)


def test_strided_operands(device):
    """a as columns of a wider tensor, b transposed: the op reads views."""
    a_wide, b_NK, out_MK = _case(torch.float32, device)
    a_NM = torch.cat([a_wide, a_wide], dim=1)[:, :M]
    b_KN = b_NK.t().contiguous()
    want = out_MK.double().cpu() + a_NM.double().cpu().t() @ b_NK.double().cpu()
    kernels.wgrad_accumulate(a_NM, b_KN.t(), out_MK)
    assert_close_to_scale(out_MK.cpu().double(), want, tolerance(torch.float32, N))


def test_leading_dims_are_the_rows(device):
    """(B, S, X) operands, as a projection's dY and x arrive: the op flattens them into N = B * S rows."""
    a_NM, b_NK, out_MK = _case(torch.bfloat16, device, n=36)
    want = out_MK.clone()
    kernels.wgrad_accumulate(a_NM, b_NK, want)
    kernels.wgrad_accumulate(a_NM.view(4, 9, M), b_NK.view(4, 9, K), out_MK)
    assert torch.equal(out_MK, want)
    assert torch.equal(wgrad.weight_grad(a_NM.view(4, 9, M), b_NK.view(4, 9, K)), wgrad.weight_grad(a_NM, b_NK))


def test_no_rows_leave_the_buffer(device):
    a_NM, b_NK, out_MK = _case(torch.bfloat16, device, n=0)
    before = out_MK.clone()
    kernels.wgrad_accumulate(a_NM, b_NK, out_MK)
    assert torch.equal(out_MK, before)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_one_op_and_fake_tensors_run_nothing():
    a_NM, b_NK, out_MK = _case(torch.bfloat16, torch.device("cpu"))
    with _Recorder() as recorder:
        assert kernels.wgrad_accumulate(a_NM, b_NK, out_MK) is None
    assert recorder.calls == ["moe_engine.wgrad_accumulate.default"]
    before = out_MK.clone()
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (a_NM, b_NK, out_MK)]
        with _Recorder() as recorder:
            wgrad.wgrad_accumulate_op(*fakes)
    assert recorder.calls == ["moe_engine.wgrad_accumulate.default"]
    assert torch.equal(out_MK, before)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a, b, o: (a, b[:-1], o), ValueError, "the same leading dims"),
        (lambda a, b, o: (a, b, o[:, :-1]), ValueError, r"out_MK of shape \(24, 20\)"),
        (lambda a, b, o: (a, b.float(), o), TypeError, "one dtype"),
        (lambda a, b, o: (a, b, o.bfloat16()), TypeError, "must be float32"),
        (lambda a, b, o: (a[None], b, o), ValueError, "the same leading dims"),
        (lambda a, b, o: (a[0], b, o), ValueError, "1-D"),
    ],
    ids=["rows", "out-shape", "dtypes", "out-dtype", "dims", "vector"],
)
def test_bad_inputs_are_refused_by_name(change, error, match):
    changed = change(*_case(torch.bfloat16, torch.device("cpu")))
    with pytest.raises(error, match=match):
        kernels.wgrad_accumulate(*changed)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in changed]
        with pytest.raises(error, match=match):
            kernels.wgrad_accumulate(*fakes)
