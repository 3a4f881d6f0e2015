"""The MXFP8 grouped GEMM: the torch emulation against an independent per-expert reference, the Triton
``tl.dot_scaled`` kernel against the emulation compiled on CUDA, the path's choice and label; the kernel
under Triton's interpreter and compiled for sm_100a in tests/integration/toolchains/test_mxfp8_gemm_triton.py."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import tolerance

from moe_engine.precision.mxfp8 import gemm as mx
from moe_engine.precision.mxfp8.blocks import dequantize, quantize

# counts per expert (empty experts included), padding rows after the last offset, K, N
CASES = [
    ((5, 0, 17, 9, 0), 6, 64, 48),
    ((0, 40, 1, 0), 0, 96, 32),
    ((3,), 4, 48, 40),  # K not a multiple of 32: zero-padded to 64
    ((0, 0, 0), 5, 32, 16),  # no expert gets a row: everything is padding
]


def _dequant_padded(w: torch.Tensor, axis: int) -> torch.Tensor:
    """quantize/dequantize along ``axis`` after zero-padding it to a multiple of 32, written out by hand."""
    size = w.shape[axis]
    padded = -size % 32
    moved = w.movedim(axis, -1)
    moved = torch.cat([moved, moved.new_zeros(*moved.shape[:-1], padded)], dim=-1)
    data, scales = quantize(moved, axis=-1)
    return dequantize(data, scales, axis=-1)[..., :size].movedim(-1, axis)


def reference(a_MK, w, counts, transposed):
    """fp32 loop over experts: rows of e times dequant(w[e])^T (fprop) or dequant(w[e]) (dgrad)."""
    a_deq = _dequant_padded(a_MK, axis=1)
    w_deq = _dequant_padded(w, axis=1 if transposed else 2)
    out = a_deq.new_zeros(a_MK.shape[0], w.shape[2] if transposed else w.shape[1])
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        out[rows] = a_deq[rows] @ (w_deq[e] if transposed else w_deq[e].T)
        start += count
    return out


def _operands(counts, padding, k, n, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    a_MK = torch.randn(m + padding, k, generator=g) * torch.logspace(-3, 3, k)  # per-block ranges differ
    a_MK[m:] = float("nan")  # padding rows hold garbage
    w = torch.randn(len(counts), *((k, n) if transposed else (n, k)), generator=g)
    offsets_E = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return a_MK, w, offsets_E


def max_relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("transposed", [False, True], ids=["fprop", "dgrad"])
@pytest.mark.parametrize("counts, padding, k, n", CASES)
def test_emulation_matches_per_expert_reference(counts, padding, k, n, transposed):
    a_MK, w, offsets_E = _operands(counts, padding, k, n, transposed)
    out = mx.grouped_mm(
        mx.quantize_rows(a_MK), mx.quantize_weight(w, transposed), offsets_E, torch.float32, path=mx.GemmPath.EMULATION
    )
    expected = reference(a_MK, w, counts, transposed)
    m = sum(counts)
    assert out.shape == expected.shape
    assert torch.equal(out[m:], torch.zeros_like(out[m:])), "padding rows must come out as zeros"
    if m:
        # Products of two 4-bit significands are exact in fp32: only the order of the sum over K differs.
        assert max_relative(out[:m], expected[:m]) < tolerance(torch.float32, k)


def test_dgrad_operand_is_requantized_not_transposed():
    """A transposed use blocks the weight along the new reduction axis: different values, not a view."""
    w = torch.randn(2, 64, 96) * torch.logspace(-2, 2, 96)
    fprop = mx.quantize_weight(w).dequantize(torch.float32)  # blocks along the last axis
    dgrad = mx.quantize_weight(w, transposed=True).dequantize(torch.float32)  # (E, 96, 64), blocks along 64
    assert torch.equal(dgrad, dequantize(*quantize(w, axis=1), axis=1).transpose(1, 2))
    assert not torch.equal(dgrad, fprop.transpose(1, 2))


def test_padding_k_is_exact():
    """Zero-padding K to a multiple of 32 adds nothing: the product equals the one on padded inputs."""
    a_MK, w, offsets_E = _operands((7, 5), 0, 40, 24, transposed=False)
    out = mx.grouped_mm(mx.quantize_rows(a_MK), mx.quantize_weight(w), offsets_E, torch.float32)
    padded = mx.grouped_mm(
        mx.quantize_rows(F.pad(a_MK, (0, 24))), mx.quantize_weight(F.pad(w, (0, 24))), offsets_E, torch.float32
    )
    assert torch.equal(out, padded)


@pytest.mark.parametrize(
    "capability, path",
    [
        ((8, 0), "torch-emulation"),
        ((8, 6), "torch-emulation"),
        ((8, 9), "triton-dot-scaled"),
        ((9, 0), "triton-dot-scaled"),
        ((10, 0), "scaled-grouped-mm-mxfp8"),
        ((10, 3), "scaled-grouped-mm-mxfp8"),
        ((12, 0), "triton-dot-scaled"),  # torch's MXFP8 grouped GEMM is major 10 only
    ],
)
def test_path_selection(capability, path, monkeypatch):
    """Triton has e4m3 only from capability 8.9: an A100 gets the emulation; torch's scaled op runs on
    capability 10.x only (``mxfp8.scaled_mm``)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert mx.available_path("cpu") is mx.GemmPath.EMULATION
    assert mx.available_path("cuda") is mx.GemmPath(path)
    assert mx.GemmPath("torch-emulation") is mx.GemmPath.EMULATION


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["fprop", "dgrad"])
def test_compiled_triton_kernel_matches_emulation(transposed):
    counts = [300, 0, 1, 129, 77, 0, 512, 31]
    a_MK, w, offsets_E = _operands(counts, 40, 512, 384, transposed)
    a_mx = mx.quantize_rows(a_MK.cuda())
    w_mx = mx.quantize_weight(w.cuda(), transposed)
    offsets_E = offsets_E.cuda()
    kernel = mx.grouped_mm(a_mx, w_mx, offsets_E, torch.float32, path=mx.GemmPath.TRITON)
    emulated = mx.grouped_mm(a_mx, w_mx, offsets_E, torch.float32, path=mx.GemmPath.EMULATION)
    m = sum(counts)
    assert torch.equal(kernel[m:], torch.zeros_like(kernel[m:]))
    # Hopper runs dot_scaled by upcasting to bf16 (exact for E4M3 x 2^k) with fp32 accumulation.
    assert max_relative(kernel[:m], emulated[:m]) < 1e-4


