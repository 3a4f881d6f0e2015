"""Seconds of each traced op on a device profile.
More: docs/projection-formulas.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.predict.device import DeviceProfile
from bench.predict.ops import OpWork, TracedOp, op_work, region_op

__all__ = ["STAND_IN_LOCATIONS", "PricedOp", "is_stand_in", "op_seconds", "price_ops", "rate_dtype"]

STAND_IN_LOCATIONS = ("@proxy_peers",)
"""Where a traced op runs as the proxy's stand-in for its simulated peers (``TracedOp.location``)."""

_RATE_DTYPE = {
    "torch.float32": "fp32",
    "torch.float64": "fp32",
    "torch.bfloat16": "bf16",
    "torch.float16": "bf16",
    "torch.float8_e4m3fn": "fp8",
    "torch.float8_e5m2": "fp8",
    "mxfp8": "mxfp8",
}


def rate_dtype(dtype: str) -> str:
    """The peak a dtype's GEMMs run at (``RATE_DTYPES``); integer ops count as fp32."""
    return _RATE_DTYPE.get(dtype, "fp32")


@dataclass(frozen=True)
class PricedOp:
    """One op with its price."""

    op: TracedOp
    """As traced."""
    work: OpWork
    """Its work (for a region's first op: the whole region's; later ops of the region: none)."""
    seconds: float
    """Its seconds on the profile (a region's on its first op, 0 on the rest)."""


def op_seconds(work: OpWork, profile: DeviceProfile) -> float:
    """Seconds of one op's work on ``profile`` (docs/projection-formulas.md)."""
    if work.kind == "collective":
        return 0.0
    kernel = _kernel_seconds(work, profile)
    host = profile.efficiency.get("host_op_us")
    if profile.kind == "cpu" and host is not None:
        # The host is the device: it runs the kernel and its own code around each op, one after the other.
        return (0.0 if work.kind == "free" else kernel) + host * 1e-6
    return kernel


def _kernel_seconds(work: OpWork, profile: DeviceProfile) -> float:
    eff = profile.efficiency
    overhead = eff["launch_overhead_us"] * 1e-6
    if work.kind == "collective":
        return 0.0
    if work.kind == "free":
        return eff.get("free_op_us", 0.0) * 1e-6 if profile.kind == "cpu" else 0.0
    if work.kind == "fused":
        return sum(part.count * _kernel_seconds(part.work, profile) for part in work.parts)
    dtype = rate_dtype(work.dtype)
    memory_s = work.nbytes / (profile.hbm_gbps * 1e9 * eff["memory"])
    if work.kind == "memory":
        curve = profile.curve("memory", dtype) or profile.curve("memory", "fp32") or profile.curve("memory", "any")
        return curve.seconds(work.nbytes) if curve else memory_s + overhead
    curve_kind = "grouped_gemm" if work.kind in ("grouped_gemm", "mx_gemm") else work.kind
    curve = profile.curve(curve_kind, dtype)
    if work.kind == "attention" and work.backward:
        curve = profile.curve("attention_backward", dtype) or curve
    if curve is not None:
        gemm_curve = profile.curve("gemm", dtype)
        if curve_kind == "grouped_gemm" and work.grouped_reduction and work.shape and gemm_curve is not None:
            groups, rows, n, k = work.shape
            return groups * gemm_curve.seconds_at_shape((n, k, rows), work.flops / groups)
        if curve_kind == "grouped_gemm" and work.shape:
            return work.groups * curve.seconds_at_shape(work.shape, work.flops / work.groups)
        if curve_kind == "grouped_gemm":
            return work.groups * curve.seconds(work.flops / work.groups)
        if work.kind == "gemm" and work.shape:
            return curve.seconds_at_shape(work.shape, work.flops)
        return curve.seconds(work.flops)
    peak = profile.peak_tflops[dtype] * 1e12
    if work.kind == "attention":
        return work.flops / (peak * eff["attention"]) + overhead
    efficiency = eff["gemm"] if work.kind == "gemm" else eff["grouped_gemm"]
    return max(work.flops / (peak * efficiency), memory_s) + overhead


def is_stand_in(op: TracedOp) -> bool:
    """Whether ``op`` is the proxy's stand-in for its peers, run by no real rank (docs/projection-formulas.md)."""
    return op.location in STAND_IN_LOCATIONS


def _no_work(op: TracedOp) -> OpWork:
    dtype = op.inputs[0].dtype if op.inputs else (op.outputs[0].dtype if op.outputs else "torch.float32")
    return OpWork("free", 0.0, 0.0, dtype)


def price_ops(ops: Sequence[TracedOp], profile: DeviceProfile) -> list[PricedOp]:
    """Every op of a trace with its seconds, in order (regions and stand-ins as docs/projection-formulas.md says)."""
    priced: list[PricedOp] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if is_stand_in(op):
            priced.append(PricedOp(op, _no_work(op), 0.0))
            i += 1
            continue
        if op.region is None or profile.kind == "cpu":
            work = op_work(op)
            priced.append(PricedOp(op, work, op_seconds(work, profile)))
            i += 1
            continue
        j = i
        while j < len(ops) and ops[j].region == op.region and ops[j].region_call == op.region_call:
            j += 1
        work = region_op(ops[i:j], op.region)
        priced.append(PricedOp(op, work, op_seconds(work, profile)))
        none = OpWork("free", 0.0, 0.0, work.dtype)
        priced.extend(PricedOp(o, none, 0.0) for o in ops[i + 1 : j])
        i = j
    return priced
