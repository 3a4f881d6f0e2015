"""The fused loss's bf16 LM-head weight gradient is as accurate as eager's.

The fused loss recomputes the logits in chunks of rows, so grad_weight is a sum over chunks. Summed in
bf16, every chunk adds one more rounding; summed in fp32 and cast once, the error is eager's (one GEMM
over all rows with fp32 accumulation, rounded once). The case: 8,192 rows x 256 x a 2,048 vocabulary
in bf16, 64 chunks of 128 rows, against the same function in fp64. On the device of the run: the
reference path on a CPU runs the same chunk loop as the Triton path on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from moe_engine.kernels import cross_entropy
from moe_engine.kernels.cross_entropy import IGNORE_INDEX, linear_cross_entropy

ROWS, WIDTH, VOCAB, CHUNK_ROWS = 8192, 256, 2048, 128


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(ROWS, WIDTH, generator=g)
    weight = torch.randn(VOCAB, WIDTH, generator=g) * (2.0 / WIDTH**0.5)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[::11] = IGNORE_INDEX
    return h.to(device), weight.to(device), labels.to(device)


def _grad_weight(loss_fn, h, weight, labels, dtype):
    weight = weight.to(dtype).requires_grad_()
    loss_fn(h.to(dtype), weight, labels).backward()
    return weight.grad.double()


def _eager(h, weight, labels):
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=IGNORE_INDEX)


def _fused(h, weight, labels):
    return linear_cross_entropy(h, weight, labels, IGNORE_INDEX, CHUNK_ROWS)


def _relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def _errors(device) -> tuple[float, float]:
    """(fused, eager) relative error of the bf16 weight gradient against fp64."""
    h, weight, labels = _inputs(device)
    want = _grad_weight(_eager, h, weight, labels, torch.float64)
    fused = _relative_error(_grad_weight(_fused, h, weight, labels, torch.bfloat16), want)
    eager = _relative_error(_grad_weight(_eager, h, weight, labels, torch.bfloat16), want)
    return fused, eager


def _within_twice_eager(device) -> tuple[bool, float, float]:
    fused, eager = _errors(device)
    return fused <= 2 * eager, fused, eager


@pytest.mark.slow
def test_bf16_weight_gradient_is_within_twice_eager_error(device):
    ok, fused, eager = _within_twice_eager(device)
    assert ok, f"fused bf16 grad_weight error {fused:.2e} vs eager {eager:.2e} (fp64 reference)"
    assert eager > 0


@pytest.mark.slow
def test_a_bf16_accumulator_fails_the_check(device, monkeypatch):
    """The check can fail: the accumulator rounded to bf16 after every chunk (what summing in the
    weight's dtype does) puts the fused error past twice eager's."""

    def add_in_bf16(acc32, a, b):
        acc32.copy_(acc32.to(a.dtype).addmm_(a, b))

    monkeypatch.setattr(cross_entropy, "_add_product_f32", add_in_bf16)
    ok, fused, eager = _within_twice_eager(device)
    assert not ok, f"a bf16 accumulator passed: {fused:.2e} vs eager {eager:.2e}"
