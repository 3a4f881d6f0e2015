"""The work of the engine's fused ops (``moe_engine::*``, ``moe_engine.kernels``) as their GPU path runs them.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.predict.traced import OpWork, TensorSpec, TracedOp, dtype_bytes

__all__ = ["FUSED_GEMMS", "FUSED_OPS", "FusedPart", "fused_work", "is_fused"]

NAMESPACE = "moe_engine"

_ONE_PASS = (
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "swiglu_backward",
    "swiglu_packed_backward",
    "rope",
    "rope_backward",
    "router_scores_backward",
)
_ROUTING = ("gather_rows", "gather_rows_backward", "combine_rows", "combine_rows_backward")
FUSED_OPS = (
    *_ONE_PASS,
    "rms_norm_backward",
    "router_scores",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    *_ROUTING,
    "gather_rows_mx",
    "grouped_wgrad_accumulate",
    "wgrad_accumulate",
)
"""Every fused op the engine registers, each with its rule above (a test holds the two lists equal)."""
FUSED_GEMMS = {"grouped_wgrad_accumulate": "grouped_gemm", "wgrad_accumulate": "gemm"}
"""Fused ops priced as the GEMM they are (``bench.predict.ops.op_work``), not as fused parts: their kind."""


@dataclass(frozen=True)
class FusedPart:
    """A kernel of a fused op, run ``count`` times with the same work."""

    count: int
    """Launches of this kernel in one call of the op."""
    work: OpWork
    """One launch's work (kind gemm or memory)."""


def is_fused(op: TracedOp) -> bool:
    """Whether ``op`` is one of the engine's fused ops."""
    return op.name.startswith(NAMESPACE + ".")


def _base(op: TracedOp) -> str:
    return op.name.split(".")[1]


def _moved(specs: tuple[TensorSpec, ...]) -> int:
    return sum(s.nbytes for s in specs)


def _memory(count: int, nbytes: float, dtype: str) -> FusedPart:
    return FusedPart(count, OpWork("memory", 0.0, nbytes, dtype))


def _gemm(count: int, m: int, n: int, k: int, s: int, dtype: str, accumulate: bool = False) -> FusedPart:
    """``count`` products (M, K) @ (K, N) -> (M, N); ``accumulate``: the output is read as well."""
    nbytes = (m * k + k * n + m * n * (2 if accumulate else 1)) * s
    return FusedPart(count, OpWork("gemm", 2.0 * m * n * k, nbytes, dtype, shape=(m, n, k)))


