"""The rowwise FP8 expert backend against its definition, against bf16, and its op choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_engine.config import ExpertBackendKind
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups
from moe_engine.precision import fp8_experts as fx
from moe_engine.precision import fp8_rowwise as fp8

U = 2.0**-4
"""e4m3's unit roundoff: 3 stored mantissa bits, round to nearest."""
SUBNORMAL_HALF_STEP = 2.0**-10
"""Half the spacing of e4m3's subnormals (2^-9), the absolute error below its smallest normal 2^-6."""

COUNTS = [5, 0, 12, 9]
PADDING = 3


def _groups(counts=COUNTS) -> ExpertGroups:
    return ExpertGroups.from_counts(torch.tensor(counts))


def _layer(backend, d=64, f=32, seed=0) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)
    layer = GroupedExperts(d, f, len(COUNTS), backend)
    with torch.no_grad():
        layer.gate_up.copy_(torch.randn(layer.gate_up.shape, generator=g) / d**0.5)
        layer.down.copy_(torch.randn(layer.down.shape, generator=g) / f**0.5)
    return layer.to(torch.bfloat16)


def _rows(d=64, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(COUNTS) + PADDING, d, generator=g).to(torch.bfloat16)


def test_emulated_gemm_is_bit_exact_with_dequantize_then_fp32_matmul(one_thread):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(COUNTS) + PADDING, 48, generator=g) * torch.logspace(-3, 3, 48)
    w = torch.randn(len(COUNTS), 40, 48, generator=g)
    offsets = _groups().offsets_E
    out = fx.fp8_grouped_mm(x, fx.quantize_weight(w), offsets, torch.float32, fx.FP8Path.EMULATION)
    # The definition read independently: q / s with the quantizer's own scales, one matmul per expert.
    x_q, x_s = fp8.quantize(x[: offsets[-1]])
    w_q, w_s = fp8.quantize(w)
    x_deq, w_deq = x_q.float() / x_s, w_q.float() / w_s
    want = torch.zeros(x.shape[0], 40)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        want[start:end] = x_deq[start:end] @ w_deq[e].T.contiguous()
        start = end
    assert torch.equal(out, want)


@pytest.fixture
def one_thread():
    # The CPU's BLAS cuts a matmul by thread count, which orders the sums differently for a grouped
    # call and a per-expert one; on one thread both run the same sequential kernel.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gemm_bound(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """Worst-case |fp8 GEMM - exact| elementwise: each operand element off by at most u|v| (normal
    range) or half a subnormal step (scaled back), products summed in fp32 over K terms."""
    a, b = a_MK.double(), b_KN.double()
    da = torch.maximum(U * a.abs(), SUBNORMAL_HALF_STEP / fp8.rowwise_scales(a_MK, -1).double())
    db = torch.maximum(U * b.abs(), SUBNORMAL_HALF_STEP / fp8.rowwise_scales(b_KN, 0).double())
    k = a.shape[1]
    gamma_k = k * 2.0**-24 / (1 - k * 2.0**-24)
    return da @ b.abs() + a.abs() @ db + da @ db + gamma_k * (a.abs() + da) @ (b.abs() + db)


@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_within_the_e4m3_bound(transposed):
    """fprop (x @ w.T) and dgrad (g @ w) layouts, fp32 output, against the exact product."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(COUNTS), 64, generator=g) * torch.rand(sum(COUNTS), 1, generator=g) * 8
    w = torch.randn(len(COUNTS), 64, 64, generator=g) * torch.logspace(-4, 1, 64)
    offsets = _groups().offsets_E
    out = fx.fp8_grouped_mm(x, fx.quantize_weight(w, transposed), offsets, torch.float32, fx.FP8Path.EMULATION)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        b_KN = w[e] if transposed else w[e].T
        exact = x[start:end].double() @ b_KN.double()
        bound = _gemm_bound(x[start:end], b_KN)
        assert ((out[start:end].double() - exact).abs() <= bound).all()
        # Not vacuous: the error is a sizeable share of the bound somewhere.
        if end > start:
            assert ((out[start:end].double() - exact).abs() / bound).max() > 0.05
        start = end


