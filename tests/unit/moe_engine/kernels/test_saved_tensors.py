"""What the fused ops keep for backward: SwiGLU only its two inputs, the fused loss no logits (h, the
weight, the labels and one fp32 logsumexp per row), RoPE only its tables; the eager compositions keep
more (silu(gate); the (N, V) fp32 log-probabilities)."""

import torch
import torch.nn.functional as F
from op_recording import saved_while

from moe_engine import kernels


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def test_swiglu_keeps_only_its_inputs(device):
    gate, up = (torch.randn(64, 48, device=device, requires_grad=True) for _ in range(2))
    saved = saved_while(lambda: kernels.swiglu(gate, up))
    assert len(saved) == 2 and same(saved[0], gate) and same(saved[1], up)
    eager = saved_while(lambda: F.silu(gate) * up)
    assert sum(t.numel() for t in eager) == 3 * gate.numel()  # gate, silu(gate), up


def test_fused_loss_keeps_no_logits(device):
    rows, width, vocab = 40, 16, 300
    h = torch.randn(rows, width, device=device, requires_grad=True)
    weight = torch.randn(vocab, width, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device=device)
    saved = saved_while(lambda: kernels.linear_cross_entropy(h, weight, labels))
    assert [tuple(t.shape) for t in saved] == [(rows, width), (vocab, width), (rows,), (rows,)]
    assert same(saved[0], h) and same(saved[1], weight) and saved[3].dtype == torch.float32
    eager = saved_while(lambda: F.cross_entropy(F.linear(h, weight).float(), labels))
    assert any(t.shape == (rows, vocab) for t in eager)


def test_rope_keeps_only_its_tables(device):
    x = torch.randn(2, 3, 8, 16, device=device, requires_grad=True)
    cos, sin = torch.randn(32, 16, device=device), torch.randn(32, 16, device=device)
    saved = saved_while(lambda: kernels.rope(x, cos, sin))
    assert [tuple(t.shape) for t in saved] == [(8, 16), (8, 16)]
    assert all(t.data_ptr() in (cos.data_ptr(), sin.data_ptr()) for t in saved)


def test_rms_norm_keeps_its_input_and_one_value_per_row(device):
    x, residual = (torch.randn(5, 7, 64, device=device, requires_grad=True) for _ in range(2))
    weight = torch.ones(64, device=device, requires_grad=True)
    saved = saved_while(lambda: kernels.rms_norm(x, weight, 1e-5))
    assert [tuple(t.shape) for t in saved] == [(5, 7, 64), (64,), (5, 7)] and same(saved[0], x)
    saved = saved_while(lambda: kernels.add_rms_norm(x, residual, weight, 1e-5))
    assert [tuple(t.shape) for t in saved] == [(5, 7, 64), (64,), (5, 7)]  # h = residual + x, not x and residual
