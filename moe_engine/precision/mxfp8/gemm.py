"""MXFP8 grouped GEMMs for the routed experts: both operands in blocks of 32 along the reduction dim.
The paths, the precision of each GEMM and the operands' layouts: docs/precision.md.
"""

from __future__ import annotations

import re
from enum import Enum

import torch
import torch.nn.functional as F

from moe_engine.kernels.storage import as_bits, on_device, store_f32
from moe_engine.moe.grouped_gemm import grouped_mm as grouped_mm_checked
from moe_engine.precision.mxfp8 import scaled_mm as scaled_mm
from moe_engine.precision.mxfp8.blocks import BLOCK, MXTensor, pad_to_block
from moe_engine.precision.mxfp8.kernels import quantize_auto as quantize

try:
    import triton
    import triton.language as tl
except ImportError:  # a platform without Triton still has the emulation
    triton = None


class GemmPath(str, Enum):
    """Implementation of the MXFP8 grouped GEMM."""

    SCALED_GROUPED_MM = "scaled-grouped-mm-mxfp8"
    """``torch.nn.functional.scaled_grouped_mm`` with BlockWise1x32 scales (CUTLASS, capability 10.x)."""
    TRITON = "triton-dot-scaled"
    """Triton grouped GEMM on ``tl.dot_scaled`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    EMULATION = "torch-emulation"
    """Dequantize to fp32, then ``torch._grouped_mm`` (any device)."""


FP8_MIN_CAPABILITY = (8, 9)
"""Triton's e4m3 type, which ``tl.dot_scaled`` takes, exists from this CUDA capability on."""
SCALED_MMA = "tc_gen5_mma_scaled"
"""The TTGIR op of Blackwell's block-scaled tensor-core MMA."""
_compiled_mma: dict[torch.device, str] = {}
"""Per CUDA device, the tensor-core op the last compiled MXFP8 GEMM holds (``note_compiled``)."""
_ran: dict[torch.device, GemmPath] = {}
"""Per device, what the last call asked for torch's scaled op ran: the op or its fallback."""


def available_path(device: torch.device | str) -> GemmPath:
    """The fastest implementation on ``device``: torch's scaled op on capability 10.x where torch has
    it, Triton on CUDA from capability 8.9, else the emulation."""
    device = torch.device(device)
    if device.type != "cuda":
        return GemmPath.EMULATION
    capability = torch.cuda.get_device_capability(device)
    if getattr(F, "scaled_grouped_mm", None) is not None and capability[0] in scaled_mm.SCALED_GROUPED_MM_MAJORS:
        return GemmPath.SCALED_GROUPED_MM
    if triton is not None and capability >= FP8_MIN_CAPABILITY:
        return GemmPath.TRITON
    return GemmPath.EMULATION


def _fallback_path(device: torch.device) -> GemmPath:
    """What runs where torch's scaled op does not take the operands."""
    return GemmPath.TRITON if triton is not None and device.type == "cuda" else GemmPath.EMULATION


def _device_key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def note_compiled(device: torch.device | str, ttgir: str) -> None:
    """Record what the MXFP8 GEMM compiled to on ``device`` (its TTGIR): the scaled MMA or not."""
    _compiled_mma[torch.device(device)] = "native" if re.search(rf"\b{SCALED_MMA}\b", ttgir) else "emulated"


def path_label(path: GemmPath | str, device: torch.device | str) -> str:
    """``path`` and how the hardware ran it, as results record it (``details.expert_backend_path``).

    ``...-native-smXY`` when the compiled GEMM holds the block-scaled tensor-core MMA
    (``tc_gen5_mma_scaled``), ``...-emulated-smXY`` when Triton decomposed the scaled dot into an
    upcast and a bf16 MMA (Hopper, or tiles too small for it): such a run measures the emulation, not
    MXFP8 hardware, and is no comparison for a B200/B300 figure. Before the first compile on the
    device, ``...-smXY`` alone: nothing has shown yet how it runs.

    ``scaled-grouped-mm-mxfp8-smXY`` when the last call on the device asked for torch's op and ran
    it (or before any call); the fallback's label when that call ran the fallback.
    """
    path, device = GemmPath(path), torch.device(device)
    if device.type != "cuda" or path is GemmPath.EMULATION:
        return path.value
    device = _device_key(device)
    if path is GemmPath.SCALED_GROUPED_MM:
        ran = _ran.get(device, path)
        if ran is not path:
            return path_label(ran, device)
    major, minor = torch.cuda.get_device_capability(device)
    if path is GemmPath.SCALED_GROUPED_MM:
        return f"{path.value}-sm{major}{minor}"
    how = _compiled_mma.get(device)
    return f"{path.value}-{how}-sm{major}{minor}" if how else f"{path.value}-sm{major}{minor}"


