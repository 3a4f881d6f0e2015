"""The operations of a traced training step, and what each one costs in work: FLOPs or bytes.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from bench.predict.fused_ops import FUSED_GEMMS, fused_work, is_fused
from bench.predict.traced import OpWork, TensorSpec, TracedOp, dtype_bytes

__all__ = ["KINDS", "OpWork", "TensorSpec", "TracedOp", "dtype_bytes", "op_kind", "op_work"]

KINDS = ("free", "gemm", "grouped_gemm", "mx_gemm", "attention", "collective", "fused", "memory")
STAGES = ("forward", "backward", "optimizer", "other")

_GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
_ATTENTION = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
}
_FREE = {
    "prim.device",
    "aten.detach",
    "aten.alias",
    "aten.lift_fresh",
    "aten._local_scalar_dense",
    "aten.view",
    "aten._unsafe_view",
    "aten.t",
    "aten.transpose",
    "aten.permute",
    "aten.expand",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.slice",
    "aten.select",
    "aten.split",
    "aten.split_with_sizes",
    "aten.chunk",
    "aten.unbind",
    "aten.as_strided",
    "aten.reshape",
    "aten._reshape_alias",
    "aten.unfold",
    "aten.diagonal",
    "aten.narrow",
    "aten.view_as_real",
    "aten.view_as_complex",
    "aten.empty",
    "aten.empty_like",
    "aten.new_empty",
    "aten.empty_strided",
    "aten.new_empty_strided",
    "aten.set_",
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
    "aten.is_same_size",
    "aten.resize_",
}
REGIONS = (
    "mxfp8.grouped_mm",
    "mxfp8.grouped_wgrad",
    "mxfp8.quantize",
    "mxfp8.dequantize",
    "fp8.grouped_mm",
    "fp8.quantize",
    "fp8.dequantize",
)
"""Engine functions that run as one kernel on a GPU and as several ATen ops on a CPU."""


def op_kind(op: TracedOp) -> str:
    """The kind a profile prices ``op`` as (docs/projection-formulas.md)."""
    namespace, _, rest = op.name.partition(".")
    base = rest.split(".")[0]
    if namespace == "c10d" or op.collective is not None:
        return "collective"
    if op.packet in _FREE or namespace in ("profiler", "prim"):
        return "free"
    if namespace == "moe_engine":
        return FUSED_GEMMS.get(base, "fused")
    if base in _GEMMS:
        return "gemm"
    if base == "_grouped_mm":
        return "grouped_gemm"
    if base.removesuffix("_backward") in _ATTENTION:
        return "attention"
    return "memory"


def _moved_bytes(op: TracedOp) -> int:
    return sum(s.nbytes for s in op.inputs) + sum(s.nbytes for s in op.outputs)


def gemm_shape(op: TracedOp) -> tuple[int, ...]:
    """(M, N, K) of a product, (B, M, N, K) of a batched one: out (..., M, N) from a (..., M, K)."""
    base = op.name.split(".")[1]
    out = op.outputs[0].shape
    a = op.inputs[1] if base in ("addmm", "baddbmm") else op.inputs[0]
    return (*out[:-2], out[-2], out[-1], a.shape[-1]) if len(out) > 2 else (out[0], out[1], a.shape[-1])


def _gemm_flops(op: TracedOp) -> float:
    return 2.0 * math.prod(gemm_shape(op))


def grouped_gemm_flops(a: TensorSpec, b: TensorSpec, out: TensorSpec, group_rows: tuple[int, ...] | None) -> float:
    """FLOPs of ``_grouped_mm(a, b, offs)`` in each of its layouts, counting only rows inside groups.

    a (M, K) x b (G, K, N) -> (M, N):       2 * R * K * N, R = rows in groups (M when unknown)
    a (M, Kt) x b (Kt, N) -> (G, M, N):     2 * M * N * R, the groups along the reduction (weight gradients)
    a (G, M, K) x b (G, K, N) -> (G, M, N): 2 * G * M * N * K
    a (G, M, K) x b (K', N) -> (M', N):     2 * R * K * N (the grouped dim on b's rows)
    """
    rows = sum(group_rows) if group_rows is not None else None
    if len(a.shape) == 2 and len(b.shape) == 3:
        return 2.0 * (rows if rows is not None else a.shape[0]) * a.shape[1] * b.shape[2]
    if len(a.shape) == 2 and len(b.shape) == 2:
        return 2.0 * a.shape[0] * b.shape[1] * (rows if rows is not None else a.shape[1])
    if len(a.shape) == 3 and len(b.shape) == 3:
        return 2.0 * math.prod(out.shape) * a.shape[2]
    return 2.0 * (rows if rows is not None else b.shape[0]) * a.shape[2] * b.shape[1]


def grouped_shape(a: TensorSpec, b: TensorSpec, out: TensorSpec, groups: int, flops: float) -> tuple[int, ...]:
    """(groups, rows per group, N, K) as a profile measures grouped GEMMs: rows the grouped dim, N x K
    the rest of each product (a weight gradient's (M, N) output in their place)."""
    if len(a.shape) == 2 and len(b.shape) == 2:
        n, k = a.shape[0], b.shape[1]
    elif len(b.shape) == 3:
        n, k = b.shape[2], a.shape[-1]
    else:
        n, k = b.shape[-1], a.shape[-1]
    rows = round(flops / (2 * groups * n * k)) if n and k else 0
    return groups, rows, n, k


def attention_flops(op: TracedOp) -> float:
    """Forward 4 * B * H * Sq * Sk * d (halved when causal); backward 2.5 times that."""
    q, k = op.inputs[0], op.inputs[1]
    backward = op.name.split(".")[1].endswith("_backward")
    if backward:
        # Backward kernels take grad_out first, then q, k.
        q, k = op.inputs[1], op.inputs[2]
    # Every kernel takes (B, H, S, d).
    *batch, sq, d = q.shape
    sk = k.shape[-2]
    forward = 4.0 * math.prod(batch) * sq * sk * d
    if _is_causal(op):
        forward /= 2
    return 2.5 * forward if backward else forward


def _is_causal(op: TracedOp) -> bool:
    return dict(op.arguments).get("is_causal", False) is True


def op_work(op: TracedOp) -> OpWork:
    """The work of ``op`` (docs/projection-formulas.md)."""
    kind = op_kind(op)
    dtype = op.inputs[0].dtype if op.inputs else (op.outputs[0].dtype if op.outputs else "torch.float32")
    moved = _moved_bytes(op)
    if kind == "gemm":
        if is_fused(op):  # wgrad_accumulate(a_NM, b_NK, out_MK): out += a^T b, a's leading dims the N rows
            a, out = op.inputs[0], op.inputs[2]
            shape = (out.shape[0], out.shape[1], math.prod(a.shape[:-1]))
            # out read above as an input, written back
            return OpWork(kind, 2.0 * math.prod(shape), moved + out.nbytes, dtype, shape=shape)
        return OpWork(kind, _gemm_flops(op), moved, dtype, shape=gemm_shape(op))
    if kind == "grouped_gemm":
        a, b = op.inputs[0], op.inputs[1]
        if is_fused(op):  # grouped_wgrad_accumulate(a_NM, b_NK, offsets_E, out_EMK): out += a^T b per group
            a, out = TensorSpec((a.shape[1], a.shape[0]), a.dtype), op.inputs[3]
            moved += out.nbytes  # read above as an input, written back
        else:
            out = op.outputs[0]
        groups = max(len(op.group_rows) if op.group_rows is not None else (b.shape[0] if len(b.shape) == 3 else 1), 1)
        flops = grouped_gemm_flops(a, b, out, op.group_rows)
        return OpWork(
            kind,
            flops,
            moved,
            dtype,
            groups,
            shape=grouped_shape(a, b, out, groups, flops),
            grouped_reduction=len(a.shape) == 2 and len(b.shape) == 2,
        )
    if kind == "attention":
        return OpWork(kind, attention_flops(op), moved, dtype, backward=op.name.split(".")[1].endswith("_backward"))
    if kind == "fused":
        return fused_work(op)
    if kind in ("free", "collective"):
        return OpWork(kind, 0.0, 0.0 if kind == "free" else moved, dtype)
    return OpWork(kind, 0.0, moved, dtype)


def region_op(ops: Iterable[TracedOp], region: str) -> OpWork:
    """One kernel standing for the ATen ops of a region run (their order: as traced).

    mxfp8.grouped_mm: the grouped GEMM's FLOPs at the MX rate; its bytes are the quantized operands
    it reads (what the GPU kernel reads: fp8 values + scales) and the output it writes.
    mxfp8.grouped_wgrad: the same, adding into an fp32 gradient buffer, which it reads as well.
    mxfp8.quantize: a memory-bound pass reading the input, writing fp8 values and scales.
    mxfp8.dequantize: a memory-bound pass reading fp8 values and scales, writing the output.
    fp8.*: the same for rowwise FP8 (``moe_engine.precision.fp8_experts``): the grouped GEMM at the fp8
    rate (a grouped_gemm of dtype e4m3), its operands 1 byte per value plus one fp32 scale per row.
    """
    ops = list(ops)
    if region in ("mxfp8.grouped_mm", "mxfp8.grouped_wgrad"):
        gemms = [o for o in ops if op_kind(o) == "grouped_gemm"]
        if not gemms:
            raise ValueError(f"an {region} region without a grouped GEMM")
        flops = sum(op_work(o).flops for o in gemms)
        g = gemms[-1]
        a, b, out = g.inputs[0], g.inputs[1], g.outputs[0]
        # fp8 operands plus one scale byte per 32 values; the output at the GEMM's dtype, or the fp32
        # buffer the weight-gradient kernel adds into, read and written.
        nbytes = (a.numel + b.numel) * (1 + 1 / 32) + (8 * out.numel if region == "mxfp8.grouped_wgrad" else out.nbytes)
        groups = len(g.group_rows) if g.group_rows is not None else (b.shape[0] if len(b.shape) == 3 else 1)
        return OpWork("mx_gemm", flops, nbytes, "mxfp8", max(groups, 1))
    if region == "mxfp8.quantize":
        first = next((o for o in ops if o.inputs), None)
        source = first.inputs[0] if first is not None else TensorSpec((0,), "torch.bfloat16")
        return OpWork("memory", 0.0, source.nbytes + source.numel * (1 + 1 / 32), source.dtype)
    if region == "mxfp8.dequantize":
        last = next((o for o in reversed(ops) if o.outputs and op_kind(o) != "free"), None)
        out = last.outputs[0] if last is not None else TensorSpec((0,), "torch.bfloat16")
        return OpWork("memory", 0.0, out.numel * (1 + 1 / 32) + out.nbytes, out.dtype)
    if region.startswith("fp8."):
        return _fp8_region_op(ops, region)
    raise ValueError(f"unknown region {region!r}; expected one of {', '.join(REGIONS)}")


_E4M3 = "torch.float8_e4m3fn"


def _fp8_region_op(ops: list[TracedOp], region: str) -> OpWork:
    if region == "fp8.grouped_mm":
        gemms = [o for o in ops if op_kind(o) == "grouped_gemm"]
        if not gemms:
            raise ValueError("an fp8.grouped_mm region without a grouped GEMM")
        g = gemms[-1]
        work = op_work(g)
        a, b, out = g.inputs[0], g.inputs[1], g.outputs[0]
        # e4m3 operands, fp32 scales per row of a and per output column of each expert's b; the
        # output in the dtype the region hands back (the emulation accumulates in fp32, then casts).
        scales = a.shape[0] + (b.numel // b.shape[-2] if len(b.shape) == 3 else b.shape[-1])
        out_dtype = next((o.outputs[0].dtype for o in reversed(ops) if o.outputs and op_kind(o) != "free"), out.dtype)
        nbytes = a.numel + b.numel + 4 * scales + out.numel * dtype_bytes(out_dtype)
        return OpWork("grouped_gemm", work.flops, nbytes, _E4M3, work.groups, shape=work.shape)
    if region == "fp8.quantize":
        first = next((o for o in ops if o.inputs), None)
        source = first.inputs[0] if first is not None else TensorSpec((0,), "torch.bfloat16")
        rows = source.numel // source.shape[-1] if source.shape and source.shape[-1] else 0
        return OpWork("memory", 0.0, source.nbytes + source.numel + 4 * rows, source.dtype)
    last = next((o for o in reversed(ops) if o.outputs and op_kind(o) != "free"), None)
    out = last.outputs[0] if last is not None else TensorSpec((0,), "torch.bfloat16")
    rows = out.numel // out.shape[-1] if out.shape and out.shape[-1] else 0
    return OpWork("memory", 0.0, out.numel + 4 * rows + out.nbytes, out.dtype)
