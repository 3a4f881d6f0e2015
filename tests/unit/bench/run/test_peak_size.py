"""The CPU peak measurement sizes its matmul by time, so a core without bf16 units does not spend
minutes on it (one 4096 bf16 product took over two minutes on a 2-core AMD EPYC without AVX512-BF16)."""

import pytest

from bench.run.execute import PEAK_MATMUL_SIZES, peak_matmul_size


def at_rate(flops_per_s: float):
    return lambda n: 2 * n**3 / flops_per_s


@pytest.mark.parametrize(
    "rate, size",
    [
        (1e9, 512),  # 256: 34 ms, 512: 0.27 s
        (50e9, 2048),  # 1024: 43 ms, 2048: 0.34 s
        (340e9, 4096),  # 2048: 51 ms, 4096: 0.40 s
        (5e15, 4096),  # nothing reaches 0.1 s: the largest
        (1e6, 256),  # the smallest already takes 34 s
    ],
)
def test_the_first_size_that_takes_a_tenth_of_a_second(rate, size):
    assert peak_matmul_size(at_rate(rate)) == size


def test_sizes_are_tried_smallest_first_and_no_further_than_needed():
    tried = []

    def seconds_of(n):
        tried.append(n)
        return 1.0 if n >= 1024 else 0.0

    assert peak_matmul_size(seconds_of) == 1024
    assert tried == [n for n in PEAK_MATMUL_SIZES if n <= 1024]