# --- operands -----------------------------------------------------------------------------------


# Each operand function runs as one kernel on a GPU and as several ATen ops on a CPU; the profiler
# mark names it, for profiles and for ``bench.run.trace``, which prices it as one kernel on a GPU.
@torch.profiler.record_function("mxfp8.quantize")
def quantize_rows(t_MK: torch.Tensor) -> MXTensor:
    """An (M, K) activation or gradient as the A operand: blocks along K, K zero-padded to 32."""
    data, scales = quantize(pad_to_block(t_MK, -1), axis=-1)
    return MXTensor(data, scales, axis=-1)


@torch.profiler.record_function("mxfp8.quantize")
def quantize_weight(w_EOI: torch.Tensor, transposed: bool = False) -> MXTensor:
    """An (E, O, I) weight as the B operand (E, N, K) of ``grouped_mm``.

    ``transposed=False``: for ``A @ w[e]^T`` (K = I), blocks along I.
    ``transposed=True``: for ``A @ w[e]`` (K = O), blocks along O, returned as an (E, I, O) view.
    """
    axis = 1 if transposed else 2
    data, scales = quantize(pad_to_block(w_EOI, axis), axis=axis)
    if transposed:
        return MXTensor(data.transpose(1, 2), scales.transpose(1, 2), axis=2)
    return MXTensor(data, scales, axis=2)


