"""The torch MXFP8 quantizer against a plain reference written from the OCP MX v1.0 specification.

Inputs are made on the CPU and quantized on the test device; the codes come back to the CPU to be
compared byte for byte with the reference (integers: no tolerance)."""

import bisect
import itertools
import math

import pytest
import torch

from moe_engine.precision.mxfp8.blocks import MXTensor, ScaleRounding, dequantize, quantize

BLOCK = 32
E8M0_NAN = 0xFF


# --- reference, from the format definitions only -------------------------------------------------


def _e4m3_value(code: int) -> float:
    """Value of a non-negative E4M3 code: 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0."""
    exponent, mantissa = code >> 3, code & 0b111
    if exponent == 0:
        return mantissa / 8 * 2.0**-6
    return (1 + mantissa / 8) * 2.0 ** (exponent - 7)


# 0b1111_111 is NaN, so the finite codes are 0 .. 0b1111_110 (448); the list index is the code.
E4M3_VALUES = [_e4m3_value(code) for code in range(0x7F)]
assert sorted(E4M3_VALUES) == E4M3_VALUES and E4M3_VALUES[-1] == 448.0


def _e4m3_code(y: float) -> int:
    """Code of the E4M3 value nearest to y >= 0, ties to the even mantissa, saturating at 448."""
    above = bisect.bisect_left(E4M3_VALUES, y)
    if above == len(E4M3_VALUES):
        return len(E4M3_VALUES) - 1
    if E4M3_VALUES[above] == y or above == 0:
        return above
    below = above - 1
    # Both differences are exact in double: y has at most 24 significant bits near these values.
    to_below, to_above = y - E4M3_VALUES[below], E4M3_VALUES[above] - y
    if to_below != to_above:
        return below if to_below < to_above else above
    return below if below % 2 == 0 else above


def _shared_exponent(amax: float, rounding: ScaleRounding) -> int:
    if amax == 0:
        return -127
    if rounding is ScaleRounding.FLOOR:
        shared = math.frexp(amax)[1] - 1 - 8  # frexp's exponent - 1 is floor(log2(amax)) exactly
    else:
        # ceil(log2(amax / 448)): the smallest power of two that brings amax down to 448 or below.
        shared = math.frexp(amax)[1] - 1 - 8
        while amax / 2.0**shared > 448:
            shared += 1
        while amax / 2.0 ** (shared - 1) <= 448:
            shared -= 1
    return min(max(shared, -127), 127)


def _reference_block(values: list[float], rounding: ScaleRounding) -> tuple[list[int], int]:
    """(E4M3 codes, E8M0 scale code) of one block of finite values."""
    shared = _shared_exponent(max(abs(v) for v in values), rounding)
    # Dividing by 2^shared is exact in double for every fp32 input and every shared exponent.
    codes = [_e4m3_code(abs(v) / 2.0**shared) | (0x80 if math.copysign(1, v) < 0 else 0) for v in values]
    return codes, shared + 127


