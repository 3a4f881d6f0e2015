"""The MXFP8 expert backend: an MoE layer close to the BF16 one, padding rows harmless, no host sync,
and the experts' saved activations in MXFP8 instead of BF16.

Tolerance. Errors are normwise, ||actual - expected||_F / ||expected||_F, against the same layer with
the BF16 ``torch`` backend. Rounding Gaussian data to E4M3 inside MX blocks has a normwise error
u ~ 0.03 (3 mantissa bits: an error uniform over a spacing of 2^-3 times the binade, RMS 2^-3/sqrt(12)
of values ~1.5 times the binade, plus some saturation at 448 with the specification's floor scale;
measured 0.029). A product of two quantized operands has ~ sqrt(2) u = 0.042 (measured 0.042). The
layer output goes through four quantized operands, with the SwiGLU product of the two quantized halves
of h in between: ~ sqrt(6) u = 0.073. Gradients see up to six quantized operands plus the MXFP8-saved
h: ~ sqrt(8) u = 0.085; the expert weights' (MXFP8 weight-gradient GEMMs) two more: ~ sqrt(10) u = 0.095.
Measured over four seeds of the configurations below: output 0.077-0.083, input gradient 0.084-0.088,
router 0.068-0.085, expert weights 0.086-0.094 (0.076-0.084 with bf16 weight-gradient GEMMs). The bound
is 5 u = 0.15, under twice the expectation. The lower bound 0.005 checks that MXFP8 actually ran: one BF16 rounding
(unit roundoff 2^-9) stays below ~0.002 normwise, and the BF16 loop and grouped backends agree exactly.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from moe_engine.config import ExpertBackendKind, ModelConfig, MoEConfig
from moe_engine.host_sync import forbid_host_sync
from moe_engine.model import cast_parameters
from moe_engine.moe.experts import GroupedExperts, MXFP8Backend
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.permute import ExpertGroups
from moe_engine.precision.mxfp8 import blocks as mxfp8
from moe_engine.precision.mxfp8 import gemm as mx

TOLERANCE = 0.15
MXFP8_RAN = 0.005


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


def make_layer(config: ModelConfig, backend: str, seed: int = 0, fused: bool = False) -> MoELayer:
    torch.manual_seed(seed)
    moe = dataclasses.replace(config.moe, backend=backend)
    layer = MoELayer(config.d_model, moe, fused_kernels=fused)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=config.init_std)
    return cast_parameters(layer, config.dtype)


def run(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor):
    x = x_TD.clone().requires_grad_()
    layer.router.reset_routing_generator()
    y = layer(x)
    (y * grad_TD).sum().backward()
    grads = {"input": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return y.detach(), grads


CONFIGS = [
    # d_model, expert hidden, experts, top_k, routing, tokens
    (128, 96, 8, 2, "learned", 256),
    (64, 64, 16, 4, "random", 128),  # several experts without tokens at this size
    (48, 40, 4, 2, "learned", 64),  # sizes that are not multiples of 32: zero-padded blocks
]


@pytest.mark.parametrize("d_model, hidden, experts, top_k, routing, tokens", CONFIGS)
def test_layer_matches_bf16_layer(d_model, hidden, experts, top_k, routing, tokens):
    config = ModelConfig(
        d_model=d_model,
        dtype="bf16",
        init_std=0.05,
        moe=MoEConfig(num_experts=experts, top_k=top_k, expert_hidden=hidden, routing=routing),
    )
    generator = torch.Generator().manual_seed(1)
    x_TD = torch.randn(tokens, d_model, generator=generator).bfloat16()
    grad_TD = torch.randn(tokens, d_model, generator=generator).bfloat16()

    y, grads = run(make_layer(config, "mxfp8"), x_TD, grad_TD)
    y_ref, grads_ref = run(make_layer(config, "torch"), x_TD, grad_TD)

    errors = {"output": normwise_error(y, y_ref)}
    errors |= {name: normwise_error(grads[name], grads_ref[name]) for name in grads_ref}
    assert set(errors) == {"output", "input", "router.weight", "experts.gate_up", "experts.down"}
    for name, error in errors.items():
        assert MXFP8_RAN < error < TOLERANCE, (name, errors)


def mx_round(t: torch.Tensor, axis: int) -> torch.Tensor:
    """fp32 values of ``t`` after MXFP8 quantization in blocks of 32 along ``axis`` (zero-padded)."""
    t_K = t.float().movedim(axis, -1)
    size = t_K.shape[-1]
    data, scales = mxfp8.quantize(F.pad(t_K, (0, -size % 32)), axis=-1)
    return mxfp8.dequantize(data, scales, axis=-1)[..., :size].movedim(-1, axis)


def bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated in fp32, rounded once to bf16 (what each expert GEMM returns)."""
    return (a.float() @ b.float()).bfloat16()


