"""Each fused op (``moe_engine.kernels``) against the eager composition the model runs without it,
forward + backward, side by side in one run.

Each pair stores the same work in ``extra_info``: the bytes the fused op's kernels move forward and
backward, as the projection prices them (``bench.predict.fused_ops``, from the ops recorded in one
fused step). The conftest's ratios ``fused_over_eager_<op>`` are then eager seconds / fused seconds
(above 1: the fused op is faster), and the summary prints each one's achieved GB/s, which
``bench/gpu-check.sh`` sets beside the device profile's memory rate. Each also stores ``peak_bytes``,
the step's peak memory above its inputs (the CUDA allocator's, or tracked tensor bytes on a CPU). The
fused loss is judged on it, not on time: it runs one more GEMM of the LM head's size than eager by
design (the logits are recomputed in backward), and what it buys is never holding the (N, V) logits;
its ratio is eager peak bytes / fused peak bytes.

Sizes: on CUDA a 47B-like layer's rows (16,384 tokens of width 4,096, bf16; the router's 128 experts,
top-8, in fp32 as it computes; the MXFP8 gather's 8 rows a token; the loss over 8,192 tokens and a
50,304-token vocabulary); on a CPU
small fp32 ones, so that the suite's smoke run takes
seconds (there both sides run the eager composition: the ratio is about 1 by construction).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench.micro import FUSED_OPS
from bench.predict.fused_ops import fused_work
from bench.predict.ops import TensorSpec, TracedOp
from bench.run.memory import TensorMemoryTracker
from moe_engine import kernels
from moe_engine.config import MoEConfig
from moe_engine.kernels import gather_mx
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding
from moe_engine.moe.router import Router

ROUNDS = 5
OPS = FUSED_OPS


def _sizes(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return dict(rows=16384, width=4096, hidden=1792, heads=32, seq=4096, head_dim=128, vocab=50304, loss_rows=8192)
    return dict(rows=256, width=256, hidden=128, heads=4, seq=64, head_dim=32, vocab=1024, loss_rows=128)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _case(op: str, fused: bool, device: torch.device):
    """(inputs that need gradients, a function of them returning a tensor to backpropagate)."""
    s, dtype = _sizes(device), _dtype(device)
    torch.manual_seed(0)

    def leaf(*shape, std=1.0):
        return (torch.randn(*shape, device=device) * std).to(dtype).requires_grad_()

    if op in ("rms_norm", "add_rms_norm"):
        norm = RMSNorm(s["width"], 1e-6, fused_kernels=fused).to(device=device, dtype=dtype)
        x, residual = leaf(s["rows"], s["width"]), leaf(s["rows"], s["width"])
        if op == "rms_norm":
            return [x], lambda: norm(x)
        return [x, residual], lambda: torch.cat(norm(x, residual), dim=-1)
    if op == "router_scores":
        # 128 experts, top-8, learned routing with the balance and z losses: the router after its GEMM.
        router = Router(
            s["width"],
            MoEConfig(num_experts=128, top_k=8, expert_hidden=s["hidden"], aux_loss_weight=0.01, z_loss_weight=0.001),
            fused_kernels=fused,
        ).to(device)
        torch.nn.init.normal_(router.weight, std=0.02)
        x = leaf(s["rows"], s["width"])

        def route():
            out = router(x)
            return out.weight_TK.sum() + out.loss

        return [x], route
    if op == "swiglu":
        gate, up = leaf(s["rows"], s["hidden"]), leaf(s["rows"], s["hidden"])
        return [gate, up], (lambda: kernels.swiglu(gate, up)) if fused else (lambda: F.silu(gate) * up)
    if op == "rope":
        rope = RotaryEmbedding(s["head_dim"], s["seq"], 10000.0, fused_kernels=fused).to(device)
        q, k = leaf(1, s["heads"], s["seq"], s["head_dim"]), leaf(1, s["heads"], s["seq"], s["head_dim"])
        return [q, k], lambda: torch.cat(rope(q, k), dim=-1)
    if op == "gather_rows_mx":
        # The MXFP8 experts' first operand from the token rows, top-8: forward only (its outputs are
        # codes; the gradient goes through the gather's backward, timed with the routing ops).
        x = leaf(s["rows"], s["width"]).detach()
        assignment = torch.randperm(8 * s["rows"], device=device)
        end = torch.tensor([assignment.numel()], dtype=torch.int32, device=device)
        if fused:
            return [], lambda: kernels.gather_rows_mx(x, assignment, 8, None, end)[0]
        return [], lambda: gather_mx.reference_gather_mx(x, assignment, 8, None, end)[0]
    h, weight = leaf(s["loss_rows"], s["width"]), leaf(s["vocab"], s["width"], std=0.02)
    labels = torch.randint(0, s["vocab"], (s["loss_rows"],), device=device)
    if fused:
        return [h, weight], lambda: kernels.linear_cross_entropy(h, weight, labels)
    return [h, weight], lambda: F.cross_entropy(F.linear(h, weight).float(), labels)


class _FusedOps(TorchDispatchMode):
    """The engine's fused ops of a step, as the trace records them (shapes, dtypes, scalar arguments)."""

    def __init__(self):
        super().__init__()
        self.ops: list[TracedOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "moe_engine":

            def specs(values):
                flat = [v for v in values if isinstance(v, torch.Tensor)]
                return tuple(TensorSpec(tuple(t.shape), str(t.dtype)) for t in flat)

            named = tuple(
                (a.name, v) for a, v in zip(func._schema.arguments, args) if isinstance(v, (bool, int, float))
            )
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            self.ops.append(TracedOp(str(func), specs(args), specs(outputs), "forward", arguments=named))
        return out


def _step(inputs, fn, device):
    for t in inputs:
        t.grad = None
    out = fn()
    if out.requires_grad:
        out.backward(torch.ones_like(out) if out.ndim else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(inputs, fn, device: torch.device) -> int:
    """Peak memory of one forward + backward above what exists before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(inputs, fn, device)
        return torch.cuda.max_memory_allocated(device) - before
    with TensorMemoryTracker(inputs) as tracker:
        _step(inputs, fn, device)
    return tracker.peak - tracker.baseline


def fused_bytes(op: str, device: torch.device) -> float:
    """Bytes the fused op's kernels move in one forward + backward, as the projection prices them."""
    inputs, fn = _case(op, True, device)
    with _FusedOps() as recorded:
        _step(inputs, fn, device)
    return sum(fused_work(o).nbytes for o in recorded.ops)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("op", OPS)
def test_fused_op(benchmark, bench_device, op, fused):
    inputs, fn = _case(op, fused, bench_device)
    path = kernels.kernel_paths(bench_device, _dtype(bench_device))["rms_norm" if op == "add_rms_norm" else op]
    benchmark.extra_info.update(
        bytes=fused_bytes(op, bench_device),
        peak_bytes=peak_bytes(inputs, fn, bench_device),
        device=str(bench_device),
        path=path.details if fused else "eager composition",
    )
    benchmark.pedantic(lambda: _step(inputs, fn, bench_device), rounds=ROUNDS, warmup_rounds=2, iterations=1)
