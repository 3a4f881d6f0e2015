"""The MXFP8 grouped GEMM through torch's ``scaled_grouped_mm`` (``mxfp8.scaled_mm``), without a GPU.

The blocked scale layout is checked element by element against its index formula, written here from
the specification of the layout (cuBLAS "1D block scaling factors layout", the ``SWIZZLE_32_4_4`` of
torch): a scale matrix is cut into 128 x 4 tiles, stored tile after tile in row-major tile order;
inside a tile the scale of row i, column j sits at byte (i % 32) * 16 + (i // 32) * 4 + j.

The op itself is replaced by a stand-in that asserts the contract torch 2.13 and its CUTLASS kernel
state (dtypes, strides, recipe and swizzle, scale shapes, per-group scale rows starting at
sum_{i<e} round_up(rows_i, 128)), decodes the scales with that formula, and computes the product per
expert in fp32: the engine's output through the stand-in equals the plain per-expert emulation only
if the operands and scales are laid out as the op reads them.

The Triton kernels of the tail zeroing and the A-scale layout run under Triton's interpreter in
tests/integration/toolchains/test_mxfp8_scaled_mm_interpreted.py.
"""

import pytest
import torch
import torch.nn.functional as F
from scaled_mm_cases import BLOCKED_CASES, ZERO_CASES

from moe_engine.moe.experts import MXFP8Backend
from moe_engine.moe.permute import ExpertGroups
from moe_engine.precision.mxfp8 import gemm as mx
from moe_engine.precision.mxfp8 import scaled_mm as smm


def blocked_index(row: torch.Tensor, col: torch.Tensor, cols_padded: int) -> torch.Tensor:
    """Byte of scale (row, col) in the blocked layout of a matrix padded to ``cols_padded`` columns."""
    tile = (row // 128) * (cols_padded // 4) + col // 4
    return tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _scales(*shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def _on(device: torch.device, scales: torch.Tensor) -> torch.Tensor:
    """``scales`` on ``device`` (moved as bytes), keeping its strides."""
    return scales.view(torch.uint8).to(device).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 3), (128, 4), (130, 9), (300, 17), (256, 8)])
def test_blocked_layout_by_index_formula(rows, cols, device):
    scales = _scales(rows, cols)
    blocked = smm.to_blocked(_on(device, scales)).view(torch.uint8).cpu()
    rows_p, cols_p = _round_up(rows, 128), _round_up(cols, 4)
    assert blocked.shape == (rows_p * cols_p,) and blocked.is_contiguous()
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    index = blocked_index(r, c, cols_p)
    assert torch.equal(blocked[index], scales.view(torch.uint8))
    padding = torch.ones_like(blocked, dtype=torch.bool)
    padding[index.flatten()] = False
    assert (blocked[padding] == 0).all(), "the padding of the scale matrix is zero bytes"


def test_blocked_layout_of_a_stack_and_of_a_strided_view():
    """Weights: (E, N, C) scales blocked expert by expert; the dgrad operand's scales are a transposed view."""
    stack = _scales(3, 40, 6, seed=1)
    blocked = smm.to_blocked(stack)
    assert blocked.shape == (3, 128 * 8)
    for e in range(3):
        assert torch.equal(blocked[e].view(torch.uint8), smm.to_blocked(stack[e]).view(torch.uint8))
    view = _scales(2, 6, 40, seed=2).transpose(1, 2)  # (2, 40, 6), not contiguous
    r, c = torch.meshgrid(torch.arange(40), torch.arange(6), indexing="ij")
    got = smm.to_blocked(view).view(torch.uint8)
    for e in range(2):
        assert torch.equal(got[e][blocked_index(r, c, 8)], view[e].contiguous().view(torch.uint8))


