"""Inputs for every fused op, and two ways to run each: through the fused op (``moe_engine.kernels``), and
as the eager composition it replaces, written out here from the model's formulas and differentiated by
autograd. Shared by the in-process tests (the reference path, or Triton on CUDA) and the child process
that runs the Triton kernels under TRITON_INTERPRET=1.

A case is a plain dict (it crosses processes through ``torch.save``): ``op``, ``dtype`` (a name),
``tensors`` (the inputs and the gradients fed into the outputs, fp32 on the CPU, cast at run time) and
``params`` (eps, chunk rows, ...). Both runners return {name: tensor} with the same names: the outputs,
then ``grad_<input>`` for each differentiable input.
"""

from __future__ import annotations

import math
import os
import random

import torch
import torch.nn.functional as F
from tolerances import tolerance

from moe_engine import kernels

IGNORE = -100
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def session_seed() -> int:
    """A fresh seed per test session (MOE_KERNEL_SEED repeats one); the tests print it on failure."""
    return int(os.environ.get("MOE_KERNEL_SEED") or random.SystemRandom().randrange(2**31))


SEED = session_seed()


# --- inputs --------------------------------------------------------------------------------------------


def _rms_norm_case(g, name, shape, residual: bool):
    width = shape[-1]
    tensors = {
        "x": torch.randn(shape, generator=g) * 2.0,
        "weight": 1.0 + 0.3 * torch.randn(width, generator=g),
        "grad_y": torch.randn(shape, generator=g),
    }
    if residual:
        tensors["residual"] = torch.randn(shape, generator=g)
        tensors["grad_h"] = torch.randn(shape, generator=g)
    return {"op": "add_rms_norm" if residual else "rms_norm", "name": name, "tensors": tensors, "params": {"eps": 1e-5}}


def _swiglu_case(g, name, rows, width, packed: bool):
    tensors = {"grad_a": torch.randn(rows, width, generator=g)}
    if packed:
        tensors["h"] = torch.randn(rows, 2 * width, generator=g) * 2.0
    else:
        tensors["gate"] = torch.randn(rows, width, generator=g) * 2.0
        tensors["up"] = torch.randn(rows, width, generator=g)
    return {"op": "swiglu_packed" if packed else "swiglu", "name": name, "tensors": tensors, "params": {}}


def _cross_entropy_case(g, name, rows, width, vocab, chunk_rows, ignored_every=0, late_maxima=0):
    """``late_maxima``: that many rows get their largest logit (20, against about 10 for the others) at the
    end of the vocabulary, so a kernel that reads the vocabulary in blocks must raise its running
    maximum in a later block for them (with random logits that happens only by chance)."""
    labels = torch.randint(0, vocab, (rows,), generator=g)
    if ignored_every:
        labels[::ignored_every] = IGNORE
    h = torch.randn(rows, width, generator=g)
    weight = torch.randn(vocab, width, generator=g) * (3.0 / math.sqrt(width))
    for i in range(late_maxima):
        # Row i's logit there is exactly 20; other rows' stay random (h_j . h_i / |h_i|^2 is about 1/sqrt(width)).
        weight[vocab - 1 - i] = h[i] * (20.0 / h[i].square().sum())
    tensors = {
        "h": h,
        "weight": weight,
        "labels": labels,
        "grad_loss": torch.tensor(0.5 + torch.rand((), generator=g).item()),
    }
    return {"op": "linear_cross_entropy", "name": name, "tensors": tensors, "params": {"chunk_rows": chunk_rows}}


def _rope_case(g, name, batch, heads, seq, head_dim, transposed: bool):
    inv_freq_d = 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
    angles_Sd = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq_d)
    angles_SH = torch.cat([angles_Sd, angles_Sd], dim=-1)
    tensors = {
        "x": torch.randn(batch, heads, seq, head_dim, generator=g),
        "cos": angles_SH.cos(),
        "sin": angles_SH.sin(),
        "grad_y": torch.randn(batch, heads, seq, head_dim, generator=g),
    }
    return {"op": "rope", "name": name, "tensors": tensors, "params": {"transposed": transposed}}