def mxfp8_experts_reference(x_ND, grad_ND, counts, gate_up_EHD, down_EDF, mx_wgrad=True):
    """The MXFP8 experts' output and gradients, one expert at a time, from the GEMM table of
    docs/precision.md: fprop and dgrad multiply MXFP8-rounded operands blocked along their reduction
    dim; wgrad multiplies operands MXFP8-rounded in blocks of 32 of the expert's tokens (``mx_wgrad``;
    x as fprop saw it, rounded again) or bf16 ones; backward sees h rounded to MXFP8."""
    y, grad_x, grad_gate_up, grad_down = [], [], [], []
    for x, grad_y, gate_up, down in zip(x_ND.split(counts), grad_ND.split(counts), gate_up_EHD, down_EDF):
        h = bf16_gemm(mx_round(x, 1), mx_round(gate_up, 1).T)  # fprop 1, reduction over D
        gate, up = h.chunk(2, dim=1)
        y.append(bf16_gemm(mx_round(F.silu(gate) * up, 1), mx_round(down, 1).T))  # fprop 2, over F
        grad_a = bf16_gemm(mx_round(grad_y, 1), mx_round(down, 0))  # dgrad 2, over D
        h_saved = mx_round(h, 1).bfloat16().requires_grad_()
        gate, up = h_saved.chunk(2, dim=1)
        a = F.silu(gate) * up
        a.backward(grad_a)
        grad_h = h_saved.grad
        grad_x.append(bf16_gemm(mx_round(grad_h, 1), mx_round(gate_up, 0)))  # dgrad 1, over 2F
        if mx_wgrad:  # blocks along this expert's tokens (axis 0), zero-padded to 32
            grad_down.append(bf16_gemm(mx_round(grad_y, 0).T, mx_round(a.detach(), 0)))  # wgrad 2, over tokens
            grad_gate_up.append(bf16_gemm(mx_round(grad_h, 0).T, mx_round(mx_round(x, 1), 0)))  # wgrad 1
        else:
            grad_down.append(bf16_gemm(grad_y.T, a.detach()))  # wgrad 2, bf16
            grad_gate_up.append(bf16_gemm(grad_h.T, mx_round(x, 1)))  # wgrad 1, bf16
    return torch.cat(y), torch.cat(grad_x), torch.stack(grad_gate_up), torch.stack(grad_down)


# Against the reference above the backend differs only in summation order (an fp32 rounding that
# rarely flips a bf16 or E4M3 rounding downstream): measured on CPU bit-identical, or 8e-6 normwise. One of
# the six GEMMs run in the other precision leaves one operand rounded or not, an error ~ u = 0.03
# (see the module docstring): measured 0.043-0.082 on the tensors downstream of it. 0.003 is more
# than ten times below the latter and far above the former.
GEMM_TOLERANCE = 0.003


@pytest.mark.parametrize("mx_wgrad", [True, False], ids=["mxfp8-wgrad", "bf16-wgrad"])
@pytest.mark.parametrize(
    "d_model, hidden, counts",
    [
        (64, 64, [40, 0, 25, 31]),  # an expert without tokens; 40 tokens: a full block and a part
        (96, 48, [17, 50, 9]),  # F = 48: fprop 2 reduces over blocks zero-padded to 64
    ],
)
def test_each_gemm_quantizes_exactly_its_operands(d_model, hidden, counts, mx_wgrad, device):
    """Each of the four fprop/dgrad GEMMs multiplies MXFP8-rounded operands (blocked along its
    reduction dim), the two wgrad GEMMs operands blocked along each expert's tokens (``mxfp8_wgrad``)
    or bf16 ones: any one of them in the wrong precision, or blocked across two experts, fails."""
    torch.manual_seed(0)
    experts = GroupedExperts(d_model, hidden, len(counts), ExpertBackendKind.MXFP8, mxfp8_wgrad=mx_wgrad)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    experts.bfloat16()
    generator = torch.Generator().manual_seed(1)
    x_ND = torch.randn(sum(counts), d_model, generator=generator).bfloat16()
    grad_ND = torch.randn(sum(counts), d_model, generator=generator).bfloat16()
    expected = mxfp8_experts_reference(x_ND, grad_ND, counts, experts.gate_up.detach(), experts.down.detach(), mx_wgrad)

    experts.to(device)
    x = x_ND.to(device).requires_grad_()
    y = experts(x, ExpertGroups.from_counts(torch.tensor(counts, device=device)))
    (y * grad_ND.to(device)).sum().backward()
    actual = {"y": y, "grad_x": x.grad, "grad_gate_up": experts.gate_up.grad, "grad_down": experts.down.grad}

    errors = {name: normwise_error(actual[name].cpu(), ref) for name, ref in zip(actual, expected)}
    assert all(error < GEMM_TOLERANCE for error in errors.values()), errors


