"""The router's fused scores (``moe_engine::router_scores`` and its backward) through the Triton kernels,
run by Triton's interpreter on CPU tensors in a fresh process under TRITON_INTERPRET=1
(``interpreted_kernels.run_interpreted``): the same experts, ``RouterOutput`` and gradients as the router
with the switch off, and the op alone equals the eager formulas differentiated by autograd, within
error-analysis tolerances (``fused_cases.router_tolerances``; the seed is in every failure message)."""

import pytest
import torch
from fused_cases import assert_router_matches, case_id, router_cases
from interpreted_kernels import run_interpreted


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("router_interpreter"), {"router_cases": router_cases()})


def test_interpreter_ran_the_router_kernels(interpreted):
    assert interpreted["paths"]["fp32"]["router_scores"] == "triton"
    assert interpreted["router_ran"] == "triton"


@pytest.mark.parametrize("case", router_cases(), ids=case_id)
def test_interpreted_router_kernels_equal_eager_router(interpreted, case):
    assert_router_matches(interpreted["router"][case_id(case)], case, torch.device("cpu"), "Triton interpreter")