def cases(seed: int = SEED) -> list[dict]:
    """Every op's cases, one set of fp32 inputs (each run casts them to its dtype). Edge cases: one
    row, widths that are not multiples of a kernel's block, rows not a multiple of a program's run or
    of a chunk, ignored labels, a vocabulary spanning blocks with a partial last one."""
    g = torch.Generator().manual_seed(seed)
    return [
        _rms_norm_case(g, "rows 3x5, width 100", (3, 5, 100), residual=False),
        _rms_norm_case(g, "one row, width 64", (1, 64), residual=False),
        _rms_norm_case(g, "9 rows, width 1000", (9, 1000), residual=False),
        _rms_norm_case(g, "add: rows 2x7, width 96", (2, 7, 96), residual=True),
        _rms_norm_case(g, "add: one row, width 33", (1, 33), residual=True),
        _swiglu_case(g, "37 rows, width 70", 37, 70, packed=False),
        _swiglu_case(g, "one row, width 1500 (two column blocks)", 1, 1500, packed=False),
        _swiglu_case(g, "packed: 21 rows, width 48", 21, 48, packed=True),
        _swiglu_case(g, "packed: one row, width 1100", 1, 1100, packed=True),
        _cross_entropy_case(g, "45 rows in chunks of 16, vocab 101, every 7th ignored", 45, 24, 101, 16, 7),
        _cross_entropy_case(g, "one row, vocab 37", 1, 16, 37, 0),
        _cross_entropy_case(g, "12 rows in chunks of 5, vocab 5000 (two vocab blocks), 6 maxima in the second",
                            12, 16, 5000, 5, 4, late_maxima=6),
        _cross_entropy_case(g, "20 rows, default chunks", 20, 32, 64, 0, 3),
        _rope_case(g, "(2, 3, 9, 16)", 2, 3, 9, 16, transposed=False),
        _rope_case(g, "(1, 4, 7, 24) from a (B, S, H, d) layout", 1, 4, 7, 24, transposed=True),
        _rope_case(g, "one position, (1, 1, 1, 8)", 1, 1, 1, 8, transposed=False),
    ]


def case_id(case: dict) -> str:
    return f"{case['op']}: {case['name']}"


# --- running -------------------------------------------------------------------------------------------


def _prepare(case: dict, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in case["tensors"].items():
        # A copy: the case's own tensors stay untouched (and without autograd state) for the next run.
        t = t.detach().clone().to(device)
        if t.is_floating_point() and name not in ("cos", "sin", "grad_loss"):
            t = t.to(dtype)
        # The packed SwiGLU has no autograd (the experts' hand-written backward calls it).
        if name in ("x", "residual", "weight", "gate", "up", "h") and case["op"] != "swiglu_packed":
            t.requires_grad_()
        out[name] = t
    if case["op"] == "rope" and case["params"]["transposed"]:
        # The attention's layout: (B, S, H, d) memory read as (B, H, S, d).
        x = out["x"].detach().transpose(1, 2).contiguous().transpose(1, 2)
        out["x"] = x.requires_grad_()
    return out


def _backward(outputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]):
    names = [n for n in outputs if n in grads]
    torch.autograd.backward([outputs[n] for n in names], [grads[n] for n in names])
    return {**{n: t.detach() for n, t in outputs.items()},
            **{f"grad_{n}": t.grad for n, t in inputs.items() if t.requires_grad}}