def _chunk_sizes(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """(count, rows) of the full chunks and of the shorter last one."""
    if rows == 0:
        return []
    chunk = min(chunk_rows, rows) if chunk_rows > 0 else rows
    full, last = divmod(rows, chunk)
    return [(n, r) for n, r in ((full, chunk), (1 if last else 0, last)) if n]


def _chunk_rows(op: TracedOp) -> int:
    chunk_rows = dict(op.arguments).get("chunk_rows")
    if not isinstance(chunk_rows, int):
        raise ValueError(f"{op.name}: the trace did not record chunk_rows; retrace with this version")
    return chunk_rows


def _cross_entropy_parts(op: TracedOp) -> list[FusedPart]:
    backward = _base(op).endswith("_backward")
    h, weight = (op.inputs[1], op.inputs[2]) if backward else (op.inputs[0], op.inputs[1])
    rows, width = h.shape
    vocab = weight.shape[0]
    s, dtype = dtype_bytes(h.dtype), h.dtype
    # The count of labelled rows: labels != ignore_index, its sum, the cast to fp32.
    parts = [_memory(1, 9 * rows, "torch.int64"), _memory(1, rows + 8, "torch.bool"), _memory(1, 12, "torch.int64")]
    for count, c in _chunk_sizes(rows, _chunk_rows(op)):
        if backward:
            parts += [
                _gemm(count, c, vocab, width, s, dtype),
                _memory(count, 2 * c * vocab * s + 12 * c + 4, dtype),
                _gemm(count, c, width, vocab, s, dtype),
                _gemm(count, vocab, width, c, s, dtype, accumulate=True),
            ]
        else:
            parts += [
                _gemm(count, c, vocab, width, s, dtype),
                _memory(count, c * vocab * s + 16 * c, dtype),
                _memory(2 * count, 8 * c, "torch.float32"),
            ]
    if backward:
        parts += [_memory(1, 12, "torch.float32"), _memory(1, vocab * width * s, dtype)]  # the scale, grad_W = 0
    else:
        parts += [_memory(1, 4 * rows + 4, "torch.float32"), _memory(1, 12, "torch.float32")]  # sum, mean
    return parts


def _routing_parts(op: TracedOp) -> list[FusedPart]:
    base = _base(op)
    index = sum(t.nbytes for t in op.inputs if t.dtype in ("torch.int64", "torch.bool"))
    rows = op.inputs[0]
    if base == "gather_rows":
        return [_memory(1, 2 * op.outputs[0].nbytes + index, rows.dtype)]
    if base == "gather_rows_backward":
        gathered = op.inputs[1].shape[0] * rows.shape[1] * dtype_bytes(rows.dtype)
        return [_memory(1, gathered + op.outputs[0].nbytes + index, rows.dtype)]
    # combine_rows(y, weight, row, ...), combine_rows_backward(grad, y, weight, row, ...)
    y, weight, row = op.inputs[:3] if base == "combine_rows" else op.inputs[1:4]
    width, assignments = y.shape[1], row.shape[0]
    gathered = assignments * width * dtype_bytes(y.dtype)
    moved = gathered + weight.nbytes + _moved(op.outputs) + index
    if base == "combine_rows":
        return [FusedPart(1, OpWork("memory", 2.0 * assignments * width, moved, y.dtype))]
    return [FusedPart(1, OpWork("memory", 4.0 * assignments * width, moved + rows.nbytes, y.dtype))]


def _gather_mx_part(op: TracedOp) -> FusedPart:
    # gather_rows_mx(x, assignment, top_k, filled, end) -> (codes, scales)
    x, assignment = op.inputs[0], op.inputs[1]
    index = sum(t.nbytes for t in op.inputs[1:] if t.dtype in ("torch.int64", "torch.int32", "torch.bool"))
    gathered = assignment.shape[0] * x.shape[1] * dtype_bytes(x.dtype)
    return _memory(1, gathered + _moved(op.outputs) + index, x.dtype)


def fused_parts(op: TracedOp) -> list[FusedPart]:
    """The kernels of one fused op as its GPU path runs them (docs/projection-formulas.md)."""
    base = _base(op)
    dtype = op.inputs[0].dtype if op.inputs else "torch.float32"
    if base in _ONE_PASS:
        return [_memory(1, _moved(op.inputs) + _moved(op.outputs), dtype)]
    if base == "rms_norm_backward":
        weight = op.inputs[-2]
        casts = 0 if weight.dtype == "torch.float32" else 1
        return [_memory(1, _moved(op.inputs) + _moved(op.outputs), dtype), _memory(1 + casts, 0.0, "torch.float32")]
    if base == "router_scores":
        return [_memory(1, _moved(op.inputs) + _moved(op.outputs), dtype), _memory(1, 0.0, "torch.float32")]
    if base in ("linear_cross_entropy", "linear_cross_entropy_backward"):
        return _cross_entropy_parts(op)
    if base in _ROUTING:
        return _routing_parts(op)
    if base == "gather_rows_mx":
        return [_gather_mx_part(op)]
    raise ValueError(
        f"{op.name} has no pricing rule: add it to bench/predict/fused_ops.py (known: {', '.join(FUSED_OPS)})"
    )


def fused_work(op: TracedOp) -> OpWork:
    """One fused op's work: its parts' FLOPs, bytes and kernels summed, the parts kept for pricing."""
    parts = tuple(fused_parts(op))
    flops = math.fsum(p.count * p.work.flops for p in parts)
    nbytes = math.fsum(p.count * p.work.nbytes for p in parts)
    dtype = op.inputs[0].dtype if op.inputs else "torch.float32"
    return OpWork("fused", flops, nbytes, dtype, parts=parts)
