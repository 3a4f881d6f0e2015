"""``torch._grouped_mm`` behind one checked entry point, which CUDA path it takes, and the empty groups'
weight gradients it may leave unwritten there.

On CPU, ``torch._grouped_mm`` accepts operands that its CUDA kernel refuses: the CUDA kernel needs
int32 offsets, operands with unit stride in one of their last two dimensions and the other stride a
multiple of 16 bytes, and 16-byte aligned data pointers (TMA loads). A view into a flat gradient
bucket or a padded buffer can break the last two unseen until the first GPU run. ``grouped_mm``
asserts these preconditions on every device, so CPU tests refuse what a GPU would. The checks read
only shapes, strides and pointers: no device data, no host sync, cheap enough to leave on.

Which kernel runs (``grouped_mm_path``): the CUTLASS grouped GEMM only for bf16 operands on compute
capability 9.x and 10.x (Hopper; datacenter Blackwell: B200 is sm100, B300 sm103). Every other dtype
(fp32 included) and architecture (sm80, sm120) takes torch's fallback, a loop over the groups that reads the offsets on the host: one host
sync per group and GEMM. CPU always runs such a loop. The engine's "no host sync" guarantee for the
experts therefore holds for bf16 on sm9x/sm10x only; the code around the GEMMs is sync-free on
every device.
"""

from __future__ import annotations

from enum import Enum

import torch

ALIGNMENT_BYTES = 16
"""The CUDA kernel's alignment for strides and data pointers."""


class GroupedMMPath(str, Enum):
    """Which implementation ``torch._grouped_mm`` runs."""

    CUTLASS = "grouped-mm-cutlass"
    """The CUDA grouped GEMM kernel (bf16 on sm9x/sm10x): offsets stay on the device."""
    FALLBACK = "grouped-mm-host-loop"
    """A loop over groups that reads the offsets on the host (CPU; CUDA for other dtypes or GPUs)."""


class GroupedMMError(ValueError):
    """Operands that the CUDA grouped GEMM kernel would refuse (named operand, reason)."""


def grouped_mm_path(device: torch.device | str, dtype: torch.dtype) -> GroupedMMPath:
    """The kernel ``torch._grouped_mm`` runs for operands of ``dtype`` on ``device``."""
    device = torch.device(device)
    # torch's own test for its fast path is the major version alone (sm90, sm100, sm103 for B300).
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10):
        return GroupedMMPath.CUTLASS
    return GroupedMMPath.FALLBACK


def check_operand(name: str, t: torch.Tensor) -> None:
    """Raise ``GroupedMMError`` unless ``t`` has the layout and alignment the CUDA kernel needs."""
    if t.dim() not in (2, 3):
        raise GroupedMMError(f"{name}: 2-D or 3-D operand expected, got {t.dim()}-D")
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride, col_stride = t.stride()[-2], t.stride()[-1]
    if col_stride == 1 and row_stride >= max(1, cols):
        leading = row_stride
    elif row_stride == 1 and col_stride >= max(1, rows):
        leading = col_stride
    else:
        raise GroupedMMError(
            f"{name}: needs unit stride in one of its last two dims, got strides {tuple(t.stride())} "
            f"for shape {tuple(t.shape)}"
        )
    if (leading * t.element_size()) % ALIGNMENT_BYTES:
        raise GroupedMMError(
            f"{name}: leading stride {leading} x {t.element_size()} bytes is not a multiple of {ALIGNMENT_BYTES} "
            f"bytes (shape {tuple(t.shape)}, {t.dtype})"
        )
    if t.dim() == 3 and (t.stride(0) * t.element_size()) % ALIGNMENT_BYTES:
        raise GroupedMMError(f"{name}: group stride {t.stride(0)} is not a multiple of {ALIGNMENT_BYTES} bytes")
    # torch's allocators align every storage to at least 64 bytes, so the offset into the storage
    # decides the data pointer's alignment; reading it that way works on fake and meta tensors too.
    misaligned = (t.storage_offset() * t.element_size()) % ALIGNMENT_BYTES
    if t.numel() and misaligned:
        raise GroupedMMError(f"{name}: data pointer is not {ALIGNMENT_BYTES}-byte aligned (offset {misaligned})")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets_E)`` after checking the CUDA kernel's preconditions."""
    if offsets_E.dtype != torch.int32 or offsets_E.dim() != 1:
        raise GroupedMMError(f"offsets: 1-D int32 expected, got {offsets_E.dim()}-D {offsets_E.dtype}")
    if a.dtype != b.dtype:
        raise GroupedMMError(f"operands: one dtype expected, got {a.dtype} and {b.dtype}")
    check_operand("a", a)
    check_operand("b", b)
    return torch._grouped_mm(a, b, offs=offsets_E)


def kernel_zeroes_empty_groups(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` writes an empty group's weight gradient itself.

    The CPU kernel computes each group with its own matmul, so an empty group gets the empty sum, 0
    (``tests/unit/moe_engine/moe/test_grouped_gemm.py`` checks it). On CUDA, ``torch._grouped_mm`` on B200 is
    reported to leave it unwritten, so the engine zeroes it there.
    """
    return device.type == "cpu"


def zero_empty_experts_(grad_EXY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Zero the weight gradient of every expert that received no rows, in place, on the device,
    where the kernel does not already (``kernel_zeroes_empty_groups``): a pass over the whole
    gradient, about 3% of a CPU step of the 64-expert smoke model, is not paid where it is not needed.
    """
    if kernel_zeroes_empty_groups(grad_EXY.device):
        return grad_EXY
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return grad_EXY.masked_fill_((counts_E == 0).view(-1, 1, 1), 0)
