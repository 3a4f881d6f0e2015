"""Run by ``interpreted_kernels.run_interpreted`` in a fresh process with TRITON_INTERPRET=1 (Triton
decides between compiling and interpreting when a kernel is defined, at import): every fused op's case
through the Triton kernels on CPU tensors (the routing ops' and the router's cases too, when given), the
storage helpers on chosen bit patterns, and a small model with fused kernels, as the inputs ask. Usage:
interpreter_child.py INPUTS OUTPUTS (both ``torch.save`` files)."""

import sys

import torch
import triton
import triton.language as tl
from fused_cases import DTYPES, case_id, run_fused, run_router

from moe_engine import ModelConfig, build_model, kernels
from moe_engine.kernels.storage import load_f32, round_f32, store_f32


@triton.jit
def _storage_round_trip(x_ptr, bits_ptr, rounded_ptr, widened_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    store_f32(bits_ptr, offsets, x, mask, True)
    tl.store(rounded_ptr + offsets, round_f32(x, True), mask=mask)
    tl.store(widened_ptr + offsets, load_f32(bits_ptr, offsets, mask, True), mask=mask)


def storage_round_trip(x: torch.Tensor) -> dict[str, torch.Tensor]:
    bits = torch.empty(x.shape, dtype=torch.int16)
    rounded, widened = torch.empty_like(x), torch.empty_like(x)
    block = 1024
    _storage_round_trip[(triton.cdiv(x.numel(), block),)](x, bits, rounded, widened, x.numel(), BLOCK=block)
    return {"bits": bits, "rounded": rounded, "widened": widened}


def main(inputs_path: str, outputs_path: str) -> None:
    inputs = torch.load(inputs_path)
    outputs = {
        "paths": {
            dtype: {op: p.implementation for op, p in kernels.kernel_paths("cpu", DTYPES[dtype]).items()}
            for dtype in DTYPES
        }
    }
    if "cases" in inputs:
        outputs["ops"] = {
            (case_id(case), dtype): run_fused(case, DTYPES[dtype]) for case in inputs["cases"] for dtype in DTYPES
        }
        outputs["storage"] = storage_round_trip(inputs["storage"])
    if "routing_cases" in inputs:
        outputs["routing"] = {
            (case_id(case), dtype): run_fused(case, DTYPES[dtype])
            for case in inputs["routing_cases"]
            for dtype in DTYPES
        }
    if "router_cases" in inputs:
        outputs["router_ran"] = kernels.kernel_paths("cpu", torch.float32)["router_scores"].implementation
        outputs["router"] = {case_id(case): run_router(case, fused=True) for case in inputs["router_cases"]}
    if "model_config" in inputs:
        model = build_model(ModelConfig(**inputs["model_config"]), seed=inputs["model_seed"])
        loss = model.loss(inputs["tokens"], inputs["labels"])
        loss.backward()
        outputs["model"] = {"loss": loss.detach(), **{name: p.grad for name, p in model.named_parameters()}}
    torch.save(outputs, outputs_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