def test_padding_rows_change_nothing():
    """Rows after the last offset (expert-parallel padding) may be NaN: real rows' outputs and every
    weight gradient are those of the unpadded call, and the padding rows get zero outputs and gradients."""
    torch.manual_seed(0)
    experts = GroupedExperts(64, 32, 3, ExpertBackendKind.MXFP8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    groups = ExpertGroups.from_counts(torch.tensor([9, 0, 7]))
    x_ND, grad_ND = torch.randn(16, 64), torch.randn(16, 64)

    def outputs(x_rows, grad_rows):
        experts.zero_grad()
        x = x_rows.clone().requires_grad_()
        y = experts(x, groups)
        (y * grad_rows).sum().backward()
        return y.detach(), x.grad, experts.gate_up.grad.clone(), experts.down.grad.clone()

    nan_rows = torch.full((5, 64), float("nan"))
    padded = outputs(torch.cat([x_ND, nan_rows]), torch.cat([grad_ND, nan_rows]))
    plain = outputs(x_ND, grad_ND)
    assert torch.equal(padded[0][16:], torch.zeros(5, 64)) and torch.equal(padded[1][16:], torch.zeros(5, 64))
    for got, expected in zip((padded[0][:16], padded[1][:16], *padded[2:]), plain):
        assert torch.isfinite(got).all()
        assert normwise_error(got, expected) < 1e-6


def test_no_host_sync_and_path_on_cpu():
    layer = make_layer(
        ModelConfig(d_model=64, dtype="bf16", moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64)), "mxfp8"
    )
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with forbid_host_sync():
        layer(x).sum().backward()
    assert isinstance(layer.experts.backend, MXFP8Backend)
    assert layer.experts.backend.path == "torch-emulation"
    assert x.grad is not None and torch.isfinite(layer.experts.gate_up.grad).all()


@pytest.mark.parametrize("fused", [False, True])
def test_path_label_names_the_fallback_that_ran(fused, monkeypatch):
    """On a faked capability-10.x device whose every call to torch's scaled op falls back (fp32 outputs
    are not the op's), the label names the fallback that ran, not the op the forward asked for."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mx, "_ran", {})
    monkeypatch.setattr(mx, "_compiled_mma", {})
    # CPU tensors stand for the device: the path the GPU gets, recorded and labelled as cuda:0's.
    monkeypatch.setattr(mx, "available_path", lambda device: mx.GemmPath.SCALED_GROUPED_MM)
    monkeypatch.setattr(mx, "_device_key", lambda device: torch.device("cuda", 0))
    label = mx.path_label
    monkeypatch.setattr(mx, "path_label", lambda path, device: label(path, "cuda:0"))
    assert label(mx.GemmPath.SCALED_GROUPED_MM, "cuda:0") == "scaled-grouped-mm-mxfp8-sm100"

    config = ModelConfig(d_model=64, dtype="fp32", moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64))
    layer = make_layer(config, "mxfp8", fused=fused)
    reference = make_layer(config, "torch")
    x_TD, grad_TD = torch.randn(32, 64), torch.randn(32, 64)
    y, grads = run(layer, x_TD, grad_TD)
    assert layer.experts.backend.path == "torch-emulation"  # the fallback of CPU tensors
    # What ran is the MXFP8 emulation: within the MXFP8 tolerance of the fp32 layer, not equal to it.
    y_ref, grads_ref = run(reference, x_TD, grad_TD)
    assert MXFP8_RAN < normwise_error(y, y_ref) < TOLERANCE
    assert normwise_error(grads["input"], grads_ref["input"]) < TOLERANCE


def test_layer_cast_with_module_to_bf16_matches_cast_parameters():
    """``nn.Module.to(bf16)`` differs from ``cast_parameters`` only in rounding the router's weight:
    against a ``cast_parameters`` layer whose fp32 router holds those rounded values, the output and
    every gradient are the same bits (the router's gradient rounded once to bf16)."""
    config = ModelConfig(d_model=64, dtype="bf16", moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64))
    reference = make_layer(config, "mxfp8")
    layer = copy.deepcopy(reference).to(torch.bfloat16)
    with torch.no_grad():
        reference.router.weight.copy_(layer.router.weight.float())
    generator = torch.Generator().manual_seed(2)
    x_TD = torch.randn(32, 64, generator=generator).bfloat16()
    grad_TD = torch.randn(32, 64, generator=generator).bfloat16()

    y, grads = run(layer, x_TD, grad_TD)
    y_ref, grads_ref = run(reference, x_TD, grad_TD)
    assert layer.router.weight.dtype == grads["router.weight"].dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    for name, grad_ref in grads_ref.items():
        assert torch.equal(grads[name], grad_ref.to(torch.bfloat16)), name