@torch.profiler.record_function("mxfp8.dequantize")
def dequantize_rows(t: MXTensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """The (M, size) values a ``quantize_rows`` operand stands for (its K padding dropped): one Triton
    kernel on CUDA (what the experts' backward reads its saved operands with), the eager composition
    with its fp32 temporaries elsewhere; the same values either way."""
    if t.data.is_cuda and dtype in (torch.float32, torch.bfloat16) and triton is not None:
        return dequantize_rows_triton(t.data, t.scales, size, dtype)
    return t.dequantize(dtype)[:, :size]


# --- the grouped GEMM ---------------------------------------------------------------------------


@torch.profiler.record_function("mxfp8.grouped_mm")
def grouped_mm(
    a_MK: MXTensor,
    b_ENK: MXTensor,
    offsets_E: torch.Tensor,
    out_dtype: torch.dtype,
    path: GemmPath | str | None = None,
) -> torch.Tensor:
    """(M, N): rows of expert e times B[e]^T on the quantized values; zero rows after the last offset.

    ``path`` None picks ``available_path`` of A's device.
    """
    if a_MK.data.shape[1] != b_ENK.data.shape[2]:
        raise ValueError(f"K mismatch: A is {tuple(a_MK.data.shape)}, B is {tuple(b_ENK.data.shape)}")
    path = available_path(a_MK.data.device) if path is None else GemmPath(path)
    if path is GemmPath.SCALED_GROUPED_MM:
        device = a_MK.data.device
        ran = path if scaled_mm.accepts(a_MK, b_ENK, out_dtype) else _fallback_path(device)
        _ran[_device_key(device)] = ran
        if ran is path:
            return scaled_mm.grouped_mm(a_MK, b_ENK, offsets_E)
        path = ran
    if path is GemmPath.TRITON:
        return _triton_grouped_mm(a_MK, b_ENK, offsets_E, out_dtype)
    return _emulated_grouped_mm(a_MK, b_ENK, offsets_E, out_dtype)


def _emulated_grouped_mm(a_MK, b_ENK, offsets_E, out_dtype):
    # E4M3 values times a power of two fit bf16 exactly (3 of its 7 mantissa bits), so a bf16
    # GEMM (fp32 accumulation) sees the quantized values unchanged with half the transient bytes.
    compute = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    a_MK_c = a_MK.dequantize(compute)
    b_ENK_c = b_ENK.dequantize(compute)
    out_MN = grouped_mm_checked(a_MK_c, b_ENK_c.transpose(1, 2), offsets_E)
    # The grouped GEMM leaves rows after the last offset uninitialised.
    real_M1 = (torch.arange(out_MN.shape[0], device=out_MN.device) < offsets_E[-1]).unsqueeze(1)
    return torch.where(real_M1, out_MN, 0).to(out_dtype)


def _block_k(k: int) -> int:
    return next(b for b in (128, 64, 32) if k % b == 0)


GEMM_CONFIGS = ((128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (64, 64, 4, 4))
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) the Triton GEMM is tuned over, on its first call per
(N, K, experts) on a device. Compiled for sm_90a, 128 x 64 and 64 x 128 tiles on 4 warps spilled
(Hopper upcasts the e4m3 tiles to bf16 in registers); on 8 warps they do not."""
SCALED_MMA_TILES = ((128, 128), (128, 64))
"""The (BLOCK_M, BLOCK_N) of ``GEMM_CONFIGS`` whose sm_100a IR holds ``tc_gen5_mma_scaled``
(``bench.validate.kernel_compile``); on capability 10.x the tuning keeps to those."""


def _prune_configs(configs, named_args, **kwargs):
    """On Blackwell, the tiles that run on its MX tensor cores; every config elsewhere."""
    device = named_args["a_ptr"].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10:
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) in SCALED_MMA_TILES]
    return configs


def _run_once(kernel_call, quantiles):
    """The interpreter's stand-in for timing: every config runs once (so each is exercised and, for
    ``bench.validate.kernel_compile``, recorded), and the first one is kept."""
    kernel_call()
    return [0.0] * len(quantiles)


def _triton_grouped_mm(a_MK, b_ENK, offsets_E, out_dtype):
    if triton is None:
        raise RuntimeError("the Triton MXFP8 grouped GEMM needs triton, which is not installed")
    m, k = a_MK.data.shape
    num_experts, n, _ = b_ENK.data.shape
    # Zeros, so that rows no expert owns come out as zeros (no program writes them).
    out_MN = torch.zeros(m, n, dtype=out_dtype, device=a_MK.data.device)
    if m == 0 or n == 0 or num_experts == 0:
        return out_MN
    a_scales = a_MK.scales.view(torch.uint8)
    b_scales = b_ENK.scales.view(torch.uint8)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) + num_experts, triton.cdiv(n, meta["BLOCK_N"]))

    with on_device(out_MN):
        compiled = _mx_grouped_mm_kernel[grid](
            a_MK.data,
            a_scales,
            b_ENK.data,
            b_scales,
            out_MN,
            offsets_E,
            m,
            n,
            k,
            num_experts,
            *a_MK.data.stride(),
            *a_scales.stride(),
            *b_ENK.data.stride(),
            *b_scales.stride(),
            *out_MN.stride(),
            BLOCK_K=_block_k(k),
            BLOCK_E=max(triton.next_power_of_2(num_experts), 2),
        )
    if out_MN.is_cuda:  # the interpreter compiles nothing
        note_compiled(out_MN.device, compiled.asm["ttgir"])
    return out_MN


_DEQUANTIZE_TILE = 4096
"""Elements one program of the dequantize kernel writes."""

if triton is not None:

    @triton.jit
    def _dequantize_kernel(
        data_ptr,
        scales_ptr,
        out_ptr,
        rows,
        width,
        size,
        BLOCK: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
        BF16: tl.constexpr,
    ):
        # One pass: E4M3 code and E8M0 scale -> fp32 by integer operations (exact), one fp32 product (the
        # eager composition's only rounding), then the output dtype. Columns at or past ``size`` (the
        # operand's K padding) are neither read nor written.
        r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = (r < rows)[:, None] & (c < size)[None, :]
        r64 = r.to(tl.int64)[:, None]
        code = tl.load(data_ptr + r64 * width + c[None, :], mask=mask, other=0).to(tl.int32) & 0xFF
        biased = tl.load(scales_ptr + r64 * (width // BLOCK) + (c // BLOCK)[None, :], mask=mask, other=127)
        biased = biased.to(tl.int32) & 0xFF
        sign = (code & 0x80) << 24
        exponent = (code >> 3) & 0xF
        mantissa = code & 0x7
        normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9
        subnormal = tl.where(sign != 0, -subnormal, subnormal)
        value = tl.where(exponent == 0, subnormal, normal)
        value = tl.where((code & 0x7F) == 0x7F, float("nan"), value)
        # 2^(biased - 127): a normal fp32 from 2^-126 up, 2^-127 is the subnormal 0x00400000.
        scale_bits = tl.where(biased >= 1, biased << 23, 0x00400000)
        scale = tl.where(biased == 255, float("nan"), scale_bits.to(tl.float32, bitcast=True))
        store_f32(out_ptr, r64 * size + c[None, :], value * scale, mask, BF16)

    def dequantize_rows_triton(data_MK: torch.Tensor, scales_MS: torch.Tensor, size: int, dtype: torch.dtype):
        """(M, size) in ``dtype`` from an MXFP8 operand blocked along its last dim (K >= size, K padding
        dropped): the same values as ``mxfp8.dequantize(...).to(dtype)[:, :size]``, without its fp32
        temporaries. CUDA tensors, or CPU ones under TRITON_INTERPRET=1."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"MXFP8 dequantization writes float32 or bfloat16, not {dtype}")
        rows, width = data_MK.shape
        out = torch.empty(rows, size, dtype=dtype, device=data_MK.device)
        if rows and size:
            block_cols = min(triton.next_power_of_2(size), 256)
            block_rows = max(1, _DEQUANTIZE_TILE // block_cols)
            grid = (triton.cdiv(rows, block_rows), triton.cdiv(size, block_cols))
            with on_device(data_MK):
                _dequantize_kernel[grid](
                    data_MK.contiguous().view(torch.uint8),
                    scales_MS.contiguous().view(torch.uint8),
                    as_bits(out),
                    rows,
                    width,
                    size,
                    BLOCK=BLOCK,
                    BLOCK_ROWS=block_rows,
                    BLOCK_COLS=block_cols,
                    BF16=dtype == torch.bfloat16,
                )
        return out

    @triton.jit
    def _expert_tile(offsets_ptr, num_experts, pid_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """(expert, first row, end row) of row tile ``pid_m``; expert == num_experts past the last tile."""
        e = tl.arange(0, BLOCK_E)
        ends = tl.load(offsets_ptr + e, mask=e < num_experts, other=0)
        starts = tl.load(offsets_ptr + e - 1, mask=(e > 0) & (e < num_experts), other=0)
        tiles = tl.where(e < num_experts, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tiles_end = tl.cumsum(tiles, 0)
        expert = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
        # The selected expert's entries, as masked sums (a gather from a block by a scalar index).
        mine = e == expert
        first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
        row_start = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(mine, ends, 0), 0)
        return expert, row_start, row_end

    # Tuning runs each config on the output buffer: programs only store (no accumulation into it),
    # and each writes the same rows whatever the tile, so the repeated runs leave the same result.
    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
            for bm, bn, warps, stages in GEMM_CONFIGS
        ],
        key=["N", "K", "num_experts"],
        prune_configs_by={"early_config_prune": _prune_configs},
        do_bench=_run_once if triton.knobs.runtime.interpret else None,
    )
    @triton.jit
    def _mx_grouped_mm_kernel(
        a_ptr,
        a_scale_ptr,
        b_ptr,
        b_scale_ptr,
        c_ptr,
        offsets_ptr,
        M,
        N,
        K,
        num_experts,
        stride_am,
        stride_ak,
        stride_asm,
        stride_ask,
        stride_be,
        stride_bn,
        stride_bk,
        stride_bse,
        stride_bsn,
        stride_bsk,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """C[rows of e, n-tile] = A[rows of e] @ B[e]^T with A (M, K), B (E, N, K) in e4m3 + e8m0 scales."""
        SCALES_K: tl.constexpr = BLOCK_K // 32
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert, row_start, row_end = _expert_tile(offsets_ptr, num_experts, pid_m, BLOCK_M, BLOCK_E)
        if expert < num_experts:
            rows = row_start + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < row_end
            col_ok = cols < N
            rows64 = rows.to(tl.int64)
            cols64 = cols.to(tl.int64)
            b_base = b_ptr + expert.to(tl.int64) * stride_be
            bs_base = b_scale_ptr + expert.to(tl.int64) * stride_bse
            ks = tl.arange(0, BLOCK_K)
            ss = tl.arange(0, SCALES_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # K is a multiple of BLOCK_K (the launcher picks BLOCK_K among the divisors 128, 64, 32).
            for k0 in range(0, K, BLOCK_K):
                a = tl.load(
                    a_ptr + rows64[:, None] * stride_am + (k0 + ks)[None, :] * stride_ak,
                    mask=row_ok[:, None],
                    other=0.0,
                )
                # Scale byte 127 is 2^0: masked rows hold zeros times one, never NaN.
                a_scale = tl.load(
                    a_scale_ptr + rows64[:, None] * stride_asm + (k0 // 32 + ss)[None, :] * stride_ask,
                    mask=row_ok[:, None],
                    other=127,
                )
                b = tl.load(
                    b_base + cols64[None, :] * stride_bn + (k0 + ks)[:, None] * stride_bk,
                    mask=col_ok[None, :],
                    other=0.0,
                )
                b_scale = tl.load(
                    bs_base + cols64[:, None] * stride_bsn + (k0 // 32 + ss)[None, :] * stride_bsk,
                    mask=col_ok[:, None],
                    other=127,
                )
                acc = tl.dot_scaled(a, a_scale, "e4m3", b, b_scale, "e4m3", acc)
            c = c_ptr + rows64[:, None] * stride_cm + cols64[None, :] * stride_cn
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
