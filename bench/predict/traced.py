"""The types a traced step is made of: a tensor as an op saw it, a traced op, and an op's work.

Shared by ``bench.predict.ops`` (which sorts ops into kinds and counts their work) and
``bench.predict.fused_ops`` (the work of the engine's fused ops). Pure data on the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["OpWork", "TensorSpec", "TracedOp", "dtype_bytes"]

_DTYPE_BYTES = {
    "torch.float64": 8,
    "torch.int64": 8,
    "torch.complex64": 8,
    "torch.float32": 4,
    "torch.int32": 4,
    "torch.uint32": 4,
    "torch.bfloat16": 2,
    "torch.float16": 2,
    "torch.int16": 2,
    "torch.uint16": 2,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e5m2": 1,
    "torch.float8_e8m0fnu": 1,
    "torch.int8": 1,
    "torch.uint8": 1,
    "torch.bool": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as an op saw it."""

    shape: tuple[int, ...]
    """Sizes."""
    dtype: str
    """``str(torch.dtype)``, e.g. ``torch.bfloat16``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class TracedOp:
    """One dispatched op of a traced step."""

    name: str
    """The op overload, e.g. ``aten.mm.default`` or ``c10d.allreduce_.default``."""
    inputs: tuple[TensorSpec, ...]
    """Tensor arguments in order (tensors inside list arguments included)."""
    outputs: tuple[TensorSpec, ...]
    """Tensor outputs in order."""
    stage: str
    """forward, backward (recompute included: it runs in the backward), optimizer, or other."""
    region: str | None = None
    """The engine function it runs inside (``REGIONS``), or None."""
    region_call: int | None = None
    """Which call of that function (consecutive ops of one call form one GPU kernel)."""
    group_rows: tuple[int, ...] | None = None
    """Grouped GEMMs: rows of each group along the grouped dim, from the routing; None elsewhere."""
    arguments: tuple[tuple[str, Any], ...] = ()
    """Named scalar arguments (bool, int, float), e.g. SDPA's ("is_causal", True)."""
    collective: dict[str, Any] | None = None
    """c10d ops: op, ranks, nbytes, group_name (``bench.run.collective_log.CollectiveCall``)."""
    location: str = ""
    """Where it ran: the engine modules on the call stack, a named part of the step (``@optimizer``),
    or "" outside both (``bench.run.trace.ModuleLocator``)."""

    @property
    def packet(self) -> str:
        """``aten.mm`` of ``aten.mm.default``."""
        return self.name.rsplit(".", 1)[0] if self.name.count(".") >= 2 else self.name

    def signature(self) -> tuple:
        """What must match between a traced and an executed step: the op and its tensors."""
        return (
            self.name,
            tuple((s.shape, s.dtype) for s in self.inputs),
            tuple((s.shape, s.dtype) for s in self.outputs),
            self.stage,
            self.group_rows,
        )


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} in a traced op") from None


@dataclass(frozen=True)
class OpWork:
    """The work of one op."""

    kind: str
    """``KINDS``."""
    flops: float
    """Floating-point operations (gemm, grouped_gemm, mx_gemm, attention); 0 elsewhere."""
    nbytes: float
    """Bytes read and written (every tensor argument and output)."""
    dtype: str
    """The dtype its rate is taken at: the first input's (an MX GEMM: mxfp8)."""
    groups: int = 1
    """Grouped GEMMs: groups of the product (its per-group FLOPs are flops / groups)."""
    backward: bool = False
    """Attention: the backward kernel (priced on a curve of its own where a profile has one)."""
    grouped_reduction: bool = False
    """Grouped GEMMs whose groups run along the reduction dim (weight gradients: one (N x rows) @
    (rows x K) product per group)."""
    shape: tuple[int, ...] = ()
    """GEMMs: (M, N, K), or (B, M, N, K) batched; grouped GEMMs: (groups, rows per group, N, K); for a
    profile whose curves were measured at shapes."""
    parts: tuple[Any, ...] = ()
    """Fused ops: their kernels (``bench.predict.fused_ops.FusedPart``: a count and one launch's work)."""

    @property
    def kernels(self) -> int:
        """GPU kernels the op launches: none for free ops, its parts' launches for a fused op, else one."""
        if self.parts:
            return sum(p.count for p in self.parts)
        return 0 if self.kind == "free" else 1