def reference_quantize(x: torch.Tensor, rounding: ScaleRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """(data codes, scale codes) as uint8, blocks along the last axis of a finite tensor."""
    blocks = x.float().reshape(-1, BLOCK).tolist()
    data, scales = [], []
    for values in blocks:
        codes, scale = _reference_block(values, rounding)
        data.extend(codes)
        scales.append(scale)
    data_t = torch.tensor(data, dtype=torch.uint8).reshape(x.shape)
    scales_t = torch.tensor(scales, dtype=torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // BLOCK)
    return data_t, scales_t


def quantize_codes(x: torch.Tensor, rounding=ScaleRounding.FLOOR, axis=-1) -> tuple[torch.Tensor, torch.Tensor]:
    """The data and scale codes of x quantized where x is, as uint8 on the CPU."""
    data, scales = quantize(x, axis=axis, rounding=rounding)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert data.device == scales.device == x.device
    return data.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()


def assert_matches_reference(x: torch.Tensor, rounding: ScaleRounding, device: torch.device) -> None:
    data, scales = quantize_codes(x.to(device), rounding)
    ref_data, ref_scales = reference_quantize(x, rounding)
    bad_scales = (scales != ref_scales).nonzero()
    assert len(bad_scales) == 0, f"scale codes differ at {bad_scales[:5].tolist()}"
    bad = (data != ref_data).nonzero()
    if len(bad):
        at = tuple(bad[0].tolist())
        raise AssertionError(
            f"{len(bad)} data codes differ; first at {at}: input {x[at].item()!r}, "
            f"got {data[at].item():#04x}, reference {ref_data[at].item():#04x}"
        )


# --- input cases -------------------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_across_magnitudes(n_blocks: int = 128, seed: int = 0) -> torch.Tensor:
    """Gaussian blocks, each scaled by 10^u with u uniform in [-30, 30] (fp32 and bf16 both hold 1e+-30)."""
    g = _generator(seed)
    scale = 10.0 ** (torch.rand(n_blocks, 1, generator=g, dtype=torch.float64) * 60 - 30)
    return (torch.randn(n_blocks, BLOCK, generator=g, dtype=torch.float64) * scale).float()


def random_spread_within_blocks(n_blocks: int = 128, seed: int = 1) -> torch.Tensor:
    """Elements spread over 2^-24 .. 2^0 of the block maximum: normals, subnormals and zeros of E4M3."""
    g = _generator(seed)
    base = 2.0 ** torch.randint(-100, 100, (n_blocks, 1), generator=g).double()
    spread = 2.0 ** -torch.randint(0, 25, (n_blocks, BLOCK), generator=g).double()
    return (torch.randn(n_blocks, BLOCK, generator=g, dtype=torch.float64) * spread * base).float()


def random_bit_patterns(n_blocks: int = 256, seed: int = 2) -> torch.Tensor:
    """fp32 values from random bits within 30 binades of a random block exponent, fp32 subnormals included."""
    g = _generator(seed)
    top = torch.randint(1, 255, (n_blocks, 1), generator=g)
    exponent = (top - torch.randint(0, 30, (n_blocks, BLOCK), generator=g)).clamp(min=0)
    mantissa = torch.randint(0, 2**23, (n_blocks, BLOCK), generator=g)
    sign = torch.randint(0, 2, (n_blocks, BLOCK), generator=g)
    bits = (sign << 31) | (exponent << 23) | mantissa
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def fp32_extremes() -> torch.Tensor:
    """Blocks at the ends of fp32: near its maximum, around its smallest normal, and subnormal only."""
    g = _generator(3)
    unit = torch.rand(4, BLOCK, generator=g, dtype=torch.float64) * 2 - 1
    rows = [unit[0] * 3.4e38, unit[1] * 1.2e-38, unit[2] * 1e-40, unit[3] * 2.0**-118]
    x = torch.stack(rows).float()
    x[2, 0] = 2.0**-149  # the smallest subnormal
    x[1, 0] = -(2.0**-126)  # the smallest normal
    return x


def zero_blocks() -> torch.Tensor:
    x = torch.zeros(3, BLOCK)
    x[1] = -0.0
    x[2, 5] = -0.0
    return x


def saturating_blocks(seed: int = 4) -> torch.Tensor:
    """Block maxima in [448, 512) * 2^k, among them the tie 464 (stays 448) and values rounding to 480."""
    g = _generator(seed)
    tops = torch.tensor([448.0, 450.0, 463.0, 464.0, 464.5, 479.0, 480.0, 500.0, 511.0, 511.99])
    k = torch.tensor([-120, -30, -1, 0, 1, 10, 60, 100, 110, 119])
    x = torch.rand(len(tops), BLOCK, generator=g) * 460
    x[:, 7] = tops
    x[:, 8] = -tops  # a second, negative saturating element
    return (x.double() * 2.0 ** k[:, None].double()).float()


def subnormal_blocks() -> torch.Tensor:
    """Blocks scaled so that elements land on, between and exactly halfway between E4M3 subnormals."""
    steps = torch.arange(0, 15.5, 0.5)  # 0, 0.5, ..., 15 steps of 2^-9: subnormals, ties, smallest normals
    x = torch.zeros(3, BLOCK)
    x[:, : len(steps)] = steps * 2.0**-9
    x[:, -1] = 256.0  # keeps the shared exponent at 0
    x[1] = -x[1]
    return (x.double() * torch.tensor([[1.0], [1.0], [2.0**-40]], dtype=torch.float64)).float()


def tie_blocks() -> torch.Tensor:
    """Every midpoint between consecutive positive E4M3 values, both signs, at shared exponent 0."""
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(E4M3_VALUES)]
    per_block = BLOCK - 1
    rows = []
    for start in range(0, len(midpoints), per_block):
        row = midpoints[start : start + per_block]
        rows.append(row + [0.0] * (per_block - len(row)) + [256.0])
    x = torch.tensor(rows)
    return torch.cat([x, -x])


def all_bf16_values() -> torch.Tensor:
    """Every finite bfloat16, 31 to a block next to a block maximum 2^8 (shared exponent 0)."""
    everything = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    small = everything[everything.isfinite() & (everything.abs() < 256)]
    small = small[: len(small) // (BLOCK - 1) * (BLOCK - 1)].reshape(-1, BLOCK - 1)
    return torch.cat([small, torch.full((len(small), 1), 256.0)], dim=1)


FINITE_CASES = {
    "random_fp32": random_across_magnitudes,
    "random_bf16": lambda: random_across_magnitudes(seed=5).bfloat16(),
    "random_fp16": lambda: random_spread_within_blocks(seed=6).clamp(-6e4, 6e4).half(),
    "spread_within_blocks": random_spread_within_blocks,
    "random_bits": random_bit_patterns,
    "fp32_extremes": fp32_extremes,
    "zeros": zero_blocks,
    "saturating": saturating_blocks,
    "subnormals": subnormal_blocks,
    "ties": tie_blocks,
    "negative": lambda: -random_across_magnitudes(seed=7).abs(),
}


# --- bit-exact agreement with the reference --------------------------------------------------------------


@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
@pytest.mark.parametrize("case", FINITE_CASES)
def test_quantize_matches_specification(case, rounding, device):
    assert_matches_reference(FINITE_CASES[case](), rounding, device)


@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
def test_every_bf16_value_rounds_as_specified(rounding, device):
    assert_matches_reference(all_bf16_values(), rounding, device)


def test_zero_block_gets_smallest_scale_and_keeps_signed_zeros(device):
    data, scales = quantize_codes(zero_blocks().to(device))
    assert (scales == 0).all()  # 2^-127
    assert data[1].eq(0x80).all() and data[0].eq(0).all() and data[2, 5] == 0x80


def test_saturation_and_ties_by_hand(device):
    x = torch.zeros(1, BLOCK)
    # Shared exponent 0: 464 is halfway between 448 (mantissa 110) and 480 (111), so it stays 448.
    x[0, :6] = torch.tensor([511.0, 464.0, 460.0, 9.0, 0.5 * 2.0**-9, 1.5 * 2.0**-9])
    data, scales = quantize_codes(x.to(device))
    assert scales.item() == 127
    assert data[0, :6].tolist() == [0x7E, 0x7E, 0x7E, 0b0_1010_001, 0, 2]  # 9 = 1.125 * 2^3; ties to even


@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
def test_non_finite_element_poisons_its_block_only(bad, rounding, device):
    x = random_across_magnitudes(4)
    x[1, 3] = bad
    data, scales = quantize_codes(x.to(device), rounding)
    assert scales[1, 0] == E8M0_NAN
    assert (scales[[0, 2, 3]] != E8M0_NAN).all()
    if math.isnan(bad):
        assert data.view(torch.float8_e4m3fn)[1, 3].float().isnan()
    values = dequantize(*quantize(x.to(device), rounding=rounding))
    assert values[1].isnan().all()
    assert values[[0, 2, 3]].isfinite().all()
    # The other blocks are quantized as if the bad one were not there.
    ref_data, ref_scales = reference_quantize(x[[0, 2, 3]], rounding)
    assert torch.equal(data[[0, 2, 3]], ref_data) and torch.equal(scales[[0, 2, 3]], ref_scales)


# --- properties ------------------------------------------------------------------------------------------


def _roundtrip_inputs() -> torch.Tensor:
    # The last saturating block tops out at 511.99 * 2^119; its CEIL scale 2^120 rounds that to 2^128,
    # a valid MX value that dequantizes to inf in fp32, so it is left out here.
    return torch.cat([random_across_magnitudes(), random_spread_within_blocks(), saturating_blocks()[:-1]]).double()


def _roundtrip(x: torch.Tensor, rounding: ScaleRounding, device: torch.device):
    """x quantized and dequantized on the device, and each element's step 2^shared, back on the CPU."""
    data, scales = quantize(x.to(device), rounding=rounding)
    shared = scales.view(torch.uint8).cpu().double() - 127  # [..., n_blocks]
    step = torch.exp2(shared).repeat_interleave(BLOCK, dim=-1)  # 2^shared for each element
    return dequantize(data, scales).cpu().double(), step


def test_floor_roundtrip_error_bounds(device):
    x = _roundtrip_inputs()
    values, step = _roundtrip(x.float(), ScaleRounding.FLOOR, device)
    error, scaled = (values - x).abs(), x.abs() / step
    amax = x.abs().reshape(-1, BLOCK).amax(-1).repeat_interleave(BLOCK).reshape(x.shape)
    saturated = scaled > 448
    # Within its binade [2^e, 2^(e+1)) E4M3 has steps of 2^(e-3), so rounding to nearest moves a value
    # by at most 2^(e-4): a relative error of 2^-4 wherever the scaled value is a normal E4M3 (>= 2^-6).
    normal = (scaled >= 2.0**-6) & ~saturated
    assert (error[normal] <= 2.0**-4 * x.abs()[normal]).all()
    # The block maximum scales to [256, 512), so every element within 2^14 of it is normal: the 2^-4
    # bound covers far more than the elements within 2^6 of the maximum.
    near = x.abs() >= amax * 2.0**-14
    assert normal[near & ~saturated].all()
    # Below 2^-6 the steps are the subnormal spacing 2^-9: at most half of it, in scaled units.
    tiny = scaled < 2.0**-6
    assert (error[tiny] <= 2.0**-10 * step[tiny]).all()
    # Saturated elements (scaled into (448, 512)) become 448 and lose less than (512 - 448) / 512 = 2^-3.
    assert saturated.any()
    assert (values[saturated].abs() == 448 * step[saturated]).all()
    assert (error[saturated] < 2.0**-3 * x.abs()[saturated]).all()


def test_ceil_never_saturates_and_roundtrip_error_bounds(device):
    x = _roundtrip_inputs()
    values, step = _roundtrip(x.float(), ScaleRounding.CEIL, device)
    error, scaled = (values - x).abs(), x.abs() / step
    blocks_scaled = scaled.reshape(-1, BLOCK).amax(-1)
    # The scale is the smallest power of two bringing the maximum to 448 or below: in (224, 448].
    assert (blocks_scaled <= 448).all() and (blocks_scaled > 224).all()
    # With no saturation every normal element is within 2^-4 relative; the maximum scales to more than
    # 2^7, so all elements within 2^13 of it are normal (2^-6 scaled). Smaller ones: half a subnormal step.
    normal = scaled >= 2.0**-6
    assert (error[normal] <= 2.0**-4 * x.abs()[normal]).all()
    assert (error[~normal] <= 2.0**-10 * step[~normal]).all()


def test_sizes_must_be_block_multiples(device):
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48, device=device))
    with pytest.raises(ValueError, match="axis 0"):
        quantize(torch.randn(40, 64, device=device), axis=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(
            torch.zeros(4, 40, dtype=torch.float8_e4m3fn, device=device),
            torch.zeros(4, 1, dtype=torch.float8_e8m0fnu, device=device),
        )


@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
def test_axis_zero_is_last_axis_of_transpose(rounding, device):
    x = random_spread_within_blocks(512).reshape(64, 256).to(device)
    data, scales = quantize(x, axis=0, rounding=rounding)
    data_t, scales_t = quantize(x.t(), axis=-1, rounding=rounding)
    assert data.shape == (64, 256) and scales.shape == (2, 256)
    assert torch.equal(data.view(torch.uint8), data_t.view(torch.uint8).t())
    assert torch.equal(scales.view(torch.uint8), scales_t.view(torch.uint8).t())
    assert torch.equal(dequantize(data, scales, axis=0), dequantize(data_t, scales_t).t())


def test_middle_axis_of_a_3d_tensor(device):
    x = random_spread_within_blocks(768).reshape(3, 64, 128).to(device)
    data, scales = quantize(x, axis=1)
    data_m, scales_m = quantize(x.transpose(1, 2), axis=-1)
    assert scales.shape == (3, 2, 128)
    assert torch.equal(data.view(torch.uint8), data_m.view(torch.uint8).transpose(1, 2))
    assert torch.equal(scales.view(torch.uint8), scales_m.view(torch.uint8).transpose(1, 2))


@pytest.mark.parametrize("rounding", list(ScaleRounding), ids=lambda r: r.value)
@pytest.mark.parametrize("case", ["random_fp32", "spread_within_blocks", "fp32_extremes", "saturating", "ties"])
def test_quantization_is_idempotent_on_representable_values(case, rounding, device):
    values = dequantize(*quantize(FINITE_CASES[case]().to(device), rounding=rounding))
    # MX values can exceed fp32's range (448 * 2^127 does); those dequantize to inf, past the point.
    values = values[values.isfinite().all(dim=-1)]
    again = dequantize(*quantize(values, rounding=rounding))
    assert torch.equal(again, values)


def test_mxtensor_roundtrip_and_size(device):
    x = random_across_magnitudes(8).reshape(4, 64).to(device)
    mx = MXTensor.from_tensor(x)
    assert mx.nbytes == 4 * 64 + 4 * 2
    assert torch.equal(mx.dequantize(torch.float32), dequantize(*quantize(x)))


@pytest.mark.parametrize(("shape", "axis"), [((0, 64), -1), ((64, 0), 0), ((0, 64), 0), ((3, 0, 5), 1)])
def test_empty_tensors(shape, axis, device):
    # An expert that receives no tokens quantizes a (0, D) activation.
    data, scales = quantize(torch.randn(shape, device=device), axis=axis)
    expected = list(shape)
    expected[axis] //= BLOCK
    assert data.shape == shape and list(scales.shape) == expected
    assert dequantize(data, scales, axis=axis).shape == shape
