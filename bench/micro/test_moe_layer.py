"""One MoE layer forward+backward in bf16 against a dense SwiGLU of exactly the same FLOPs.

Shapes follow the project's reference measurement: 4096 tokens, d_model 1024, expert hidden 512,
64 experts, top-8, random routing. The dense chain maps D -> k*F -> D over the same tokens, so its
FLOPs equal the layer's expert FLOPs (the router, as in the FLOP convention, is not counted).

On a CPU without bf16 arithmetic both run their GEMMs in fp32 (``moe_engine.precision.cpu_bf16``),
as ``moe-bench run`` times bf16 there: natively each step would take over ten seconds in a generic loop.
"""

from __future__ import annotations

import pytest
import torch

from moe_engine.config import MoEConfig, Precision, RoutingMode
from moe_engine.flops import dense_ffn_training_flops_per_token, moe_ffn_training_flops_per_token
from moe_engine.model import cast_parameters
from moe_engine.modules.mlp import SwiGLU
from moe_engine.moe.layer import MoELayer
from moe_engine.precision.cpu_bf16 import bf16_gemms_in_fp32

# Full-size layers, run once as smoke tests: seconds each (the fast lane leaves them to CI).
pytestmark = pytest.mark.slow

TOKENS, D_MODEL, EXPERT_HIDDEN = 4096, 1024, 512
ROUNDS = 5


def _init(module: torch.nn.Module, device) -> torch.nn.Module:
    torch.manual_seed(0)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.02)
    return cast_parameters(module, Precision.BF16).to(device)


def _measure(benchmark, module, device):
    x = torch.randn(TOKENS, D_MODEL, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        module.zero_grad(set_to_none=True)
        with bf16_gemms_in_fp32(device, torch.bfloat16):
            module(x).backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2, iterations=1)


def _moe(num_experts: int, top_k: int) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=EXPERT_HIDDEN, routing=RoutingMode.RANDOM)


@pytest.mark.parametrize("num_experts, top_k", [(64, 8)], ids=["E64-k8"])
def test_moe_layer(benchmark, bench_device, num_experts, top_k):
    moe = _moe(num_experts, top_k)
    benchmark.extra_info.update(
        flops=TOKENS * moe_ffn_training_flops_per_token(D_MODEL, moe), tokens=TOKENS, device=str(bench_device)
    )
    _measure(benchmark, _init(MoELayer(D_MODEL, moe), bench_device), bench_device)


def test_dense_swiglu_same_flops(benchmark, bench_device):
    hidden = 8 * EXPERT_HIDDEN
    assert dense_ffn_training_flops_per_token(D_MODEL, hidden) == moe_ffn_training_flops_per_token(D_MODEL, _moe(64, 8))
    benchmark.extra_info.update(
        flops=TOKENS * dense_ffn_training_flops_per_token(D_MODEL, hidden), tokens=TOKENS, device=str(bench_device)
    )
    _measure(benchmark, _init(SwiGLU(D_MODEL, hidden), bench_device), bench_device)


@pytest.mark.parametrize("num_experts", [8, 128], ids=["E8-k4", "E128-k4"])
def test_expert_count(benchmark, bench_device, num_experts):
    """Same active work per token (top-4), 16x more experts: grouped GEMM should hide the difference."""
    moe = _moe(num_experts, 4)
    benchmark.extra_info.update(
        flops=TOKENS * moe_ffn_training_flops_per_token(D_MODEL, moe), tokens=TOKENS, device=str(bench_device)
    )
    _measure(benchmark, _init(MoELayer(D_MODEL, moe), bench_device), bench_device)
