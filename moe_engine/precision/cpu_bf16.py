"""bf16 GEMMs on a CPU without bf16 arithmetic: computed in fp32 from the bf16 operands, rounded once.
More: docs/precision.md.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ROUNDED_OUTPUTS = {
    # op -> how many of its leading outputs are bf16 in the native op (the rest stay as computed:
    # the flash attention's logsumexp is fp32 for bf16 inputs too)
    aten.mm.default: 1,
    aten.addmm.default: 1,
    aten.bmm.default: 1,
    aten.baddbmm.default: 1,
    aten._grouped_mm.default: 1,
    aten._scaled_dot_product_flash_attention_for_cpu.default: 1,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 3,
}


def _accumulating_references() -> dict:
    """The engine's ops that add a GEMM's product into a buffer (the weight gradients added into the fp32
    gradient buffer), each with its reference composition: a GEMM and an add, which this mode then runs."""
    # heavy: the kernels package registers the ops; imported when the mode first meets one
    from moe_engine.kernels import grouped_wgrad, wgrad

    return {
        torch.ops.moe_engine.wgrad_accumulate.default: wgrad.reference_accumulate,
        torch.ops.moe_engine.grouped_wgrad_accumulate.default: grouped_wgrad.reference_accumulate,
    }


def native_bf16_gemms() -> bool:
    """Whether this CPU's bf16 GEMMs run on bf16 instructions (oneDNN), the test ATen itself applies."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _is_bf16(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16


def _upcast(value: object) -> object:
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value


class BF16GemmsInFp32(TorchDispatchMode):
    """While active, each CPU bf16 GEMM and flash attention (forward and backward) runs in fp32 on
    fp32 copies of its bf16 operands, and its bf16 outputs are rounded back once; the weight-gradient
    ops that add a GEMM into a buffer run their GEMM and add the same way."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "moe_engine" and any(_is_bf16(a) for a in args):
            reference = _accumulating_references().get(func)
            if reference is not None:
                # The op's GEMM runs inside it, where this mode no longer sees it: its reference
                # composition instead, its GEMM under a mode of its own, as before the op existed.
                with BF16GemmsInFp32():
                    return reference(*args, **kwargs)
        rounded = _ROUNDED_OUTPUTS.get(func)
        if rounded is None or not any(_is_bf16(a) for a in args):
            return func(*args, **kwargs)
        out = func(*[_upcast(a) for a in args], **{k: _upcast(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return out.to(torch.bfloat16)
        return type(out)(t.to(torch.bfloat16) if i < rounded else t for i, t in enumerate(out))


def applies(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``bf16_gemms_in_fp32`` changes anything for a model of ``dtype`` on ``device``."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and not native_bf16_gemms()


def bf16_gemms_in_fp32(device: torch.device | str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """A ``BF16GemmsInFp32`` where it ``applies`` (a bf16 model on a CPU without bf16 arithmetic), else a
    context that does nothing. Either may be entered again and again."""
    return BF16GemmsInFp32() if applies(device, dtype) else contextlib.nullcontext()


def gemm_details(device: torch.device | str, dtype: torch.dtype) -> str:
    """One line for a result's details: how the step's GEMMs ran."""
    if applies(device, dtype):
        return "bf16 operands, fp32 products rounded to bf16 (this CPU has no bf16 arithmetic)"
    return "native"