def _layer_errors(layer_fp8: GroupedExperts, layer_ref: GroupedExperts) -> dict[str, float]:
    groups = _groups()
    x = _rows()
    real = int(groups.offsets_E[-1])
    g = torch.Generator().manual_seed(4)
    grad_y = torch.randn(x.shape[0], x.shape[1], generator=g).to(torch.bfloat16)
    outs = {}
    for name, layer in (("fp8", layer_fp8), ("ref", layer_ref)):
        xi = x.clone().requires_grad_()
        y = layer(xi, groups)
        y.backward(grad_y)
        outs[name] = (y[:real], xi.grad[:real], layer.gate_up.grad, layer.down.grad)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    return {
        k: rel(a.detach(), b.detach())
        for k, a, b in zip(("y", "dx", "dgate_up", "ddown"), outs["fp8"], outs["ref"], strict=True)
    }


# Relative RMS bounds from e4m3's unit roundoff u = 2^-4: each quantized operand element is off by
# at most u relative, so a GEMM of two quantized operands is off by at most sqrt(2) u in relative RMS
# when the elements' rounding errors are independent (random inputs); a chain adds the terms of the
# quantized operands it passes: y (x, gate_up, a, down: sqrt(4) u), dx (grad_y, down, grad_h,
# gate_up, plus y's chain through h: sqrt(6) u), the bf16 weight gradients (their inputs carry
# x's and h's quantization: sqrt(4) u). bf16 rounding (2^-8) is negligible beside them.
LAYER_BOUNDS = {"y": 4**0.5 * U, "dx": 6**0.5 * U, "dgate_up": 4**0.5 * U, "ddown": 4**0.5 * U}


def test_layer_forward_backward_against_bf16():
    errors = _layer_errors(_layer(ExpertBackendKind.FP8), _layer(ExpertBackendKind.LOOP))
    for name, err in errors.items():
        assert 1e-3 < err < LAYER_BOUNDS[name], (name, err)


def test_a_wrong_scale_axis_fails_the_bound(monkeypatch):
    """gate_up (E, 64, 64) is square, so scales taken along its output axis have the op's shape."""

    right_axis = fx.quantize_weight

    def wrong_axis(w_ENK, transposed=False):
        if w_ENK.shape[1] != w_ENK.shape[2]:
            return right_axis(w_ENK, transposed)
        data, scale = fp8.quantize(w_ENK if transposed else w_ENK.transpose(1, 2), axis=-1)
        data = data.transpose(1, 2) if not transposed else data
        return data.contiguous().transpose(1, 2), scale.reciprocal().squeeze(2)

    monkeypatch.setattr(fx, "quantize_weight", wrong_axis)
    errors = _layer_errors(_layer(ExpertBackendKind.FP8, d=64, f=32), _layer(ExpertBackendKind.LOOP))
    assert errors["y"] > LAYER_BOUNDS["y"]


def test_split_backward_defers_weight_grads():
    from moe_engine.moe.expert_backend import defer_weight_grads

    layer, groups = _layer(ExpertBackendKind.FP8), _groups()
    x = _rows().requires_grad_()
    with defer_weight_grads() as deferred:
        layer(x, groups).sum().backward()
    assert x.grad is not None and layer.gate_up.grad is None and deferred.pending == 1
    deferred.run_all()
    assert layer.gate_up.grad is not None and layer.down.grad is not None
    assert torch.equal(layer.gate_up.grad[1], torch.zeros_like(layer.gate_up.grad[1]))  # expert 1: no rows


def _fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize(
    ("capability", "want"),
    [((9, 0), fx.FP8Path.SCALED_GROUPED_MM), ((10, 3), fx.FP8Path.EMULATION), ((8, 9), fx.FP8Path.EMULATION)],
)
def test_path_from_a_faked_device(monkeypatch, capability, want):
    _fake_cuda(monkeypatch, capability)
    assert fx.available_path("cuda") is want
    assert fx.available_path("cpu") is fx.FP8Path.EMULATION
    label = fx.path_label(want, "cuda")
    assert label == (
        f"scaled-grouped-mm-rowwise-sm{capability[0]}{capability[1]}" if want is fx.FP8Path.SCALED_GROUPED_MM else want
    )


