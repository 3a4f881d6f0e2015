"""Experts' SwiGLU in rowwise FP8 (``ExpertBackendKind.FP8``): torchao's float8 MoE training recipe.
The paths, the precision of each GEMM and the operands' layouts: docs/precision.md.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

import moe_engine.moe.expert_backend as ex
from moe_engine import weight_grad_split as split
from moe_engine.moe.grouped_gemm import grouped_mm
from moe_engine.precision import fp8_rowwise as fp8

SCALED_GROUPED_MM_MAJORS = (9,)
"""CUDA capability majors where torch's rowwise ``scaled_grouped_mm`` runs (CUTLASS, sm90 only)."""


class FP8Path(str, Enum):
    """The op that runs the FP8 grouped GEMMs."""

    SCALED_GROUPED_MM = "scaled-grouped-mm-rowwise"
    """``torch.nn.functional.scaled_grouped_mm`` with RowWise scales (CUTLASS on sm90)."""
    EMULATION = "torch-emulation"
    """Dequantize, then ``torch._grouped_mm`` in fp32 (``scaled_grouped_mm_emulated``)."""


def available_path(device: torch.device | str) -> FP8Path:
    """The op the GEMMs use on ``device``: torch's scaled grouped GEMM where torch has it and the GPU
    runs it, the emulation elsewhere."""
    device = torch.device(device)
    if (
        device.type == "cuda"
        and getattr(F, "scaled_grouped_mm", None) is not None
        and torch.cuda.get_device_capability(device)[0] in SCALED_GROUPED_MM_MAJORS
    ):
        return FP8Path.SCALED_GROUPED_MM
    return FP8Path.EMULATION


def path_label(path: FP8Path, device: torch.device | str) -> str:
    """``path``, with the device's capability where it is torch's CUDA op (``...-sm90``)."""
    device = torch.device(device)
    if path is not FP8Path.SCALED_GROUPED_MM:
        return path.value
    major, minor = torch.cuda.get_device_capability(device)
    return f"{path.value}-sm{major}{minor}"