def run_fused(case: dict, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Outputs and gradients through the fused ops (whichever path ``moe_engine.kernels`` picks here)."""
    t = _prepare(case, dtype, device)
    op, p = case["op"], case["params"]
    if op == "rms_norm":
        y = kernels.rms_norm(t["x"], t["weight"], p["eps"])
        return _backward({"y": y}, {"y": t["grad_y"]}, {k: t[k] for k in ("x", "weight")})
    if op == "add_rms_norm":
        h, y = kernels.add_rms_norm(t["x"], t["residual"], t["weight"], p["eps"])
        return _backward({"h": h, "y": y}, {"h": t["grad_h"], "y": t["grad_y"]},
                         {k: t[k] for k in ("x", "residual", "weight")})
    if op == "swiglu":
        a = kernels.swiglu(t["gate"], t["up"])
        return _backward({"a": a}, {"a": t["grad_a"]}, {k: t[k] for k in ("gate", "up")})
    if op == "swiglu_packed":
        a = kernels.swiglu_packed(t["h"])
        a_again, grad_h = kernels.swiglu_packed_backward(t["h"], t["grad_a"])
        return {"a": a, "a_again": a_again, "grad_h": grad_h}
    if op == "linear_cross_entropy":
        loss = kernels.linear_cross_entropy(t["h"], t["weight"], t["labels"], IGNORE, p["chunk_rows"])
        return _backward({"loss": loss}, {"loss": t["grad_loss"]}, {k: t[k] for k in ("h", "weight")})
    if op == "rope":
        y = kernels.rope(t["x"], t["cos"], t["sin"])
        return _backward({"y": y}, {"y": t["grad_y"]}, {"x": t["x"]})
    raise ValueError(f"unknown op {op}")


def _eager_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def run_eager(case: dict, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """The same outputs and gradients from the eager composition, by autograd."""
    t = _prepare(case, dtype, device)
    op, p = case["op"], case["params"]
    if op == "rms_norm":
        y = _eager_rms_norm(t["x"], t["weight"], p["eps"])
        return _backward({"y": y}, {"y": t["grad_y"]}, {k: t[k] for k in ("x", "weight")})
    if op == "add_rms_norm":
        h = t["residual"] + t["x"]
        y = _eager_rms_norm(h, t["weight"], p["eps"])
        return _backward({"h": h, "y": y}, {"h": t["grad_h"], "y": t["grad_y"]},
                         {k: t[k] for k in ("x", "residual", "weight")})
    if op == "swiglu":
        a = F.silu(t["gate"]) * t["up"]
        return _backward({"a": a}, {"a": t["grad_a"]}, {k: t[k] for k in ("gate", "up")})
    if op == "swiglu_packed":
        h = t["h"].detach().requires_grad_()
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
        a.backward(t["grad_a"])
        return {"a": a.detach(), "a_again": a.detach(), "grad_h": h.grad}
    if op == "linear_cross_entropy":
        loss = F.cross_entropy(F.linear(t["h"], t["weight"]).float(), t["labels"], ignore_index=IGNORE)
        return _backward({"loss": loss}, {"loss": t["grad_loss"]}, {k: t[k] for k in ("h", "weight")})
    if op == "rope":
        x = t["x"]
        seq = x.shape[-2]
        cos, sin = t["cos"][:seq].to(x.dtype), t["sin"][:seq].to(x.dtype)
        y = x * cos + _rotate_half(x) * sin
        return _backward({"y": y}, {"y": t["grad_y"]}, {"x": x})
    raise ValueError(f"unknown op {op}")


# --- tolerances ----------------------------------------------------------------------------------------


def tolerances(case: dict, dtype: torch.dtype) -> dict[str, float]:
    """Per compared value, ``tests/tolerances.tolerance`` of the chain that computes it.

    RMSNorm: the mean of squares over the width (k = width), then elementwise roundings; backward adds
    the row sum of g * xhat, and the weight's gradient sums over the rows. SwiGLU: elementwise only
    (k = 1), a few roundings deep. Cross-entropy: the logits' GEMM over the width, the logsumexp over
    the vocabulary, the mean over the rows; gradients run the chain back, and the weight's gradient
    also carries one more rounding per chunk it is accumulated over (in the weight's dtype). RoPE:
    elementwise, two products and a sum.
    """
    tensors, op = case["tensors"], case["op"]
    if op in ("rms_norm", "add_rms_norm"):
        width = tensors["x"].shape[-1]
        rows = tensors["x"].numel() // width
        tol = {"y": tolerance(dtype, width, depth=2), "h": tolerance(dtype, 1),
               "grad_x": tolerance(dtype, width, depth=4), "grad_weight": tolerance(dtype, max(width, rows), depth=4)}
        tol["grad_residual"] = tol["grad_x"]
        return tol
    if op in ("swiglu", "swiglu_packed"):
        return {"a": tolerance(dtype, 1, depth=2), "a_again": tolerance(dtype, 1, depth=2),
                "grad_gate": tolerance(dtype, 1, depth=4), "grad_up": tolerance(dtype, 1, depth=3),
                "grad_h": tolerance(dtype, 1, depth=4)}
    if op == "linear_cross_entropy":
        rows, width = tensors["h"].shape
        vocab = tensors["weight"].shape[0]
        k = max(rows, width, vocab)
        chunk_rows = case["params"]["chunk_rows"] or kernels.cross_entropy.default_chunk_rows(rows, width, vocab)
        chunks = math.ceil(rows / chunk_rows)
        return {"loss": tolerance(dtype, k, depth=3), "grad_h": tolerance(dtype, k, depth=7),
                "grad_weight": tolerance(dtype, k, depth=7 + chunks)}
    if op == "rope":
        return {"y": tolerance(dtype, 1, depth=3), "grad_x": tolerance(dtype, 1, depth=3)}
    raise ValueError(f"unknown op {op}")


# --- a small model -------------------------------------------------------------------------------------

MODEL_CONFIG = {
    "vocab_size": 96, "d_model": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "n_dense_layers": 1,
    "dense_hidden": 96, "qk_norm": True, "dtype": "fp32", "fused_kernels": True,
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "shared_expert_hidden": 32},
}
"""Every fused op in one model: dense and MoE blocks, a shared expert, QK-norm, an untied LM head."""


def model_batch(seed: int = SEED, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (2, 16) and next-token labels, every fifth ignored."""
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    labels = tokens.roll(-1, dims=1)
    labels.view(-1)[::5] = IGNORE
    return tokens, labels