@pytest.mark.parametrize(
    "capability, ttgir, expected",
    [
        ((10, 0), "%d = ttng.tc_gen5_mma_scaled %a, %b", "triton-dot-scaled-native-sm100"),
        # A Blackwell whose kernel decomposed the scaled dot (tiles under 128 rows): not native.
        ((10, 0), "%d = ttng.tc_gen5_mma %a, %b", "triton-dot-scaled-emulated-sm100"),
        ((10, 3), "ttng.tc_gen5_mma_scaled", "triton-dot-scaled-native-sm103"),
        ((9, 0), "%d = ttng.warp_group_dot %a, %b", "triton-dot-scaled-emulated-sm90"),
        ((9, 0), None, "triton-dot-scaled-sm90"),  # nothing compiled yet: no claim
    ],
)
def test_path_label_comes_from_the_compiled_ir(capability, ttgir, expected, monkeypatch):
    """The label says what the compiled kernel holds, on a faked device with a faked compile."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mx, "_compiled_mma", {})
    if ttgir is not None:
        mx.note_compiled("cuda:0", ttgir)
    assert mx.path_label(mx.GemmPath.TRITON, "cuda") == expected
    assert mx.path_label(mx.GemmPath.TRITON, "cuda:0") == expected
    assert mx.path_label(mx.GemmPath.EMULATION, "cuda") == "torch-emulation"
    assert mx.path_label(mx.GemmPath.TRITON, "cpu") == "triton-dot-scaled"  # the Triton interpreter


def test_blackwell_tunes_over_the_scaled_mma_tiles_only(monkeypatch):
    """On capability 10.x the tuning keeps to the tiles that run on MX tensor cores; elsewhere all."""
    configs = mx._mx_grouped_mm_kernel.configs
    tiles = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs}
    assert (128, 128) in tiles and len(tiles) >= 3
    args = {"a_ptr": torch.empty(0)}
    assert mx._prune_configs(configs, args) == configs  # CPU tensors (the interpreter): every config
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    for capability, kept in [((10, 0), set(mx.SCALED_MMA_TILES)), ((9, 0), tiles)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        pruned = mx._prune_configs(configs, args)
        assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in pruned} == kept
