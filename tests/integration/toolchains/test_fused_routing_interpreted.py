"""The routing ops (``moe_engine::gather_rows``, ``combine_rows`` and their backwards) through the Triton
kernels, run by Triton's interpreter on CPU tensors in a fresh process under TRITON_INTERPRET=1
(``interpreted_kernels.run_interpreted``), equal the eager composition of ``moe.permute`` differentiated
by autograd, forward and backward, in fp32 and bf16, on fresh random inputs (the seed is in every
failure message): bit for bit where the arithmetic is the same (``fused_cases.tolerances``)."""

import pytest
from fused_cases import DTYPES, ROUTING_OPS, assert_matches_eager, case_id, routing_cases, run_eager
from interpreted_kernels import run_interpreted


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("routing_interpreter"), {"routing_cases": routing_cases()})


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_interpreter_ran_the_routing_kernels(interpreted, dtype):
    assert all(interpreted["paths"][dtype][op] == "triton" for op in ROUTING_OPS), interpreted["paths"][dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", routing_cases(), ids=case_id)
def test_interpreted_routing_kernels_equal_eager_composition(interpreted, case, dtype):
    got = interpreted["routing"][case_id(case), dtype]
    assert_matches_eager(got, run_eager(case, DTYPES[dtype]), case, DTYPES[dtype], "Triton interpreter")
