"""bf16 GEMMs in fp32 (``moe_engine.precision.cpu_bf16``): each op under the mode against an fp64
product of the same bf16 operands rounded once to bf16, forward and backward, and a whole training
step in which no bf16 GEMM reaches ATen. The mode is applied directly, so these run on any CPU."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_bf16_trainer
from tolerances import assert_close_to_scale, tolerance
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine.precision import cpu_bf16
from moe_engine.precision.cpu_bf16 import BF16GemmsInFp32

aten = torch.ops.aten
SEED = 20261203
GEMMS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._grouped_mm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


def bf16(*shape, generator):
    return torch.randn(*shape, generator=generator).bfloat16()


def grads(fn, inputs, grad_out):
    """Output and input gradients of ``fn`` (inputs are leaf copies that require grad)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def check_against_fp64(fn, inputs, k, generator):
    """``fn`` on bf16 inputs under the mode against ``fn`` on the same values in fp64, rounded to bf16:
    output and every input gradient, in bf16, within the rounding of a k-term fp32 sum."""
    print(f"seed {SEED}")
    with torch.no_grad():
        shape = fn(*inputs).shape
    grad_out = torch.randn(shape, generator=generator).bfloat16()
    with BF16GemmsInFp32():
        out, input_grads = grads(fn, inputs, grad_out)
    ref_out, ref_grads = grads(fn, [t.double() for t in inputs], grad_out.double())
    assert out.dtype == torch.bfloat16
    assert_close_to_scale(out.double(), ref_out.bfloat16().double(), tolerance(torch.bfloat16, k), "output")
    for i, (g, ref) in enumerate(zip(input_grads, ref_grads)):
        assert g.dtype == torch.bfloat16, f"gradient {i} is {g.dtype}"
        assert_close_to_scale(g.double(), ref.bfloat16().double(), tolerance(torch.bfloat16, k), f"gradient {i}")


def test_mm_addmm_bmm_baddbmm_against_fp64():
    gen = torch.Generator().manual_seed(SEED)
    x, w, b = bf16(37, 96, generator=gen), bf16(53, 96, generator=gen), bf16(53, generator=gen)
    check_against_fp64(lambda x, w: x @ w.t(), [x, w], 96, gen)
    check_against_fp64(lambda x, w, b: F.linear(x, w, b), [x, w, b], 96, gen)  # addmm
    p, q, c = bf16(3, 17, 40, generator=gen), bf16(3, 40, 29, generator=gen), bf16(3, 17, 29, generator=gen)
    check_against_fp64(torch.bmm, [p, q], 40, gen)
    check_against_fp64(lambda c, p, q: torch.baddbmm(c, p, q, alpha=0.5), [c, p, q], 40, gen)


def test_grouped_mm_against_per_expert_fp64():
    """Experts of 5, 0 and 11 rows and 4 padding rows past the last offset (which stay zero)."""
    gen = torch.Generator().manual_seed(SEED)
    offsets = torch.tensor([5, 5, 16], dtype=torch.int32)
    a, w = bf16(20, 48, generator=gen), bf16(3, 48, 24, generator=gen)
    with BF16GemmsInFp32():
        out = torch._grouped_mm(a, w, offs=offsets)
    assert out.dtype == torch.bfloat16
    ref = torch.zeros(20, 24, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        ref[start:end] = a[start:end].double() @ w[e].double()
        start = end
    assert_close_to_scale(out[:16].double(), ref[:16].bfloat16().double(), tolerance(torch.bfloat16, 48))


def test_flash_attention_forward_backward_against_fp64():
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (bf16(2, 4, 33, 16, generator=gen) for _ in range(3))
    check_against_fp64(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v], 33, gen)


def test_flash_attention_logsumexp_keeps_the_native_dtype():
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (bf16(1, 2, 9, 8, generator=gen) for _ in range(3))
    native = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    with BF16GemmsInFp32():
        mode = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    assert [t.dtype for t in mode] == [t.dtype for t in native]


def test_fp32_ops_and_others_pass_through_unchanged():
    gen = torch.Generator().manual_seed(SEED)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(16, 4, generator=gen)
    with BF16GemmsInFp32():
        assert torch.equal(x @ w, x @ w)
        y = x.bfloat16() * 3
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.bfloat16() * 3)