def scaled_grouped_mm_emulated(
    mat_a_MK: torch.Tensor,
    mat_b_EKN: torch.Tensor,
    scale_a_M: torch.Tensor,
    scale_b_EN: torch.Tensor,
    offs_E: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """What ``scaled_grouped_mm(mat_a, mat_b, scale_a, RowWise, scale_b, RowWise, offs=offs)``
    computes (2d x 3d): row m of expert e is ``sum_k a[m,k] scale_a[m] b[e,k,n] scale_b[e,n]``, the
    scales multiplying (decode scales, the reciprocals of the quantization's). fp32 accumulation, then
    ``out_dtype``; rows after the last offset are zero."""
    # torch's fake kernel of ``_grouped_mm`` takes bf16 only; a traced step (fake tensors) needs the
    # shapes, and the projection prices the region as one fp8 GEMM whatever it computes in.
    compute = torch.bfloat16 if is_fake(mat_a_MK) else torch.float32
    a_MK = (mat_a_MK.to(torch.float32) * scale_a_M.unsqueeze(1)).to(compute)
    b_EKN = (mat_b_EKN.to(torch.float32) * scale_b_EN.unsqueeze(1)).to(compute)
    out_MN = grouped_mm(a_MK, b_EKN, offs_E)
    real_M1 = (torch.arange(out_MN.shape[0], device=out_MN.device) < offs_E[-1]).unsqueeze(1)
    return torch.where(real_M1, out_MN, 0.0).to(out_dtype)


def _scaled_grouped_mm_op(mat_a, mat_b, scale_a, scale_b, offs, out_dtype):
    rowwise = F.ScalingType.RowWise
    # Looked up at call time: tests put a recording stand-in there; torch's stubs do not export it.
    op = F.scaled_grouped_mm  # type: ignore[attr-defined]
    return op(mat_a, mat_b, scale_a, rowwise, scale_b, rowwise, offs=offs, output_dtype=out_dtype)


def gemm_op(path: FP8Path) -> Callable[..., torch.Tensor]:
    """The callable of ``path``, with ``scaled_grouped_mm_emulated``'s arguments."""
    return _scaled_grouped_mm_op if path is FP8Path.SCALED_GROUPED_MM else scaled_grouped_mm_emulated


# Each function below runs as one kernel on a GPU and as several ATen ops on a CPU; the profiler mark
# names it, for profiles and for ``bench.run.trace``, which prices it as one kernel on a GPU.
@torch.profiler.record_function("fp8.grouped_mm")
def run_gemm(path: FP8Path, mat_a, mat_b, scale_a, scale_b, offs, out_dtype) -> torch.Tensor:
    """``gemm_op(path)`` on the op's arguments."""
    return gemm_op(path)(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)


@torch.profiler.record_function("fp8.quantize")
def quantize_rows(t_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 (M, K) row-major, fp32 (M,) decode scales): the op's ``mat_a`` and ``scale_a``."""
    data, scale = fp8.quantize(t_MK, axis=-1)
    return data, scale.reciprocal().squeeze(1)


@torch.profiler.record_function("fp8.quantize")
def quantize_weight(w_ENK: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``mat_b`` (E, K, N) column-major and its (E, N) decode scales for ``x @ w[e].T`` (w stored
    (E, N, K), scaled along K); with ``transposed``, for ``g @ w[e]`` (reduction along w's dim 1)."""
    if transposed:
        w_ENK = w_ENK.transpose(1, 2)
    data, scale = fp8.quantize(w_ENK, axis=-1)
    # (E, N, K) contiguous viewed as (E, K, N): the column-major layout the op wants for mat_b.
    return data.contiguous().transpose(1, 2), scale.reciprocal().squeeze(2)


@torch.profiler.record_function("fp8.dequantize")
def dequantize_rows(data_MK: torch.Tensor, scale_M: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``quantize_rows`` stands for, in ``dtype``."""
    return (data_MK.to(torch.float32) * scale_M.unsqueeze(1)).to(dtype)


def fp8_grouped_mm(
    x_MK: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], offsets_E: torch.Tensor, dtype, path: FP8Path
) -> torch.Tensor:
    """(M, N) ``dtype``: the rows of x (quantized here) times the quantized weight ``w``
    (``quantize_weight``), expert by expert."""
    a, scale_a = quantize_rows(x_MK)
    return run_gemm(path, a, w[0], scale_a, w[1], offsets_E, dtype)


class _FP8GroupedSwiGLU(torch.autograd.Function):
    """fprop and dgrad GEMMs in rowwise FP8, wgrad in bf16; the main node of the split backward.

    Padding rows (after the last offset) are not zeroed: each row has its own scale, so whatever they
    hold (NaN included) stays in their own rows, which no GEMM reads and callers mask.

    Saves x in FP8 (the fprop operand itself, so wgrad of gate_up sees the x the forward multiplied)
    and h in the input's dtype; backward recomputes the activation from h."""

    @staticmethod
    def forward(ctx, x_ND, offsets_E, gate_up_EHD, down_EDF, stash, token, path, fused=False):
        x_q, x_scale = quantize_rows(x_ND)
        w_q, w_scale = quantize_weight(gate_up_EHD)
        h_NH = run_gemm(path, x_q, w_q, x_scale, w_scale, offsets_E, x_ND.dtype)
        y_ND = fp8_grouped_mm(ex.swiglu(h_NH, fused), quantize_weight(down_EDF), offsets_E, x_ND.dtype, path)
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x_q, x_scale, h_NH, offsets_E, gate_up_EHD, down_EDF)
            ctx.path, ctx.fused, ctx.stash = path, fused, stash
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        stash = ctx.stash
        token_grad = split.split_token_grad(ctx, grad_y_ND, 5)
        if split.weights_only_reentry(ctx, stash):
            return None, None, None, None, None, token_grad, None, None
        x_q, x_scale, h_NH, offsets_E, gate_up_EHD, down_EDF = ctx.saved_tensors
        dtype, path = grad_y_ND.dtype, ctx.path
        # Contiguous: a zero-stride gradient (from y.sum()) breaks the grouped GEMM's kernels.
        grad_y_ND = grad_y_ND.contiguous()
        grad_a_NF = fp8_grouped_mm(grad_y_ND, quantize_weight(down_EDF, transposed=True), offsets_E, dtype, path)
        a_NF, grad_h_NH = ex.swiglu_backward(h_NH, grad_a_NF, ctx.fused)
        if stash.wanted:

            def weight_grads():
                x_ND = dequantize_rows(x_q, x_scale, dtype)
                return ex.WeightGradOperands(offsets_E, (grad_h_NH, x_ND), (grad_y_ND, a_NF))

            stash.compute = weight_grads
        grad_x_ND = None
        if split.input_grad_wanted(ctx, 0):
            gate_up_dgrad = quantize_weight(gate_up_EHD, transposed=True)
            grad_x_ND = fp8_grouped_mm(grad_h_NH, gate_up_dgrad, offsets_E, dtype, path)
        return grad_x_ND, None, None, None, None, token_grad, None, None


class FP8Backend(ex.ExpertBackend):
    """Rowwise FP8 grouped GEMMs with device-side offsets (no host sync on the CUDA op's path).

    ``path`` labels the op the last forward called (``path_label``); before any forward, the one the
    first CUDA device would get, or the emulation."""

    def __init__(self, fused_swiglu: bool = False):
        super().__init__(fused_swiglu)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.path: str = path_label(available_path(device), device)

    def forward(self, x_ND, groups, gate_up_EHD, down_EDF):
        path = available_path(x_ND.device)
        self.path = path_label(path, x_ND.device)
        stash, token = ex.split_weights(x_ND, gate_up_EHD, down_EDF)
        return _FP8GroupedSwiGLU.apply(
            x_ND, groups.offsets_E, gate_up_EHD.detach(), down_EDF.detach(), stash, token, path, self.fused_swiglu
        )
