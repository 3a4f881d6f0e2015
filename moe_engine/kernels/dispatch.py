"""Which implementation a fused op runs: its Triton kernel, or the eager PyTorch composition it fuses.

The rule: the Triton kernel for tensors on a CUDA device, in a dtype the kernel takes (fp32, bf16),
within the kernel's size limits; CPU tensors too when the kernels were defined under
``TRITON_INTERPRET=1`` (Triton's interpreter runs them on CPU arrays: that is how they are tested
without a GPU). Everything else runs the reference composition, which is also the CPU path.

A fallback is never silent: ``KernelPath.details`` says why the reference runs, the model reports
every op's path (``Transformer.fused_kernel_paths``), and a fallback on a CUDA device, where the
kernel was expected, warns once per op, dtype and reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import triton

TRITON = "triton"
REFERENCE = "reference"

TRITON_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes every Triton kernel here takes (and stores back exactly, with round-to-nearest-even)."""

_warned: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class KernelPath:
    """Where one fused op runs for a device and dtype."""

    op: str
    """The op's name in the ``moe_engine`` namespace (``rms_norm``, ``swiglu``, ...)."""
    implementation: str
    """``triton`` or ``reference`` (the eager composition)."""
    details: str
    """One line: the kernel, or why the reference runs instead."""

    @property
    def fused(self) -> bool:
        return self.implementation == TRITON


def interpreted(kernel) -> bool:
    """Whether ``kernel`` was defined under TRITON_INTERPRET=1 (then it runs on CPU tensors)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def choose(op: str, device: torch.device | str, dtype: torch.dtype, kernel, limit: str | None = None) -> KernelPath:
    """The path of ``op`` for tensors of ``dtype`` on ``device``. ``kernel``: one of the op's Triton
    kernels (to tell whether the interpreter defined it); ``limit``: why these sizes exceed the
    kernel's limits, or None when they do not."""
    device = torch.device(device)
    if device.type == "cuda":
        where = "CUDA"
    elif device.type == "cpu" and interpreted(kernel):
        where = "CPU under TRITON_INTERPRET=1"
    else:
        return KernelPath(op, REFERENCE, f"reference: the Triton kernel runs on CUDA devices, not {device.type}")
    if dtype not in TRITON_DTYPES:
        names = " and ".join(str(d).removeprefix("torch.") for d in TRITON_DTYPES)
        given = str(dtype).removeprefix("torch.")
        return KernelPath(op, REFERENCE, f"reference: the Triton kernel takes {names}, not {given}")
    if limit is not None:
        return KernelPath(op, REFERENCE, f"reference: {limit}")
    return KernelPath(op, TRITON, f"triton ({where})")


def note_fallback(path: KernelPath, device: torch.device) -> None:
    """Warn once when an op falls back on a CUDA device (on CPU the reference is the intended path)."""
    if path.fused or device.type != "cuda":
        return
    key = (path.op, str(device.type), path.details)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"moe_engine::{path.op} runs its {path.details}", RuntimeWarning, stacklevel=3)