class _GemmDtypes(TorchDispatchMode):
    """Below the mode: records the dtype of every GEMM that reaches ATen."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.seen.append((str(func), args[0].dtype))
        return func(*args, **(kwargs or {}))


def test_no_bf16_gemm_of_a_training_step_reaches_aten():
    config, trainer = tiny_bf16_trainer(SEED)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    with _GemmDtypes() as below, BF16GemmsInFp32():
        trainer.step(tokens[:, :-1], tokens[:, 1:])
    ops = {op for op, _ in below.seen}
    assert {"aten.mm.default", "aten._grouped_mm.default"} <= ops, ops  # forward and backward GEMMs seen
    assert any("flash_attention_for_cpu_backward" in op for op in ops), ops
    assert [s for s in below.seen if s[1] == torch.bfloat16] == []


def test_training_steps_match_native_bf16():
    """Three steps with and without the mode: the losses agree within the rounding of the step's chain
    (its longest sums are the weight gradients' over the batch's tokens)."""
    config, native = tiny_bf16_trainer(SEED)
    _, moded = tiny_bf16_trainer(SEED)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(3):
        tokens = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), generator=gen)
        expected = float(native.step(tokens[:, :-1], tokens[:, 1:]))
        with BF16GemmsInFp32():
            actual = float(moded.step(tokens[:, :-1], tokens[:, 1:]))
        depth = 4 * config.n_layers + 2  # per block: attention and experts, forward and back; head and loss
        assert math.isclose(actual, expected, rel_tol=tolerance(torch.bfloat16, 4 * config.seq_len, depth))


def test_applies_only_to_bf16_on_a_cpu_without_bf16_arithmetic():
    assert cpu_bf16.applies("cpu", torch.bfloat16) is not cpu_bf16.native_bf16_gemms()
    assert not cpu_bf16.applies("cpu", torch.float32)
    assert not cpu_bf16.applies("meta", torch.bfloat16)
    kind = type(cpu_bf16.bf16_gemms_in_fp32("cpu", torch.bfloat16))
    assert (kind is BF16GemmsInFp32) is cpu_bf16.applies("cpu", torch.bfloat16)
    details = cpu_bf16.gemm_details("cpu", torch.bfloat16)
    assert details == "native" or "no bf16 arithmetic" in details


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mode_may_be_entered_again(dtype):
    gemms = cpu_bf16.bf16_gemms_in_fp32("cpu", dtype)
    x = torch.ones(2, 2, dtype=dtype)
    for _ in range(2):
        with gemms:
            assert (x @ x).dtype == dtype


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_weight_gradients_added_into_the_buffer_run_their_gemm_in_fp32(grouped):
    """The ops that add a weight gradient into the fp32 buffer (``moe_engine::wgrad_accumulate`` and its
    grouped twin) run their GEMM inside, below any mode: the mode runs their reference composition, so
    that the product is computed in fp32, rounded to bf16 and added, bit for bit the two passes of the
    ``.grad`` path under the mode, and no bf16 GEMM reaches ATen."""
    from moe_engine import kernels
    from moe_engine.kernels import wgrad

    gen = torch.Generator().manual_seed(SEED)
    a, b = bf16(21, 24, generator=gen), bf16(21, 16, generator=gen)
    offsets = torch.tensor([9, 9, 21], dtype=torch.int32)
    out = torch.randn((3, 24, 16) if grouped else (24, 16), generator=gen)
    want = out.clone()
    with BF16GemmsInFp32():
        if grouped:
            want.add_(torch._grouped_mm(a.t(), b, offs=offsets))
        else:
            want.add_(wgrad.weight_grad(a, b))
    with _GemmDtypes() as below, BF16GemmsInFp32():
        if grouped:
            kernels.grouped_wgrad_accumulate(a, b, offsets, out)
        else:
            kernels.wgrad_accumulate(a, b, out)
    assert below.seen and all(dtype == torch.float32 for _, dtype in below.seen), below.seen
    assert torch.equal(out, want)