class SavedBytes:
    """Unique storages saved for backward while a layer's forward runs, and those saved while its
    experts run (what the expert autograd Function saves), parameters excluded from both."""

    def __init__(self, layer: MoELayer):
        self.layer = layer
        self.parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        self.layer_bytes: dict[int, int] = {}
        self.expert_bytes: dict[int, int] = {}

    def _pack(self, *buckets):
        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.parameters:
                for bucket in buckets:
                    bucket[storage.data_ptr()] = storage.nbytes()
            return t

        return pack

    def forward(self, x):
        experts_forward = self.layer.experts.forward

        def recorded_experts(*args, **kwargs):
            # The innermost hooks win, so this pair also records into the layer's bucket.
            with saved_tensors_hooks(self._pack(self.layer_bytes, self.expert_bytes), lambda t: t):
                return experts_forward(*args, **kwargs)

        self.layer.experts.forward = recorded_experts
        try:
            with saved_tensors_hooks(self._pack(self.layer_bytes), lambda t: t):
                return self.layer(x)
        finally:
            del self.layer.experts.forward


def test_saved_expert_activations_shrink_in_mxfp8():
    """The experts' saved activations (x and h, plus the int32 offsets) are >= 40% smaller in MXFP8:
    1 + 1/32 bytes per element instead of 2, a ratio of 0.516."""
    d_model, hidden, tokens, top_k = 128, 128, 256, 2
    config = ModelConfig(d_model=d_model, dtype="bf16", moe=MoEConfig(num_experts=8, top_k=top_k, expert_hidden=hidden))
    x = torch.randn(tokens, d_model, dtype=torch.bfloat16, requires_grad=True)
    measured = {}
    for backend in ("torch", "mxfp8"):
        saved = SavedBytes(make_layer(config, backend))
        y = saved.forward(x)
        measured[backend] = (sum(saved.expert_bytes.values()), sum(saved.layer_bytes.values()))
        del y

    rows = tokens * top_k
    x_and_h = rows * (d_model + 2 * hidden)
    offsets = 8 * 4
    assert measured["torch"][0] == 2 * x_and_h + offsets
    assert measured["mxfp8"][0] == x_and_h + x_and_h // 32 + offsets
    expert_ratio = measured["mxfp8"][0] / measured["torch"][0]
    layer_ratio = measured["mxfp8"][1] / measured["torch"][1]
    print(
        f"saved bytes mxfp8/bf16: experts {measured['mxfp8'][0]}/{measured['torch'][0]} = {expert_ratio:.3f}, "
        f"whole layer {measured['mxfp8'][1]}/{measured['torch'][1]} = {layer_ratio:.3f}"
    )
    assert expert_ratio <= 0.6
    assert measured["torch"][1] - measured["mxfp8"][1] == measured["torch"][0] - measured["mxfp8"][0]


@pytest.mark.cuda
def test_layer_on_cuda_runs_the_mxfp8_gemm_without_host_sync():
    config = ModelConfig(
        d_model=256,
        dtype="bf16",
        init_std=0.05,
        # Balanced routing is the same function on both devices; "random" draws from Philox on CUDA and
        # from mt19937 on the CPU, so one seed would route the two runs to other experts.
        moe=MoEConfig(num_experts=16, top_k=4, expert_hidden=128, routing="balanced"),
    )
    x_TD = torch.randn(1024, 256, dtype=torch.bfloat16)
    grad_TD = torch.randn(1024, 256, dtype=torch.bfloat16)
    reference = run(make_layer(config, "torch"), x_TD, grad_TD)
    layer = make_layer(config, "mxfp8").cuda()
    x = x_TD.cuda().requires_grad_()
    grad = grad_TD.cuda()  # a host-to-device copy: outside the guard, which refuses one
    with forbid_host_sync():
        y = layer(x)
        (y * grad).sum().backward()
    major, minor = torch.cuda.get_device_capability()
    # What the code chooses on this capability; at these sizes torch's op takes every operand (bf16
    # outputs, N and K multiples of 16, more rows than experts), so no call falls back.
    if mx.available_path(x.device) is mx.GemmPath.SCALED_GROUPED_MM:
        assert major == 10
        assert layer.experts.backend.path == f"scaled-grouped-mm-mxfp8-sm{major}{minor}"
    else:
        mode = "native" if major >= 10 else "emulated"  # no MX tensor cores before sm100
        assert layer.experts.backend.path == f"triton-dot-scaled-{mode}-sm{major}{minor}"
    assert normwise_error(y.cpu(), reference[0]) < TOLERANCE
    assert normwise_error(x.grad.cpu(), reference[1]["input"]) < TOLERANCE
    for name, p in layer.named_parameters():
        assert normwise_error(p.grad.cpu(), reference[1][name]) < TOLERANCE, name
