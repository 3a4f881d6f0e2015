"""Fused ops, each one ``torch.library.custom_op`` (so a trace sees one op each), with a Triton kernel
on CUDA and the eager PyTorch composition as the reference and CPU path (``dispatch`` holds the rule):
the memory-bound work of a step, a forward and a backward op each, and two GEMMs without a backward
that add weight gradients into the fp32 gradient buffer: the experts' (``grouped_wgrad_accumulate``) and
the dense projections' (``wgrad_accumulate``, cuBLAS on CUDA).
More: docs/kernels.md.
"""

from __future__ import annotations

import torch

from moe_engine.kernels import activation as _activation
from moe_engine.kernels import cross_entropy as _cross_entropy
from moe_engine.kernels import gather_mx as _gather_mx
from moe_engine.kernels import grouped_wgrad as _grouped_wgrad
from moe_engine.kernels import norm as _norm
from moe_engine.kernels import rotary as _rotary
from moe_engine.kernels import router as _router
from moe_engine.kernels import routing as _routing
from moe_engine.kernels.activation import swiglu, swiglu_packed, swiglu_packed_backward
from moe_engine.kernels.cross_entropy import linear_cross_entropy
from moe_engine.kernels.dispatch import KernelPath
from moe_engine.kernels.gather_mx import gather_rows_mx
from moe_engine.kernels.grouped_wgrad import grouped_wgrad_accumulate
from moe_engine.kernels.norm import add_rms_norm, rms_norm
from moe_engine.kernels.rotary import rope
from moe_engine.kernels.router import router_scores
from moe_engine.kernels.routing import combine_rows, gather_rows, gather_rows_backward
from moe_engine.kernels.wgrad import wgrad_accumulate

__all__ = [
    "KernelPath",
    "add_rms_norm",
    "combine_rows",
    "gather_rows",
    "gather_rows_backward",
    "gather_rows_mx",
    "grouped_wgrad_accumulate",
    "kernel_paths",
    "linear_cross_entropy",
    "paths_details",
    "rms_norm",
    "rope",
    "router_scores",
    "swiglu",
    "swiglu_packed",
    "swiglu_packed_backward",
    "wgrad_accumulate",
]


def kernel_paths(device: torch.device | str, dtype: torch.dtype) -> dict[str, KernelPath]:
    """Where each fused op runs for tensors of ``dtype`` on ``device`` (at sizes within the kernels' limits)."""
    return {
        "rms_norm": _norm.path(device, dtype),
        "swiglu": _activation.path(device, dtype),
        "linear_cross_entropy": _cross_entropy.path(device, dtype),
        "rope": _rotary.path(device, dtype),
        "gather_rows": _routing.path(device, dtype, op="gather_rows"),
        "combine_rows": _routing.path(device, dtype, op="combine_rows"),
        "gather_rows_mx": _gather_mx.path(device, dtype),
        # The router computes in fp32 whatever the model's dtype.
        "router_scores": _router.path(device, torch.float32),
        # The experts' weight gradients, from operands in the model's dtype into an fp32 buffer.
        "grouped_wgrad_accumulate": _grouped_wgrad.path(device, dtype),
    }


def paths_details(paths: dict[str, KernelPath]) -> str:
    """One line for a result's details: ``op: path`` for each op."""
    return "; ".join(f"{op}: {path.details}" for op, path in paths.items())
