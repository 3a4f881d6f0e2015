"""The MXFP8 quantizer's inputs (random magnitudes and bit patterns, every bf16, the special blocks: ties,
saturation, subnormals, NaN and Inf, other axes and block sizes) and the byte comparison against
``mxfp8.quantize``: shared by the CUDA tests (tests/unit/moe_engine/precision/mxfp8/test_kernels.py) and
the interpreted run (tests/integration/toolchains/test_mxfp8_kernels_interpreted.py)."""

import torch

from moe_engine.precision.mxfp8.blocks import ScaleRounding, quantize

BLOCK = 32
ROUNDINGS = list(ScaleRounding)


def bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 tensor from int64 bit patterns in [0, 2^32)."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def random_bits_near_block_exponent(g: torch.Generator, n_blocks: int) -> torch.Tensor:
    """Random fp32 bits within 30 binades of a random block exponent (fp32 subnormals included)."""
    top = torch.randint(1, 255, (n_blocks, 1), generator=g)
    exponent = (top - torch.randint(0, 30, (n_blocks, BLOCK), generator=g)).clamp(min=0)
    mantissa = torch.randint(0, 2**23, (n_blocks, BLOCK), generator=g)
    sign = torch.randint(0, 2, (n_blocks, BLOCK), generator=g)
    return bits_to_float((sign << 31) | (exponent << 23) | mantissa)


def special_blocks() -> torch.Tensor:
    """Zeros (both signs), saturation, ties between E4M3 values, subnormals, fp32 extremes, NaN and Inf."""
    rows = torch.zeros(12, BLOCK)
    rows[1] = -0.0
    rows[2, :6] = torch.tensor([511.0, 464.0, 460.0, 479.0, 480.0, -500.0])  # saturation, the tie 464
    rows[3] = torch.arange(BLOCK) * 2.0**-10 + 2.0**-11  # subnormals and halfway points, shared exponent 0
    rows[3, -1] = 256.0
    rows[4] = torch.arange(BLOCK) * 2.0**-3 + 2.0**-4 + 8  # halfway points among normals
    rows[4, -1] = -256.0
    rows[5] = torch.linspace(-3.4e38, 3.4e38, BLOCK)
    rows[6] = torch.linspace(-1e-40, 1e-40, BLOCK)  # fp32 subnormals only
    rows[7] = torch.linspace(-1, 1, BLOCK) * 2.0**-118
    for row, bad in zip((8, 9, 10, 11), (float("nan"), -float("nan"), float("inf"), -float("inf"))):
        rows[row] = torch.linspace(-5, 7, BLOCK)
        rows[row, 3] = bad
    rows[11, 9] = float("nan")  # Inf and NaN together
    return rows


def cases() -> dict[str, tuple[torch.Tensor, int, int]]:
    """name -> (input, axis, block)."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.randn(64, BLOCK, generator=g) * 10.0 ** torch.randint(-30, 31, (64, 1), generator=g)
    all_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return {
        "random_fp32": (magnitudes, -1, BLOCK),
        "random_bf16": (magnitudes.bfloat16(), -1, BLOCK),
        "random_fp16": ((magnitudes / magnitudes.abs().amax(-1, keepdim=True) * 1e4).half(), -1, BLOCK),
        "random_bits": (random_bits_near_block_exponent(g, 256), -1, BLOCK),
        "any_bits_with_nan_inf": (bits_to_float(torch.randint(0, 2**32, (64, BLOCK), generator=g)), -1, BLOCK),
        "special": (special_blocks(), -1, BLOCK),
        "every_bf16": (all_bf16.reshape(-1, 256), -1, BLOCK),
        "axis0": (random_bits_near_block_exponent(g, 64).reshape(64, 32), 0, BLOCK),
        "axis0_bf16": (magnitudes.reshape(128, 16).bfloat16(), 0, BLOCK),
        "axis1_of_3d": (random_bits_near_block_exponent(g, 48).reshape(2, 96, 8), 1, BLOCK),
        # inner 200: two tiles of neighbouring blocks, the second one partly masked.
        "axis1_inner_200_bf16": (random_bits_near_block_exponent(g, 400).reshape(2, 32, 200).bfloat16(), 1, BLOCK),
        "non_contiguous": (magnitudes.reshape(32, 64).t(), -1, BLOCK),
        "block16": (magnitudes, -1, 16),
        "block24_padded_lanes": (magnitudes.reshape(64, 32)[:, :24], -1, 24),
        "empty": (torch.empty(0, 64), -1, BLOCK),
    }


def codes(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    return data.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()


def assert_same_bytes(got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, axis: int, block: int, rounding):
    data, scales = got
    ref_data, ref_scales = codes(*quantize(x.cpu(), axis, block, rounding))
    assert data.shape == ref_data.shape and scales.shape == ref_scales.shape
    bad_scales = (scales != ref_scales).nonzero()
    assert len(bad_scales) == 0, f"{len(bad_scales)} scale codes differ, first at {bad_scales[:3].tolist()}"
    bad = (data != ref_data).nonzero()
    if len(bad):
        at = tuple(bad[0].tolist())
        raise AssertionError(
            f"{len(bad)} data codes differ; first at {at}: input {x[at].item()!r}, "
            f"got {data[at].item():#04x}, torch {ref_data[at].item():#04x}"
        )
