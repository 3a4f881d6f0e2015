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

import contextlib
import math
import os
import random

import torch
import torch.nn.functional as F
from tolerances import assert_close_to_scale, tolerance

from moe_engine import kernels
from moe_engine.moe.permute import RowMap, plan_routing, plan_slots, reorder_rows, sort_permutation

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
        _cross_entropy_case(
            g,
            "12 rows in chunks of 5, vocab 5000 (two vocab blocks), 6 maxima in the second",
            12,
            16,
            5000,
            5,
            4,
            late_maxima=6,
        ),
        _cross_entropy_case(g, "20 rows, default chunks", 20, 32, 64, 0, 3),
        _rope_case(g, "(2, 3, 9, 16)", 2, 3, 9, 16, transposed=False),
        _rope_case(g, "(1, 4, 7, 24) from a (B, S, H, d) layout", 1, 4, 7, 24, transposed=True),
        _rope_case(g, "one position, (1, 1, 1, 8)", 1, 1, 1, 8, transposed=False),
    ]


def _row_map_tensors(rows: RowMap) -> dict[str, torch.Tensor]:
    out = {"row_N": rows.row_N, "assignment_R": rows.assignment_R}
    if rows.kept_N is not None:
        out["kept_N"] = rows.kept_N
    if rows.filled_R is not None:
        out["filled_R"] = rows.filled_R
    return out


def _routes(g, tokens: int, top_k: int, experts: list[int]) -> torch.Tensor:
    """(tokens, top_k) distinct experts per token, drawn from ``experts`` (the others receive no rows)."""
    pool = torch.tensor(experts)
    return torch.stack([pool[torch.randperm(len(experts), generator=g)[:top_k]] for _ in range(tokens)])


def _routing_case(g, name, tokens, top_k, width, rows: RowMap, weight_dtype: str | None = None):
    """Both routing ops on one map: ``gather_rows`` of x (T, D) and ``combine_rows`` of y (R, D). Rows of
    y and of the gradient reaching the gathered rows that hold no assignment are NaN, as garbage
    there would be: nothing may read them."""
    filled_R = rows.filled_R if rows.filled_R is not None else torch.ones(rows.assignment_R.numel(), dtype=torch.bool)
    y = torch.randn(rows.assignment_R.numel(), width, generator=g)
    grad_rows = torch.randn(rows.assignment_R.numel(), width, generator=g)
    y[~filled_R] = float("nan")
    grad_rows[~filled_R] = float("nan")
    weight = torch.rand(tokens, top_k, generator=g)
    tensors = {
        "x": torch.randn(tokens, width, generator=g) * 2.0,
        "grad_rows": grad_rows,
        "y": y,
        "weight": weight / weight.sum(dim=1, keepdim=True),
        "grad_out": torch.randn(tokens, width, generator=g),
        **_row_map_tensors(rows),
    }
    params = {"top_k": top_k, "weight_dtype": weight_dtype}
    return {"op": "routing", "name": name, "tensors": tensors, "params": params}


ROUTING_OPS = ("gather_rows", "combine_rows")
"""The routing ops, by their names in ``kernels.kernel_paths``."""


