"""Rowwise FP8 (``moe_engine.precision.fp8_rowwise``) against hand-computed values of its definition
(torchao's ``amax_to_scale`` with power-of-two rounding, then a saturating e4m3 cast) on edge inputs,
and its grouped GEMM emulation against per-expert matmuls of the dequantized operands."""

import math

import pytest
import torch

from moe_engine.precision import fp8_rowwise as fp8


def _pow2_floor(v: float) -> float:
    return 2.0 ** math.floor(math.log2(v))


def test_scales_by_hand():
    x = torch.tensor(
        [
            [448.0, 1.0, -2.0, 0.0],  # amax 448: scale 1 exactly
            [0.0, 0.0, 0.0, 0.0],  # amax 0: 448 / 1e-12
            [3.0, -1.5, 0.25, 0.0],  # 448 / 3 = 149.33 -> 128
            [1e38, 1.0, 0.0, -1e38],  # 448 / 1e38 -> 2^-118
        ]
    )
    want = [1.0, _pow2_floor(448 / 1e-12), 128.0, _pow2_floor(448 / 1e38)]
    assert fp8.rowwise_scales(x).flatten().tolist() == want
    assert fp8.rowwise_scales(x).shape == (4, 1)
    unrounded = fp8.rowwise_scales(x, power_of_2=False).flatten()
    assert unrounded[2].item() == torch.tensor(448 / 3, dtype=torch.float32).item()


def test_quantize_edges_by_hand(device):
    sub = 2.0**-140  # an fp32 subnormal
    x = torch.tensor(
        [
            [448.0, 464.0, -448.0, 0.0],  # amax 464 sets the scale
            [0.0, -0.0, 0.0, 0.0],
            [sub, -sub, 0.0, sub],  # amax below 1e-12: scale 2^48, values 2^-92, below e4m3's 2^-9
            [3.0, -1.5, 0.25, 1.0 / 1024],  # scale 128: 384, -192, 32, 0.125
        ],
        device=device,
    )
    data, scale = (t.cpu() for t in fp8.quantize(x))
    # Row 0: amax 464 -> 448 / 464 = 0.9655 -> 0.5: 224, 232, -224, 0; e4m3 steps by 16 in [128, 256),
    # so 232 is a tie between 224 (mantissa 110) and 240 (111): to even, 224.
    want = torch.tensor(
        [[224.0, 224.0, -224.0, 0.0], [0.0, -0.0, 0.0, 0.0], [0.0, -0.0, 0.0, 0.0], [384.0, -192.0, 32.0, 0.125]]
    )
    assert torch.equal(data.float(), want)
    assert torch.equal(torch.signbit(data.float()), torch.signbit(want))
    assert scale.flatten().tolist() == [0.5, 2.0**48, 2.0**48, 128.0]
    assert torch.equal(fp8.dequantize(data, scale), want / scale)


def test_saturation_and_rounding_by_hand():
    # Unrounded scales can push a value past 448 only through fp32 rounding; a value rounds to the
    # nearest e4m3 (ties to even): 17 lies between 16 and 18 (steps of 2) -> 16; 19 -> 20; 0.001 is
    # 0.51 of the subnormal step 2^-9 -> one step.
    x = torch.tensor([[448.0, 17.0, 19.0, -0.001]])
    data, scale = fp8.quantize(x)
    assert scale.item() == 1.0
    assert data.float().tolist() == [[448.0, 16.0, 20.0, -0.001953125]]


def test_nan_and_inf_rows(device):
    x = torch.tensor([[1.0, float("nan"), 2.0, 0.0], [1.0, float("inf"), 2.0, 0.0]], device=device)
    data, scale = (t.cpu() for t in fp8.quantize(x))
    assert scale[0].isnan().all() and data[0].float().isnan().all()
    assert scale[1].item() == 0.0
    assert data[1].float()[[0, 2, 3]].tolist() == [0.0, 0.0, 0.0] and data[1].float()[1].isnan()


def test_scales_run_along_the_reduction_axis():
    """Scales along the wrong axis would be caught: a planted axis-0 quantization of an operand with
    rows of different magnitudes gives other values than the definition's per-row one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)
    data, scale = fp8.quantize(x)
    per_row = [fp8.quantize(row.unsqueeze(0)) for row in x]
    assert torch.equal(data.float(), torch.cat([d.float() for d, _ in per_row]))
    assert torch.equal(scale, torch.cat([s for _, s in per_row]))
    wrong_data, wrong_scale = fp8.quantize(x, axis=0)
    assert wrong_scale.shape == (1, 64)
    assert not torch.equal(fp8.dequantize(wrong_data, wrong_scale), fp8.dequantize(data, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_emulation_equals_per_expert_matmuls(dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(20, 64, generator=g).to(dtype)
    b = torch.randn(3, 16, 64, generator=g).to(dtype)
    offsets = torch.tensor([5, 5, 17], dtype=torch.int32)
    a_data, a_scale = fp8.quantize(a)
    b_data, b_scale = fp8.quantize(b)
    out = fp8.grouped_mm_emulated(a_data, a_scale, b_data, b_scale, offsets)
    a_deq, b_deq = fp8.dequantize(a_data, a_scale).double(), fp8.dequantize(b_data, b_scale).double()
    want = torch.zeros(20, 16, dtype=torch.float64)
    for e, (start, end) in enumerate(zip([0, 5, 5], [5, 5, 17])):
        want[start:end] = a_deq[start:end] @ b_deq[e].T
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(out[17:], torch.zeros(3, 16))
    # The rowwise recipe's error against the unquantized product: e4m3 keeps 3 mantissa bits.
    exact = torch.cat([a[0:5].double() @ b[0].double().T, a[5:17].double() @ b[2].double().T])
    rel = (out[:17].double() - exact).norm() / exact.norm()
    assert 0 < rel < 0.06
