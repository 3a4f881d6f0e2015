"""The dispatch rule: the Triton kernel on CUDA for fp32 and bf16 within its limits, the reference path
everywhere else, and every fallback says why (and warns once on CUDA, where the kernel was expected)."""

import warnings

import pytest
import torch

from moe_engine import kernels
from moe_engine.kernels import activation, cross_entropy, dispatch, norm, rotary

OPS = [
    "rms_norm",
    "swiglu",
    "linear_cross_entropy",
    "rope",
    "gather_rows",
    "combine_rows",
    "gather_rows_mx",
    "router_scores",
    "grouped_wgrad_accumulate",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_takes_the_triton_kernels(dtype):
    # The rule reads the device type only, so it is checked here without a GPU.
    paths = kernels.kernel_paths("cuda", dtype)
    assert list(paths) == OPS
    assert all(p.implementation == "triton" and p.details == "triton (CUDA)" for p in paths.values()), paths


def test_cpu_runs_the_reference_and_says_so():
    for op, path in kernels.kernel_paths("cpu", torch.bfloat16).items():
        assert path.implementation == "reference" and not path.fused
        assert path.details == "reference: the Triton kernel runs on CUDA devices, not cpu", op
    line = kernels.paths_details(kernels.kernel_paths("cpu", torch.float32))
    assert line.startswith("rms_norm: reference: the Triton kernel runs on CUDA devices, not cpu; swiglu: ")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_unsupported_dtype_on_cuda_falls_back_naming_it(dtype):
    name = str(dtype).removeprefix("torch.")
    paths = kernels.kernel_paths("cuda", dtype)
    # The router computes its logits in fp32 whatever the model's dtype.
    assert paths.pop("router_scores").fused
    for path in paths.values():
        assert path.implementation == "reference"
        assert path.details == f"reference: the Triton kernel takes float32 and bfloat16, not {name}"


def test_sizes_and_layouts_beyond_a_kernel_fall_back_naming_them():
    wide = norm.path("cuda", torch.bfloat16, norm.MAX_WIDTH + 1)
    assert not wide.fused and f"rows of {norm.MAX_WIDTH + 1} exceed" in wide.details
    assert norm.path("cuda", torch.bfloat16, norm.MAX_WIDTH).fused
    mixed = norm.path("cuda", torch.bfloat16, 64, torch.float32)
    assert not mixed.fused and "one dtype for all inputs, not bfloat16, float32" in mixed.details
    assert not activation.path("cuda", torch.float32, torch.bfloat16).fused
    assert "3-dim" in rotary.path("cuda", torch.float32, ndim=3).details
    assert "float16 tables" in rotary.path("cuda", torch.float32, table_dtype=torch.float16).details
    assert "LM head's weight is torch.float32" in cross_entropy.path("cuda", torch.bfloat16, torch.float32).details


def test_fallback_on_cuda_warns_once_and_cpu_never():
    path = norm.path("cuda", torch.float16)
    dispatch._warned.discard(("rms_norm", "cuda", path.details))
    with pytest.warns(RuntimeWarning, match="moe_engine::rms_norm runs its reference: the Triton kernel takes"):
        dispatch.note_fallback(path, torch.device("cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.note_fallback(path, torch.device("cuda"))  # already said
        dispatch.note_fallback(norm.path("cpu", torch.float32), torch.device("cpu"))


def test_cross_entropy_chunks_hold_about_the_hidden_states():
    # 8192 rows of width 4096 and a vocabulary of 151936: ceil(151936 / 4096) = 38 chunks' worth, so
    # ceil(8192 / 38) = 216 rows, rounded up to a power of two.
    assert cross_entropy.default_chunk_rows(8192, 4096, 151936) == 256
    assert cross_entropy.default_chunk_rows(5, 64, 50) == 5  # small vocabulary: one chunk, all rows
    assert cross_entropy.default_chunk_rows(0, 64, 50) == 1


def test_labels_must_match_the_hidden_states():
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not match hidden states \(2, 4, 8\)"):
        kernels.linear_cross_entropy(torch.randn(2, 4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long))


def test_rope_tables_must_cover_the_sequence():
    with pytest.raises(ValueError, match="the RoPE tables hold 4 positions, the input 6"):
        kernels.rope(torch.randn(1, 2, 6, 8), torch.randn(4, 8), torch.randn(4, 8))