def routing_cases(seed: int = SEED) -> list[dict]:
    """The routing ops' cases: an expert receiving no rows, fixed-capacity slots with empty slots and
    dropped assignments (the no-sync dispatch), one token, widths that are not multiples of the column
    block (one of two blocks), top_k 1, 2 and 3, a permutation of single rows (a receiver's sort),
    a chunk-major reordered map, fp32 weights on bf16 rows."""
    g = torch.Generator().manual_seed(seed + 1)
    local = plan_routing(_routes(g, 9, 2, [0, 1, 2, 4, 5]), 6)
    # 4 experts on 2 ranks, capacity 5: 13 routes go to rank 0 (8 dropped), 3 to rank 1 (2 empty slots).
    skewed_TK = torch.tensor([[0, 1]] * 5 + [[2, 1]] * 3)[torch.randperm(8, generator=g)]
    flip_T = torch.rand(8, generator=g) < 0.5
    skewed = plan_routing(torch.where(flip_T.unsqueeze(1), skewed_TK.flip(1), skewed_TK), 4)
    slots = plan_slots(skewed, 2, 5).rows
    assert slots.kept_N is not None and not slots.kept_N.all() and not slots.filled_R.all()
    slots_k3 = plan_slots(plan_routing(_routes(g, 6, 3, [0, 1, 2, 3, 5]), 6), 3, 4).rows
    chunked = reorder_rows(slots, torch.cat([torch.arange(0, 10, 2), torch.arange(1, 10, 2)]))
    one = plan_routing(_routes(g, 1, 1, [2]), 3)
    return [
        _routing_case(g, "9 tokens, top_k 2, expert 3 gets none, width 48", 9, 2, 48, local.rows),
        _routing_case(g, "slots: 8 tokens, top_k 2, dropped and empty, width 40", 8, 2, 40, slots),
        _routing_case(g, "slots: top_k 2, fp32 weights, width 24", 8, 2, 24, slots, weight_dtype="fp32"),
        _routing_case(g, "slots: chunk-major order, width 17", 8, 2, 17, chunked),
        _routing_case(g, "slots: 6 tokens, top_k 3, width 33", 6, 3, 33, slots_k3),
        _routing_case(g, "one token, top_k 1, width 5", 1, 1, 5, one.rows),
        _routing_case(
            g,
            "permutation of 13 rows, width 1100 (two column blocks)",
            13,
            1,
            1100,
            sort_permutation(torch.randint(0, 4, (13,), generator=g)),
        ),
        _routing_case(
            g,
            "3 tokens, top_k 2, width 1030, fp32 weights",
            3,
            2,
            1030,
            plan_routing(_routes(g, 3, 2, [0, 1, 2, 3]), 4).rows,
            weight_dtype="fp32",
        ),
    ]


def case_id(case: dict) -> str:
    return f"{case['op']}: {case['name']}"


# --- running -------------------------------------------------------------------------------------------


# --- deterministic failures: poisoned outputs, guarded buffers ------------------------------------------

GUARD = 64
"""Elements of poison past the end of every input and output a fused op's run sees, at least: each
buffer's tail is as long as the buffer itself, so that a mask off by one row stays inside it."""


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with what no kernel writes by accident: NaN, the largest integer, True."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


GUARD_BYTE = 0xA5
"""The tails' bytes: finite values in every float dtype (-2.9e-16 in fp32 and bf16), unlike the NaN
outputs start as, so that a kernel writing a NaN it read past an end still changes them."""


class _Guards:
    """Buffers with a guarded tail: a kernel that reads past a buffer's end reads values that spoil
    its output, one that writes there changes the tail (``check``)."""

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def allocate(self, shape, dtype, device, requires_grad: bool = False) -> torch.Tensor:
        n = math.prod(shape)
        base = _poison(_REAL_EMPTY(2 * n + GUARD, dtype=dtype, device=device))
        # A bool holds 0 or 1 (torch's copies normalise other bytes): its tail stays True.
        base[n:].view(torch.uint8).fill_(1 if dtype == torch.bool else GUARD_BYTE)
        self.buffers.append((base, n, base[n:].view(torch.uint8).clone()))
        return base[:n].view(shape).requires_grad_(requires_grad)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return self.allocate(tuple(t.shape), t.dtype, t.device).copy_(t)

    def check(self) -> None:
        for base, n, tail in self.buffers:
            same = torch.equal(base[n:].view(torch.uint8), tail)
            assert same, f"a kernel wrote past the end of a buffer of {n} {base.dtype} elements"


_REAL_EMPTY, _REAL_EMPTY_LIKE = torch.empty, torch.empty_like
_guards: _Guards | None = None


