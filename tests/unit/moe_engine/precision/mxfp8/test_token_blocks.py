"""MXFP8 operands blocked along tokens within each expert's rows: the torch composition against a
per-expert reading of the specification (each expert's rows zero-padded to 32 and quantized along axis 0
by ``blocks.quantize``), byte for byte; its dequantization; the block count's bound. The Triton kernel
against the composition under Triton's interpreter: tests/integration/toolchains/test_mxfp8_wgrad_interpreted.py."""

import random

import pytest
import torch
from mxfp8_wgrad_cases import CASES, dequantized_per_expert, expert_blocks, token_operand

from moe_engine.precision.mxfp8.token_blocks import (
    block_ends,
    max_blocks,
    quantize_token_blocks,
    quantize_token_blocks_reference,
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_codes_and_scales_are_those_of_each_experts_padded_rows(name, dtype):
    counts, padding, width, _ = CASES[name]
    t_NK, offsets_E = token_operand(counts, padding, width, dtype, seed=len(name))
    blocked = quantize_token_blocks(t_NK, offsets_E)
    n = sum(counts)
    assert blocked.data_NK.shape == t_NK.shape and blocked.data_NK.dtype == torch.float8_e4m3fn
    assert blocked.scales_BK.shape == (max_blocks(t_NK.shape[0], len(counts)), width)
    start, first_block = 0, 0
    for count, (data, scales) in zip(counts, expert_blocks(t_NK, counts)):
        assert torch.equal(_bytes(blocked.data_NK[start : start + count]), _bytes(data))
        assert torch.equal(_bytes(blocked.scales_BK[first_block : first_block + scales.shape[0]]), _bytes(scales))
        start, first_block = start + count, first_block + scales.shape[0]
    assert torch.equal(
        blocked.block_ends_E, torch.tensor(counts).add(31).div(32, rounding_mode="floor").cumsum(0).int()
    )
    # The padding rows (NaN) are no block's: zero codes; the unused scale rows are those of empty blocks.
    assert not _bytes(blocked.data_NK[n:]).any()
    assert not _bytes(blocked.scales_BK[first_block:]).any()


def test_nan_and_inf_make_their_block_nan_scaled_as_blocks_quantize_does():
    counts = [40, 9]
    t_NK, offsets_E = token_operand(counts, 0, 32, torch.float32, seed=3)
    t_NK[5, 3] = float("nan")  # expert 0, block 0
    t_NK[45, 7] = float("inf")  # expert 1, its only block
    blocked = quantize_token_blocks(t_NK, offsets_E)
    (data0, scales0), (data1, scales1) = expert_blocks(t_NK, counts)
    assert _bytes(blocked.scales_BK)[0, 3] == 0xFF and _bytes(blocked.scales_BK)[2, 7] == 0xFF
    assert torch.equal(_bytes(blocked.scales_BK[:3]), _bytes(torch.cat([scales0, scales1])))
    assert torch.equal(_bytes(blocked.data_NK), _bytes(torch.cat([data0, data1])))


def test_blocks_do_not_straddle_experts():
    """A block over the rows as they lie (every 32 rows from row 0) would share a scale between two
    experts: its codes differ where an expert's range differs from its neighbour's."""
    g = torch.Generator().manual_seed(7)
    t_NK = torch.randn(50, 32, generator=g)
    t_NK[20:] *= 1000.0  # expert 1 is much larger: in a shared block, expert 0's rows would round to zero
    offsets_E = torch.tensor([20, 50], dtype=torch.int32)
    blocked = quantize_token_blocks(t_NK, offsets_E)
    assert torch.equal(blocked.block_ends_E, torch.tensor([1, 2], dtype=torch.int32))
    values = blocked.dequantize(torch.float32)
    # Expert 0's own blocks (column maxima 0.4 to 3.5, scales 2^-9 to 2^-7): rounding to E4M3 is off by at
    # most 2^-4 relative, saturation at 448 (the specification's floor scale) by 2^-3; the subnormals'
    # steps are at most 2^-16. A block shared with expert 1 (scale 2^3) rounds expert 0's values below
    # 2^-3 in steps of 2^-6.
    assert ((values[:20] - t_NK[:20]).abs() <= 2**-3 * t_NK[:20].abs() + 2**-16).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_gives_each_experts_values(dtype):
    counts, padding, width, _ = CASES["uneven"]
    t_NK, offsets_E = token_operand(counts, padding, width, dtype, seed=11)
    values = quantize_token_blocks(t_NK, offsets_E).dequantize(torch.float64)
    assert torch.equal(values, dequantized_per_expert(t_NK, counts))


def test_padding_rows_dequantize_to_zero_whatever_their_codes():
    """The Triton kernel leaves the codes of rows past the last offset unwritten: any bytes there (NaN
    codes included) dequantize to 0."""
    t_NK, offsets_E = token_operand([9, 40], 3, 32, torch.float32, seed=2)
    blocked = quantize_token_blocks(t_NK, offsets_E)
    clean = blocked.dequantize(torch.float32)
    _bytes(blocked.data_NK)[49:] = 0x7F  # an E4M3 NaN
    assert torch.equal(blocked.dequantize(torch.float32), clean)
    assert not clean[49:].any()


def test_max_blocks_bounds_every_split():
    rng = random.Random(20261206)
    for _ in range(2000):
        experts = rng.randint(1, 9)
        counts = [rng.choice([0, 1, 31, 32, 33, rng.randint(0, 200)]) for _ in range(experts)]
        rows = sum(counts) + rng.randint(0, 40)
        needed = sum(-(-c // 32) for c in counts)
        assert needed <= max_blocks(rows, experts), (counts, rows)
        ends = block_ends(torch.tensor(counts).cumsum(0).int())
        assert ends[-1].item() == needed
    # Tight: E experts of one row each need E blocks.
    assert max_blocks(5, 5) == 5


def test_rejects_what_it_cannot_block():
    with pytest.raises(ValueError, match="int32 offsets"):
        quantize_token_blocks(torch.randn(4, 8), torch.tensor([4]))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        quantize_token_blocks(torch.ones(4, 8, dtype=torch.float16), torch.tensor([4], dtype=torch.int32))


def test_the_composition_is_the_cpu_path():
    t_NK, offsets_E = token_operand([9, 40], 2, 32, torch.bfloat16, seed=5)
    a, b = quantize_token_blocks(t_NK, offsets_E), quantize_token_blocks_reference(t_NK, offsets_E)
    assert torch.equal(_bytes(a.data_NK), _bytes(b.data_NK)) and torch.equal(_bytes(a.scales_BK), _bytes(b.scales_BK))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cuda_kernel_writes_the_compositions_bytes(name, dtype):
    counts, padding, width, _ = CASES[name]
    t_NK, offsets_E = token_operand(counts, padding, width, dtype, seed=len(name))
    kernel = quantize_token_blocks(t_NK.cuda(), offsets_E.cuda())
    reference = quantize_token_blocks_reference(t_NK, offsets_E)
    n = sum(counts)  # the kernel leaves the padding rows' codes unwritten
    assert torch.equal(_bytes(kernel.data_NK[:n]).cpu(), _bytes(reference.data_NK[:n]))
    assert torch.equal(_bytes(kernel.scales_BK).cpu(), _bytes(reference.scales_BK))