class CheckingOp:
    """Stands for ``F.scaled_grouped_mm``: checks the 2d x 3d MXFP8 contract, then computes what the op
    computes from the operands as laid out, reading scales by the index formula."""

    def __init__(self):
        self.calls = 0

    def __call__(
        self,
        mat_a,
        mat_b,
        scale_a,
        recipe_a,
        scale_b,
        recipe_b,
        swizzle_a=None,
        swizzle_b=None,
        bias=None,
        offs=None,
        output_dtype=torch.bfloat16,
        contraction_dim=(),
        use_fast_accum=False,
    ):
        self.calls += 1
        assert recipe_a == recipe_b == F.ScalingType.BlockWise1x32
        assert swizzle_a == swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
        assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
        assert bias is None and output_dtype == torch.bfloat16
        m, k = mat_a.shape
        experts, k_b, n = mat_b.shape
        assert k_b == k and k % 16 == 0 and n % 16 == 0
        assert mat_a.stride() == (k, 1), "mat_a row-major"
        assert mat_b.stride() == (n * k, 1, k), "mat_b column-major: (E, N, K) contiguous, transposed"
        assert offs.dtype == torch.int32 and offs.shape == (experts,)
        cols = _round_up(k // 32, 4)
        assert scale_b.shape == (experts, _round_up(n, 128) * cols) and scale_b.is_contiguous()
        assert scale_a.dim() == 2 and scale_a.shape[1] == cols and scale_a.shape[0] >= m and scale_a.is_contiguous()

        flat_a, flat_b = scale_a.view(torch.uint8).flatten(), scale_b.view(torch.uint8)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)  # rows after offs[-1]: unwritten
        start = scale_row = 0
        for e, end in enumerate(offs.tolist()):
            rows = end - start
            if rows > 0:
                r, c = torch.meshgrid(torch.arange(rows), torch.arange(k // 32), indexing="ij")
                index = scale_row * cols + blocked_index(r, c, cols)
                assert index.max() < flat_a.numel()
                a = self._decode(mat_a[start:end], flat_a[index])
                r, c = torch.meshgrid(torch.arange(n), torch.arange(k // 32), indexing="ij")
                b = self._decode(mat_b[e].t(), flat_b[e][blocked_index(r, c, cols)])
                out[start:end] = (a @ b.t()).to(torch.bfloat16)
            start, scale_row = end, scale_row + _round_up(rows, 128)
        return out

    @staticmethod
    def _decode(data_RK, biased_RC):
        scale = torch.exp2(biased_RC.float() - 127).repeat_interleave(32, dim=1)
        return data_RK.float() * scale


@pytest.fixture
def op(monkeypatch):
    checking = CheckingOp()
    monkeypatch.setattr(F, "scaled_grouped_mm", checking, raising=False)
    return checking


def _operands(counts, padding, k, n, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    # Magnitudes vary along K and along the rows: a scale read from a wrong row or block shows.
    a = (
        torch.randn(m + padding, k, generator=g)
        * torch.logspace(-3, 3, k)
        * torch.logspace(2, -2, m + padding)[:, None]
    )
    a[m:] = float("nan")  # padding rows hold garbage
    shape = (k, n) if transposed else (n, k)
    w = torch.randn(len(counts), *shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    a_mx = mx.quantize_rows(torch.where(torch.arange(m + padding)[:, None] < m, a, 0))
    return a_mx, mx.quantize_weight(w, transposed), offsets


# counts per expert (empty experts, groups that are not multiples of 32 or of 128, one over 128),
# padding rows after the last offset, K, N
CASES = [
    ((5, 0, 17, 9, 0), 6, 64, 48),
    ((130, 1, 0, 33), 3, 96, 32),
    ((0, 0, 40), 0, 160, 16),
    ((7, 300), 11, 32, 144),
]


@pytest.mark.parametrize("transposed", [False, True], ids=["fprop", "dgrad"])
@pytest.mark.parametrize("counts, padding, k, n", CASES)
def test_op_gets_its_layout_and_matches_the_emulation(op, counts, padding, k, n, transposed):
    a_mx, w_mx, offsets = _operands(counts, padding, k, n, transposed)
    assert smm.accepts(a_mx, w_mx, torch.bfloat16)
    got = mx.grouped_mm(a_mx, w_mx, offsets, torch.bfloat16, path=mx.GemmPath.SCALED_GROUPED_MM)
    assert op.calls == 1
    want = mx.grouped_mm(a_mx, w_mx, offsets, torch.float32, path=mx.GemmPath.EMULATION)
    m = sum(counts)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got[m:], torch.zeros_like(got[m:])), "rows after the last offset come out as zeros"
    # Exact products, fp32 sums in other orders, then one bf16 rounding: within one bf16 ulp.
    err = (got[:m].float() - want[:m]).abs()
    assert (err <= want[:m].abs() * 2**-8 + 1e-30).all()


def test_group_padded_rows_by_hand():
    """Experts of 3, 0 and 130 rows and 2 padding rows: expert 0 at row 0, expert 2 at row 128."""
    scales = torch.arange(1, 136, dtype=torch.uint8).view(torch.float8_e8m0fnu)[:, None]
    offsets = torch.tensor([3, 3, 133], dtype=torch.int32)
    got = smm.group_padded_rows(scales, offsets).view(torch.uint8)[:, 0]
    assert got.shape == (256 + 3 * 128,)
    want = torch.zeros_like(got)
    want[0:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    want[128:258] = torch.arange(4, 134, dtype=torch.uint8)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "out_dtype, k, n, rows, experts, accepted",
    [
        (torch.bfloat16, 64, 48, 40, 4, True),
        (torch.float32, 64, 48, 40, 4, False),  # the op writes bf16 only
        (torch.bfloat16, 64, 40, 40, 4, False),  # N not a multiple of 16
        (torch.bfloat16, 64, 48, 3, 4, False),  # fewer rows than experts
    ],
)
def test_acceptance(out_dtype, k, n, rows, experts, accepted):
    a = mx.quantize_rows(torch.randn(rows, k))
    b = mx.quantize_weight(torch.randn(experts, n, k))
    assert smm.accepts(a, b, out_dtype) is accepted


def test_fallback_runs_and_the_label_says_so(op, monkeypatch):
    """An fp32 output is not the op's: the call runs the fallback, and the label names what ran."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mx, "_ran", {})
    monkeypatch.setattr(mx, "_compiled_mma", {})
    assert mx.available_path("cuda") is mx.GemmPath.SCALED_GROUPED_MM
    assert mx.path_label(mx.GemmPath.SCALED_GROUPED_MM, "cuda") == "scaled-grouped-mm-mxfp8-sm100"
    a_mx, w_mx, offsets = _operands((20, 12), 0, 64, 48, False)
    # What ran, recorded per device: CPU tensors stand for the device here.
    monkeypatch.setattr(mx, "_device_key", lambda device: torch.device("cuda", 0))
    mx.grouped_mm(a_mx, w_mx, offsets, torch.float32, path=mx.GemmPath.SCALED_GROUPED_MM)
    assert op.calls == 0
    assert mx.path_label(mx.GemmPath.SCALED_GROUPED_MM, "cuda:0") == "torch-emulation"  # CPU tensors' fallback
    mx.grouped_mm(a_mx, w_mx, offsets, torch.bfloat16, path=mx.GemmPath.SCALED_GROUPED_MM)
    assert op.calls == 1
    assert mx.path_label(mx.GemmPath.SCALED_GROUPED_MM, "cuda:0") == "scaled-grouped-mm-mxfp8-sm100"


def test_without_the_op_blackwell_gets_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    monkeypatch.delattr(F, "scaled_grouped_mm", raising=False)
    assert mx.available_path("cuda") is mx.GemmPath.TRITON


def _expert_step(counts, padding, d, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts) + padding
    x = (torch.randn(m, d, generator=g) * torch.logspace(-1, 1, d)).bfloat16().requires_grad_()
    gate_up = (torch.randn(len(counts), 2 * hidden, d, generator=g) * 0.1).bfloat16().requires_grad_()
    down = (torch.randn(len(counts), d, hidden, generator=g) * 0.1).bfloat16().requires_grad_()
    grad_y = torch.randn(m, d, generator=g).bfloat16()
    groups = ExpertGroups.from_counts(torch.tensor(counts))
    backend = MXFP8Backend()
    y = backend.forward(x, groups, gate_up, down)
    (y * grad_y).sum().backward()
    return y.detach(), x.grad, gate_up.grad, down.grad


def test_experts_train_through_the_op_as_through_the_emulation(op, monkeypatch):
    """The four MXFP8 GEMMs of a forward and backward (fprop h, y; dgrad a, x) go through the op; the
    outputs and all gradients match the emulation's within bf16 rounding of the GEMM outputs."""
    counts, padding, d, hidden = (37, 0, 130, 5), 9, 64, 48
    want = _expert_step(counts, padding, d, hidden)
    monkeypatch.setattr(mx, "available_path", lambda device: mx.GemmPath.SCALED_GROUPED_MM)
    got = _expert_step(counts, padding, d, hidden)
    assert op.calls == 4
    m = sum(counts)
    for name, g, w in zip(("y", "x", "gate_up", "down"), got, want):
        g, w = g.float(), w.float()
        if name in ("y", "x"):
            assert torch.equal(g[m:], torch.zeros_like(g[m:])), name
        # The same exact products summed in another order: at most a bf16 rounding apart (equal on a CPU).
        assert ((g - w).norm() / w.norm()).item() < 2**-8, name


@pytest.mark.parametrize("counts, padding, cols, strided", BLOCKED_CASES)
def test_group_scales_on_the_device_by_index_formula(counts, padding, cols, strided, device):
    """The A-scale layout as the test device computes it (CUDA: the kernel), against the index formula:
    expert e's rows start at padded row sum_{i<e} round_up(rows_i, 128); every other byte is zero."""
    g = torch.Generator().manual_seed(len(counts) + cols)
    rows = sum(counts) + padding
    codes = torch.randint(1, 256, (cols, rows) if strided else (rows, cols), generator=g, dtype=torch.uint8)
    codes = codes.to(device)
    scales = (codes.t() if strided else codes).view(torch.float8_e8m0fnu)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    got = smm.blocked_group_scales(scales, offsets).view(torch.uint8).cpu()
    source = scales.view(torch.uint8).cpu()
    cols_p = _round_up(cols, 4)
    want = torch.zeros((_round_up(rows, 128) + 128 * len(counts)) * cols_p, dtype=torch.uint8)
    start = padded_start = 0
    for count in counts:
        r, c = torch.meshgrid(torch.arange(count), torch.arange(cols), indexing="ij")
        want[blocked_index(padded_start + r, c, cols_p)] = source[start : start + count]
        start, padded_start = start + count, padded_start + _round_up(count, 128)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows, cols, end, dtype", ZERO_CASES)
def test_tail_zeroing_on_the_device(rows, cols, end, dtype, device):
    g = torch.Generator().manual_seed(rows + end)
    before = torch.randn(rows, cols, generator=g).to(getattr(torch, dtype))
    before[::3] = float("nan")  # garbage rows, as the op leaves them
    offsets = torch.tensor([end // 2, end], dtype=torch.int32, device=device)
    got = smm.zero_rows_after(before.to(device), offsets).cpu()
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    assert torch.equal(got[:end].view(bits), before[:end].view(bits))
    assert torch.equal(got[end:].view(bits), torch.zeros_like(got[end:]).view(bits)), "+0.0 after the end"
