"""The fused MXFP8 gather's cases (``moe_engine::gather_rows_mx``), its plain reference (a per-row loop of
copies, then ``mxfp8.quantize``) and the MXFP8 experts run fused and unfused on gathered rows: shared by
the in-process tests (tests/unit/moe_engine/kernels/test_fused_gather_mx.py) and the child process that
runs the Triton kernel under TRITON_INTERPRET=1
(tests/integration/toolchains/test_fused_gather_mx_interpreted.py)."""

from __future__ import annotations

import torch
from fused_cases import SEED

from moe_engine import kernels
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups, gather_tokens, plan_routing, plan_slots, sort_permutation
from moe_engine.precision.mxfp8.blocks import quantize


def _tokens(g: torch.Generator, tokens: int, width: int, special: bool = True) -> torch.Tensor:
    """Rows of mixed magnitudes; with ``special`` a NaN, an Inf, a zero row and fp32 subnormals."""
    x = torch.randn(tokens, width, generator=g) * 10.0 ** torch.randint(-20, 21, (tokens, 1), generator=g)
    if special and tokens >= 4:
        x[0, 3] = float("nan")
        x[1, width - 1] = float("inf")
        x[2] = 0.0
        x[3] = torch.linspace(-1e-40, 1e-40, width)
    return x


def cases(seed: int = SEED) -> list[dict]:
    """name, token rows, the map (assignment, top_k, filled) and end. Edge cases: an expert with no rows,
    dropped assignments and empty slots, padding rows after ``end`` holding NaN, one token, no rows,
    more rows than one program's tile, widths of one block and of three."""
    g = torch.Generator().manual_seed(seed + 7)
    routes = torch.randint(0, 5, (40, 2), generator=g)
    routes[routes == 3] = 4  # expert 3 gets no rows
    local = plan_routing(routes, 5)
    skewed = plan_routing(torch.tensor([[0, 1]] * 5 + [[2, 1]] * 3), 4)
    slots = plan_slots(skewed, 2, 5).rows
    # A receiver's sort: 150 rows, 7 of them padding (local expert id L = 3 sorts them last).
    local_R = torch.randint(0, 3, (150,), generator=g)
    local_R[torch.randperm(150, generator=g)[:7]] = 3
    received = sort_permutation(local_R)
    one = plan_routing(torch.tensor([[1]]), 3)

    def case(name, x, rows, end=None):
        r = rows.assignment_R.numel()
        return {
            "name": name,
            "x": x,
            "assignment": rows.assignment_R,
            "top_k": rows.top_k,
            "filled": rows.filled_R,
            "end": torch.tensor([r if end is None else end], dtype=torch.int32),
        }

    return [
        case("40 tokens, top_k 2, expert 3 empty, width 64", _tokens(g, 40, 64), local.rows),
        case("slots: dropped and empty, width 32", _tokens(g, 8, 32), slots),
        case(
            "received 150 rows, 7 padding, width 96",
            _tokens(g, 150, 96).index_fill_(0, torch.tensor([149]), float("nan")),
            received,
            end=143,
        ),
        case("one token, width 32", _tokens(g, 1, 32, special=False), one.rows),
        case("no rows, width 64", _tokens(g, 3, 64), plan_routing(torch.empty(0, 2, dtype=torch.int64), 4).rows),
        case(
            "width 40: the reference pads it",
            _tokens(g, 6, 40),
            plan_routing(torch.randint(0, 3, (6, 2), generator=g), 3).rows,
        ),
    ]


def loop_reference(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One row at a time: the copy, zero where empty or past ``end``, then ``mxfp8.quantize``."""
    x = case["x"].to(dtype)
    rows, width = case["assignment"].numel(), x.shape[1]
    padded = -(-width // 32) * 32
    out = torch.zeros(rows, padded, dtype=dtype)
    for r in range(rows):
        filled = case["filled"] is None or bool(case["filled"][r])
        if filled and r < int(case["end"][0]):
            out[r, :width] = x[int(case["assignment"][r]) // case["top_k"]]
    codes, scales = quantize(out, axis=-1)
    return codes.view(torch.uint8), scales.view(torch.uint8)


def run_case(case: dict, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    filled = None if case["filled"] is None else case["filled"].to(device)
    codes, scales = kernels.gather_rows_mx(
        case["x"].to(device, dtype), case["assignment"].to(device), case["top_k"], filled, case["end"].to(device)
    )
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    return codes.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()


def assert_same_bytes(got, case, dtype):
    want = loop_reference(case, dtype)
    for name, a, b in zip(("codes", "scales"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        bad = (a != b).nonzero()
        assert not len(bad), (
            f"seed {SEED}, {case['name']}, {dtype}: {len(bad)} {name} differ, first at {bad[:3].tolist()}"
        )


def experts_outputs(fused: bool, padded: bool) -> dict[str, torch.Tensor]:
    """Outputs and gradients of bf16 MXFP8 experts on gathered rows: fused, the experts gather
    and quantize in one op; unfused, the rows are gathered first (``gather_tokens``, the same fused
    gather op as the engine's other paths) and the experts quantize them. ``padded``: a receiver's
    buffer, its padding rows NaN."""
    g = torch.Generator().manual_seed(SEED + 11)
    experts = GroupedExperts(d_model=64, hidden=32, num_experts=4, backend="mxfp8", fused_kernels=True)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    experts = experts.to(torch.bfloat16)
    if padded:
        local_R = torch.randint(0, 4, (50,), generator=g)
        local_R[torch.randperm(50, generator=g)[:6]] = 4  # 6 padding rows, after the last offset once sorted
        rows = sort_permutation(local_R)
        counts_E = torch.bincount(local_R, minlength=5)[:4]
        x = torch.randn(50, 64, generator=g)
        x[local_R == 4] = float("nan")
    else:
        plan = plan_routing(torch.randint(0, 4, (30, 2), generator=g), 4)
        rows, counts_E = plan.rows, plan.groups.counts_E
        x = torch.randn(30, 64, generator=g)
    x = x.to(torch.bfloat16).requires_grad_()
    groups = ExpertGroups.from_counts(counts_E)
    if fused:
        y = experts(x, groups, rows=rows)
    else:
        y = experts(gather_tokens(x, rows, fused=True), groups)
    grad_y = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(grad_y)
    return {"y": y.detach(), "grad_x": x.grad, "grad_gate_up": experts.gate_up.grad, "grad_down": experts.down.grad}


def assert_identical(fused: dict, unfused: dict, where: str):
    """Equal bits, NaN where the unfused has NaN; the unfused run itself finite."""
    for name in unfused:
        a, b = fused[name], unfused[name]
        same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert same, f"seed {SEED}, {where}: {name} differs by up to {(a.float() - b.float()).abs().nan_to_num().max()}"
    assert not unfused["y"].isnan().any() and not unfused["grad_x"].isnan().any()