def test_path_without_the_op(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.delattr(F, "scaled_grouped_mm")
    assert fx.available_path("cuda") is fx.FP8Path.EMULATION


def test_the_op_gets_rowwise_operands(monkeypatch):
    """A recording stand-in for ``scaled_grouped_mm`` on the layer's forward and backward: the
    arguments' dtypes, layouts and shapes, torch's own shape checks (its meta kernel), the label, and
    the same result as the emulation."""
    calls = []

    def recording(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, offs=None, output_dtype=None):
        calls.append((mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, offs, output_dtype))
        torch._scaled_grouped_mm(
            mat_a.to("meta"),
            mat_b.to("meta"),
            scale_a.to("meta"),
            scale_b.to("meta"),
            offs=offs.to("meta"),
            out_dtype=output_dtype,
        )
        return fx.scaled_grouped_mm_emulated(mat_a, mat_b, scale_a, scale_b, offs, output_dtype)

    monkeypatch.setattr(F, "scaled_grouped_mm", recording)
    monkeypatch.setattr(fx, "available_path", lambda device: fx.FP8Path.SCALED_GROUPED_MM)
    _fake_cuda(monkeypatch, (9, 0))
    layer, groups = _layer(ExpertBackendKind.FP8), _groups()
    x = _rows().requires_grad_()
    layer(x, groups).sum().backward()
    assert layer.backend.path == "scaled-grouped-mm-rowwise-sm90"
    assert len(calls) == 4  # fprop h and y, dgrad a and x
    for mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype in calls:
        assert recipe_a == recipe_b == F.ScalingType.RowWise
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
        assert mat_a.stride(1) == 1 and mat_b.stride(1) == 1  # a row-major, b column-major
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.shape == (mat_a.shape[0],) and scale_b.shape == (mat_b.shape[0], mat_b.shape[2])
        assert offs.dtype == torch.int32 and torch.equal(offs, groups.offsets_E)
        assert out_dtype == torch.bfloat16
    recorded = (layer(x.detach(), groups), x.grad)
    monkeypatch.undo()
    layer_emulated = _layer(ExpertBackendKind.FP8)
    x2 = _rows().requires_grad_()
    layer_emulated(x2, groups).sum().backward()
    assert layer_emulated.backend.path == "torch-emulation"
    assert torch.equal(recorded[0], layer_emulated(x2.detach(), groups))
    assert torch.equal(recorded[1], x2.grad)


def test_nan_padding_rows_stay_in_their_rows():
    """Padding rows are not zeroed before quantization: a NaN there must reach no real row's output or
    input gradient, nor any weight gradient."""
    layer, groups = _layer(ExpertBackendKind.FP8), _groups()
    x = _rows()
    x[sum(COUNTS) :] = float("nan")
    x.requires_grad_()
    y = layer(x, groups)
    grad_y = torch.ones_like(y)
    grad_y[sum(COUNTS) :] = float("nan")
    y.backward(grad_y)
    real = sum(COUNTS)
    assert torch.isfinite(y[:real]).all() and torch.isfinite(x.grad[:real]).all()
    assert torch.isfinite(layer.gate_up.grad).all() and torch.isfinite(layer.down.grad).all()


@pytest.mark.parametrize("fused", [False, True])
def test_a_bf16_model_trains_with_fp8_experts(fused):
    """The backend inside a whole model (router, dispatch, gather, shared expert), fused kernels or
    not: the loss within the layer's forward bound of the same model with bf16 experts, and every
    parameter a finite, non-zero gradient."""
    from moe_engine import ModelConfig, build_model
    from moe_engine.config import MoEConfig

    losses, models = {}, {}
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    for backend in ("torch", "fp8"):
        torch.manual_seed(0)
        moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, shared_expert_hidden=32, backend=backend)
        config = ModelConfig(
            vocab_size=96,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            seq_len=16,
            dense_hidden=96,
            dtype="bf16",
            moe=moe,
            fused_kernels=fused,
        )
        model = build_model(config, torch.device("cpu"))
        loss = model.loss(tokens, tokens.roll(-1, dims=1))
        loss.backward()
        losses[backend], models[backend] = loss.item(), model
    assert abs(losses["fp8"] - losses["torch"]) / losses["torch"] < LAYER_BOUNDS["y"]
    for name, param in models["fp8"].named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name