@contextlib.contextmanager
def poisoned_run():
    """Inputs (``_prepare``) and every ``torch.empty``/``torch.empty_like`` output of the fused ops get a
    poisoned tail, and outputs start as poison (NaN for floats): an element a kernel leaves unwritten
    fails the comparison every time, not only when the allocator returns garbage, and a row mask off
    by one fails an assertion instead of reading or writing unowned memory."""
    global _guards
    guards = _guards = _Guards()

    def empty(*size, dtype=None, device=None, requires_grad=False, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        if kwargs.get("out") is not None or kwargs.get("memory_format") not in (None, torch.contiguous_format):
            return _REAL_EMPTY(*size, dtype=dtype, device=device, requires_grad=requires_grad, **kwargs)
        return guards.allocate(shape, dtype or torch.get_default_dtype(), device or "cpu", requires_grad)

    def empty_like(t, *, dtype=None, device=None, requires_grad=False, **kwargs):
        if not t.is_contiguous() or kwargs.get("memory_format") not in (None, torch.preserve_format):
            # Kernels may follow the strides empty_like preserves: poisoned, without a guard.
            return _poison(_REAL_EMPTY_LIKE(t, dtype=dtype, device=device, requires_grad=requires_grad, **kwargs))
        return guards.allocate(tuple(t.shape), dtype or t.dtype, device or t.device, requires_grad)

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield guards
    finally:
        torch.empty, torch.empty_like = _REAL_EMPTY, _REAL_EMPTY_LIKE
        _guards = None
    guards.check()


def _prepare(case: dict, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in case["tensors"].items():
        # A copy: the case's own tensors stay untouched (and without autograd state) for the next run.
        t = t.detach().clone().to(device)
        keep = ("cos", "sin", "grad_loss") + (("weight",) if case["params"].get("weight_dtype") else ())
        if t.is_floating_point() and name not in keep:
            t = t.to(dtype)
        if _guards is not None:
            t = _guards.copy(t)
        # The packed SwiGLU has no autograd (the experts' hand-written backward calls it).
        if name in ("x", "residual", "weight", "gate", "up", "h", "y") and case["op"] != "swiglu_packed":
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
    return {
        **{n: t.detach() for n, t in outputs.items()},
        **{f"grad_{n}": t.grad for n, t in inputs.items() if t.requires_grad},
    }


def run_fused(case: dict, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Outputs and gradients through the fused ops (whichever path ``moe_engine.kernels`` picks here),
    with poisoned outputs and guarded buffers (``poisoned_run``) on real tensors (fake ones, which a
    trace runs, hold no data to poison)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(t, FakeTensor) for t in case["tensors"].values()):
        return _run_fused(case, dtype, device)
    with poisoned_run():
        return _run_fused(case, dtype, device)


def _run_fused(case: dict, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    t = _prepare(case, dtype, device)
    op, p = case["op"], case["params"]
    if op == "rms_norm":
        y = kernels.rms_norm(t["x"], t["weight"], p["eps"])
        return _backward({"y": y}, {"y": t["grad_y"]}, {k: t[k] for k in ("x", "weight")})
    if op == "add_rms_norm":
        h, y = kernels.add_rms_norm(t["x"], t["residual"], t["weight"], p["eps"])
        return _backward(
            {"h": h, "y": y}, {"h": t["grad_h"], "y": t["grad_y"]}, {k: t[k] for k in ("x", "residual", "weight")}
        )
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
    if op == "routing":
        maps = (t.get("kept_N"), t.get("filled_R"))
        rows = kernels.gather_rows(t["x"], t["assignment_R"], t["row_N"], p["top_k"], maps[1], maps[0])
        out = kernels.combine_rows(t["y"], t["weight"], t["row_N"], t["assignment_R"], *maps)
        return _backward(
            {"rows": rows, "out": out},
            {"rows": t["grad_rows"], "out": t["grad_out"]},
            {k: t[k] for k in ("x", "y", "weight")},
        )
    raise ValueError(f"unknown op {op}")


def _eager_zero_where_not(mask, rows):
    return rows if mask is None else torch.where(mask.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype))


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
        return _backward(
            {"h": h, "y": y}, {"h": t["grad_h"], "y": t["grad_y"]}, {k: t[k] for k in ("x", "residual", "weight")}
        )
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
    if op == "routing":
        # permute.py's formulas, differentiated by autograd (index_select's backward is a scatter-add).
        top_k, kept, filled = p["top_k"], t.get("kept_N"), t.get("filled_R")
        rows = _eager_zero_where_not(filled, t["x"].index_select(0, t["assignment_R"] // top_k))
        y_TKD = _eager_zero_where_not(kept, t["y"].index_select(0, t["row_N"])).view(*t["weight"].shape, -1)
        out = torch.bmm(t["weight"].to(t["y"].dtype).unsqueeze(1), y_TKD).squeeze(1)
        return _backward(
            {"rows": rows, "out": out},
            {"rows": t["grad_rows"], "out": t["grad_out"]},
            {k: t[k] for k in ("x", "y", "weight")},
        )
    raise ValueError(f"unknown op {op}")


# --- tolerances ----------------------------------------------------------------------------------------


def tolerances(case: dict, dtype: torch.dtype) -> dict[str, float]:
    """Per compared value, ``tests/support/tolerances.tolerance`` of the chain that computes it.

    RMSNorm: the mean of squares over the width (k = width), then elementwise roundings; backward adds
    the row sum of g * xhat, and the weight's gradient sums over the rows. SwiGLU: elementwise only
    (k = 1), a few roundings deep. Cross-entropy: the logits' GEMM over the width, the logsumexp over
    the vocabulary, the mean over the rows; gradients run the chain back, and the weight's gradient
    (summed over chunks in fp32) one more rounding, the cast to the weight's dtype. RoPE:
    elementwise, two products and a sum. Routing: copies, and sums of top_k terms (the weighted
    one over the width for the weights' gradient), exact where ``moe_engine.kernels.routing`` says so.
    """
    tensors, op = case["tensors"], case["op"]
    if op in ("rms_norm", "add_rms_norm"):
        width = tensors["x"].shape[-1]
        rows = tensors["x"].numel() // width
        tol = {
            "y": tolerance(dtype, width, depth=2),
            "h": tolerance(dtype, 1),
            "grad_x": tolerance(dtype, width, depth=4),
            "grad_weight": tolerance(dtype, max(width, rows), depth=4),
        }
        tol["grad_residual"] = tol["grad_x"]
        return tol
    if op in ("swiglu", "swiglu_packed"):
        return {
            "a": tolerance(dtype, 1, depth=2),
            "a_again": tolerance(dtype, 1, depth=2),
            "grad_gate": tolerance(dtype, 1, depth=4),
            "grad_up": tolerance(dtype, 1, depth=3),
            "grad_h": tolerance(dtype, 1, depth=4),
        }
    if op == "linear_cross_entropy":
        rows, width = tensors["h"].shape
        vocab = tensors["weight"].shape[0]
        k = max(rows, width, vocab)
        return {
            "loss": tolerance(dtype, k, depth=3),
            "grad_h": tolerance(dtype, k, depth=7),
            "grad_weight": tolerance(dtype, k, depth=8),
        }
    if op == "rope":
        return {"y": tolerance(dtype, 1, depth=3), "grad_x": tolerance(dtype, 1, depth=3)}
    if op == "routing":
        top_k, width = case["params"]["top_k"], tensors["x"].shape[1]
        # Exact (0) where both round the same arithmetic once: copies, a sum of two, one product, and
        # in bf16 the weighted sum of two exact products (moe_engine.kernels.routing's docstring).
        sums = 0.0 if top_k <= 2 else tolerance(dtype, top_k)
        weighted = 0.0 if top_k <= 2 and dtype == torch.bfloat16 else tolerance(dtype, top_k)
        return {"rows": 0.0, "grad_x": sums, "out": weighted, "grad_y": 0.0, "grad_weight": tolerance(dtype, width)}
    raise ValueError(f"unknown op {op}")


def _terms_scale(case: dict, name: str) -> float:
    """The size of the terms a compared value sums, where it can be far below them: the combine's weight
    gradient is a dot product over the width, grad_out[t] . y[row], and a few tokens' dot products can
    all cancel to values much smaller than their rounding errors, which follow the terms: sqrt(width)
    times the operands' RMS sizes. 0 elsewhere."""
    if case["op"] != "routing" or name != "grad_weight":
        return 0.0
    grad_out, y = case["tensors"]["grad_out"], case["tensors"]["y"]
    rms = [t[t.isfinite()].float().square().mean().sqrt().item() for t in (grad_out, y)]
    return grad_out.shape[1] ** 0.5 * rms[0] * rms[1]


def assert_matches_eager(got: dict, want: dict, case: dict, dtype: torch.dtype, where: str) -> None:
    """``got`` (a fused run) holds the names of ``want`` (the eager run), each within ``tolerances`` of
    the largest |value|, or of the terms it sums where those are larger (``_terms_scale``)."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    tols = tolerances(case, dtype)
    for name, expected in want.items():
        largest = expected.detach().abs().max().item() if expected.numel() else 0.0
        tol = tols[name] * max(1.0, _terms_scale(case, name) / largest) if largest else tols[name]
        assert_close_to_scale(got[name], expected, tol, msg=f"{where}, {case_id(case)}, {dtype}, {name}, seed {SEED}")


# --- a small model -------------------------------------------------------------------------------------

MODEL_CONFIG = {
    "vocab_size": 96,
    "d_model": 64,
    "n_layers": 3,
    "n_heads": 4,
    "n_kv_heads": 2,
    "seq_len": 32,
    "n_dense_layers": 1,
    "dense_hidden": 96,
    "qk_norm": True,
    "dtype": "fp32",
    "fused_kernels": True,
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "shared_expert_hidden": 32},
}
"""Every fused op in one model: dense and MoE blocks, a shared expert, QK-norm, an untied LM head."""


def model_batch(seed: int = SEED, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (2, 16) and next-token labels, every fifth ignored."""
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    labels = tokens.roll(-1, dims=1)
    labels.view(-1)[::5] = IGNORE
    return tokens, labels


# --- the router's fused scores (``moe_engine::router_scores``, fp32 only) ------------------------------


def _router_case(g, name, tokens, width, *, op_experts=None, **moe):
    """A router (MoEConfig fields ``moe``) on fresh inputs, and the fused op alone on random logits with
    random experts (``op_*``) and random gradients for all three of its outputs."""
    experts, top_k = moe["num_experts"], moe["top_k"]
    moe = {"aux_loss_weight": 0.3, "z_loss_weight": 0.05, **moe}
    expert_TK = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    tensors = {
        "x": torch.randn(tokens, width, generator=g),
        "router_weight": torch.randn(experts, width, generator=g) * (2.0 / math.sqrt(width)),
        "expert_bias": 0.05 * torch.randn(experts, generator=g),
        "grad_weight_TK": torch.randn(tokens, top_k, generator=g),
        "grad_loss": torch.tensor(0.5 + torch.rand((), generator=g).item()),
        "op_logits": 2.0 * torch.randn(tokens, experts, generator=g),
        "op_expert_TK": expert_TK if op_experts is None else op_experts,
        "op_grad_weight_TK": torch.randn(tokens, top_k, generator=g),
        "op_grad_mean_probs": torch.randn(experts, generator=g),
        "op_grad_lse": torch.randn(tokens, generator=g),
    }
    return {"op": "router", "name": name, "tensors": tensors, "params": {"moe": moe}}


def router_cases(seed: int = SEED) -> list[dict]:
    """Softmax and sigmoid scores, renormalised or not, scaled or not, every routing mode (group-limited
    learned too), one token, E not a power of two (6, 40) and E = 256 (the kernel's widest row), top_k 1
    to 8, several row tiles and programs (150 tokens of 40 experts, 70 of 256, 1100 of 6)."""
    g = torch.Generator().manual_seed(seed + 2)
    return [
        _router_case(g, "learned softmax, E 40, top_k 8, 150 tokens", 150, 24, num_experts=40, top_k=8),
        _router_case(
            g,
            "learned softmax normalised x2.5, E 6, top_k 2",
            13,
            16,
            num_experts=6,
            top_k=2,
            normalize_top_k=True,
            routed_scaling_factor=2.5,
        ),
        _router_case(
            g,
            "learned sigmoid normalised x2.5, 8 groups of 8, top 4, top_k 8",
            33,
            32,
            num_experts=64,
            top_k=8,
            score_func="sigmoid",
            normalize_top_k=True,
            routed_scaling_factor=2.5,
            n_groups=8,
            top_groups=4,
        ),
        _router_case(g, "learned sigmoid, E 6, top_k 1", 17, 8, num_experts=6, top_k=1, score_func="sigmoid"),
        _router_case(g, "random softmax, E 40, top_k 2", 21, 16, num_experts=40, top_k=2, routing="random"),
        _router_case(
            g,
            "balanced sigmoid normalised, E 6, top_k 3",
            10,
            16,
            num_experts=6,
            top_k=3,
            routing="balanced",
            score_func="sigmoid",
            normalize_top_k=True,
        ),
        _router_case(
            g,
            "skewed softmax normalised x1.5, E 40, top_k 4",
            19,
            16,
            num_experts=40,
            top_k=4,
            routing="skewed",
            normalize_top_k=True,
            routed_scaling_factor=1.5,
        ),
        _router_case(
            g, "one token, learned softmax normalised, E 6, top_k 1", 1, 8, num_experts=6, top_k=1, normalize_top_k=True
        ),
        _router_case(
            g,
            "one token, random sigmoid x2, E 40, top_k 8",
            1,
            8,
            num_experts=40,
            top_k=8,
            routing="random",
            score_func="sigmoid",
            routed_scaling_factor=2.0,
        ),
        _router_case(
            g,
            "learned sigmoid, E 256, top_k 8, 70 tokens, default loss weights",
            70,
            16,
            num_experts=256,
            top_k=8,
            score_func="sigmoid",
            aux_loss_weight=0.01,
            z_loss_weight=0.001,
        ),
        _router_case(
            g, "balanced softmax, E 6, top_k 2, 1100 tokens", 1100, 8, num_experts=6, top_k=2, routing="balanced"
        ),
    ]


ROUTER_OUTPUTS = ("expert_TK", "weight_TK", "counts_E", "aux_loss", "z_loss", "loss")


def run_router(case: dict, fused: bool, device="cpu") -> dict[str, torch.Tensor]:
    """A fresh ``Router`` with ``fused_kernels`` as asked: its ``RouterOutput`` and the gradients of
    sum(grad_weight_TK * weight_TK) + grad_loss * loss w.r.t. the router weight and the input; with
    ``fused``, also the fused op alone (``op_*``: its outputs and the gradient of its logits)."""
    from moe_engine.config import MoEConfig
    from moe_engine.moe.router import Router

    t = {name: v.detach().clone().to(device) for name, v in case["tensors"].items()}
    config = MoEConfig(**case["params"]["moe"])
    router = Router(t["x"].shape[1], config, layer_idx=1, fused_kernels=fused).to(device)
    with torch.no_grad():
        router.weight.copy_(t["router_weight"])
        router.expert_bias.copy_(t["expert_bias"])
    x = t["x"].requires_grad_()
    route = router(x)
    out = {name: getattr(route, name) for name in ROUTER_OUTPUTS}
    ((route.weight_TK * t["grad_weight_TK"]).sum() + t["grad_loss"] * route.loss).backward()
    result = {**{n: v.detach() for n, v in out.items()}, "grad_x": x.grad, "grad_router_weight": router.weight.grad}
    if not fused:
        return result
    logits = t["op_logits"].requires_grad_()
    outs = kernels.router_scores(
        logits, t["op_expert_TK"], config.score_func == "sigmoid", config.normalize_top_k, config.routed_scaling_factor
    )
    grads = [t["op_grad_weight_TK"], t["op_grad_mean_probs"], t["op_grad_lse"]]
    torch.autograd.backward(outs, grads)
    names = ("op_weight_TK", "op_mean_probs_E", "op_lse_T")
    return {**result, **{n: o.detach() for n, o in zip(names, outs, strict=True)}, "op_grad_logits": logits.grad}


def router_op_eager(case: dict, device="cpu") -> dict[str, torch.Tensor]:
    """The fused op's three outputs and its logits' gradient by the router's eager formulas, differentiated
    by autograd (written out here, apart from ``moe_engine.kernels.router``)."""
    t = {name: v.detach().clone().to(device) for name, v in case["tensors"].items()}
    moe = case["params"]["moe"]
    logits = t["op_logits"].requires_grad_()
    if moe.get("score_func") == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        scores = probs = torch.softmax(logits, dim=-1)
    weight = scores.gather(1, t["op_expert_TK"])
    if moe.get("normalize_top_k"):
        weight = weight / weight.sum(dim=-1, keepdim=True)
    weight = weight * moe.get("routed_scaling_factor", 1.0)
    outs = (weight, probs.mean(dim=0), torch.logsumexp(logits, dim=-1))
    torch.autograd.backward(outs, [t["op_grad_weight_TK"], t["op_grad_mean_probs"], t["op_grad_lse"]])
    names = ("op_weight_TK", "op_mean_probs_E", "op_lse_T")
    return {**{n: o.detach() for n, o in zip(names, outs, strict=True)}, "op_grad_logits": logits.grad}


def router_tolerances(case: dict) -> dict[str, float]:
    """fp32, from the computation. Both paths compute the same logits (the same GEMM on the same inputs)
    and select the same experts (exact: indices and counts). From there on the fused op sums each row's E
    exponentials (and sigmoid scores) in another order, then the k chosen scores (renormalisation), and
    the tokens' probabilities for their mean (T terms) in per-program partials: three reductions of up
    to max(E, T) terms to the weights, the mean probabilities, the logsumexp and the z-loss (its square
    and mean), four to the balance loss (its dot over E) and the loss. Gradients run the chain back
    (softmax's row sum, the renormalisation's, the sigmoid probabilities') and, for the router weight
    and the input, through the logits' GEMMs (sums over the tokens, and over E): k = max(D, E, T),
    depth 8. The op alone starts from given logits: its gradient is three reductions back from three
    forward, over the E columns (the mean over tokens is a scale in backward)."""
    tensors = case["tensors"]
    (tokens, width), experts = tensors["x"].shape, tensors["router_weight"].shape[0]
    longest = max(experts, tokens)
    values = tolerance(torch.float32, longest, depth=3)
    tols = {
        "expert_TK": 0.0,
        "counts_E": 0.0,
        "weight_TK": values,
        "z_loss": values,
        "aux_loss": tolerance(torch.float32, longest, depth=4),
        "loss": tolerance(torch.float32, longest, depth=4),
        "grad_x": tolerance(torch.float32, max(width, longest), depth=8),
        "grad_router_weight": tolerance(torch.float32, max(width, longest), depth=8),
    }
    op_tokens = tensors["op_logits"].shape[0]
    tols.update(
        {
            "op_weight_TK": tolerance(torch.float32, experts, depth=3),
            "op_mean_probs_E": tolerance(torch.float32, max(experts, op_tokens), depth=3),
            "op_lse_T": tolerance(torch.float32, experts, depth=2),
            "op_grad_logits": tolerance(torch.float32, experts, depth=6),
        }
    )
    return tols


def assert_router_matches(got: dict, case: dict, device, where: str) -> None:
    """``got`` (``run_router(case, fused=True)``'s names) against the unfused router and the op's eager
    formulas, within ``router_tolerances`` (bit for bit where that is 0)."""
    want = run_router(case, fused=False, device=device)
    want.update(router_op_eager(case, device))
    assert set(got) == set(want), (sorted(got), sorted(want))
    tols = router_tolerances(case)
    for name, expected in want.items():
        msg = f"{where}, {case_id(case)}, {name}, seed {SEED}"
        if tols[name] == 0.0:
            assert torch.equal(got[name].cpu(), expected.cpu()), msg
        else:
            assert_close_to_scale(got[name], expected, tols[name], msg=msg)
