"""Under FakeTensorMode (how the projection traces a step) each fused op is one op forward and one op
backward, and none of the eager ops it replaces runs: per op, in a dense model, in the routed
experts' hand-written backward, in an MoE model's dispatch gather and combine, and in its routers."""

import pytest
import torch
from fused_cases import MODEL_CONFIG, case_id, cases, model_batch, run_fused
from op_recording import OpRecorder, model_step_ops
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_engine import ModelConfig, build_model
from moe_engine.config import Precision
from moe_engine.model import cast_parameters
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.permute import ExpertGroups
from moe_engine.moe.router import Router

EXPECTED = {
    "rms_norm": ({"moe_engine::rms_norm": 1, "moe_engine::rms_norm_backward": 1}, {"aten::rsqrt", "aten::mean"}),
    "add_rms_norm": (
        {"moe_engine::add_rms_norm": 1, "moe_engine::rms_norm_backward": 1},
        {"aten::rsqrt", "aten::mean"},
    ),
    "swiglu": ({"moe_engine::swiglu": 1, "moe_engine::swiglu_backward": 1}, {"aten::silu", "aten::silu_backward"}),
    "swiglu_packed": (
        {"moe_engine::swiglu": 1, "moe_engine::swiglu_packed_backward": 1},
        {"aten::silu", "aten::silu_backward"},
    ),
    "linear_cross_entropy": (
        {"moe_engine::linear_cross_entropy": 1, "moe_engine::linear_cross_entropy_backward": 1},
        {"aten::mm", "aten::addmm", "aten::_log_softmax", "aten::logsumexp", "aten::nll_loss_forward"},
    ),
    "rope": ({"moe_engine::rope": 1, "moe_engine::rope_backward": 1}, {"aten::cat", "aten::neg"}),
}
COMPOSITION = set().union(*(forbidden for _, forbidden in EXPECTED.values()))


@pytest.mark.parametrize("case", [c for c in cases() if "one" not in c["name"]], ids=case_id)
def test_each_fused_op_is_one_op_each_way(case):
    with FakeTensorMode() as mode:
        fake_case = {**case, "tensors": {n: mode.from_tensor(t) for n, t in case["tensors"].items()}}
        with OpRecorder() as recorder:
            run_fused(fake_case, torch.bfloat16)
    fused, forbidden = EXPECTED[case["op"]]
    assert recorder.fused() == fused
    assert not forbidden & set(recorder.ops), sorted(forbidden & set(recorder.ops))


def test_dense_model_runs_fused_ops_only():
    """Every norm, activation, rotation and the loss of a step, forward and backward, as fused ops."""
    config = ModelConfig(**{**MODEL_CONFIG, "n_dense_layers": MODEL_CONFIG["n_layers"], "dtype": "bf16"})
    layers = config.n_layers
    recorder = model_step_ops(config)
    norms = layers + 2 * layers + 1  # attention norms, q and k norms, the final norm
    assert recorder.fused() == {
        "moe_engine::rms_norm": norms,
        "moe_engine::add_rms_norm": layers,
        "moe_engine::rms_norm_backward": norms + layers,
        "moe_engine::swiglu": layers,
        "moe_engine::swiglu_backward": layers,
        "moe_engine::rope": 2 * layers,
        "moe_engine::rope_backward": 2 * layers,
        "moe_engine::linear_cross_entropy": 1,
        "moe_engine::linear_cross_entropy_backward": 1,
    }
    # GEMMs remain (the projections'; the LM head's runs inside the fused loss), none of the rest.
    leftover = (COMPOSITION - {"aten::mm"}) & set(recorder.ops)
    assert not leftover, sorted(leftover)


def test_routed_experts_run_the_fused_activation():
    with FakeTensorMode() as mode:
        experts = GroupedExperts(d_model=32, hidden=24, num_experts=4, backend="torch", fused_kernels=True)
        experts = cast_parameters(experts, Precision.BF16)
        x = mode.from_tensor(torch.randn(20, 32, dtype=torch.bfloat16)).requires_grad_()
        groups = ExpertGroups.from_counts(mode.from_tensor(torch.tensor([5, 0, 9, 6])))
        with OpRecorder() as recorder:
            experts(x, groups).sum().backward()
    assert recorder.fused() == {"moe_engine::swiglu": 1, "moe_engine::swiglu_packed_backward": 1}
    assert not {"aten::silu", "aten::silu_backward"} & set(recorder.ops)


ROUTING = {
    "moe_engine::gather_rows",
    "moe_engine::gather_rows_backward",
    "moe_engine::combine_rows",
    "moe_engine::combine_rows_backward",
}


def test_moe_model_runs_the_fused_routing_ops():
    """Each MoE layer's dispatch gather and combine, forward and backward, as the fused routing ops (no
    eager bmm of the combine), next to the other fused ops."""
    config = ModelConfig(**{**MODEL_CONFIG, "dtype": "bf16"})
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    recorder = model_step_ops(config)
    fused = recorder.fused()
    assert {name: fused.get(name) for name in ROUTING} == dict.fromkeys(ROUTING, moe_layers)
    assert fused["moe_engine::swiglu_packed_backward"] == moe_layers
    assert "aten::bmm" not in recorder.ops


def test_moe_model_runs_the_fused_router_op():
    """With fused kernels (the routers built with the config's switch), each MoE layer's scores, weights
    and loss statistics are one op each way: no eager logsumexp or softmax backward (the learned
    selection still takes its top-k of an eager softmax, saving nothing)."""
    config = ModelConfig(**{**MODEL_CONFIG, "dtype": "bf16"})
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    tokens, labels = model_batch()
    with FakeTensorMode() as mode:
        model = build_model(config)
        assert all(module.fused_kernels for module in model.modules() if isinstance(module, Router))
        with OpRecorder() as recorder:
            model.loss(mode.from_tensor(tokens), mode.from_tensor(labels)).backward()
    fused = recorder.fused()
    assert fused["moe_engine::router_scores"] == fused["moe_engine::router_scores_backward"] == moe_layers
    assert not {"aten::logsumexp", "aten::_softmax_backward_data", "aten::gather"} & set(recorder.ops)
