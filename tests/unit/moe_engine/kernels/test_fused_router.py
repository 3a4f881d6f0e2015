"""The router's fused scores (``moe_engine::router_scores`` and its backward): a ``Router`` with
``fused_kernels`` on chooses the same experts and gives the same ``RouterOutput`` and the same gradients
w.r.t. its weight and its input as the same router with the switch off (torch.autograd through the eager
ops, an independent reference), and the op alone equals the eager formulas differentiated by autograd
(its weights, mean probabilities and logsumexp, and the logits' gradient for random gradients of all
three). fp32 (the router computes in fp32), fresh random inputs (the seed is in every failure message;
MOE_KERNEL_SEED repeats it), on the run's device (the reference path on a CPU, Triton on CUDA), within
error-analysis tolerances (``fused_cases.router_tolerances``); under Triton's interpreter in
tests/integration/toolchains/test_fused_router_interpreted.py. A small MoE model with the routers'
switch on runs the op once per MoE layer each way and computes the unfused model's loss and gradients."""

import dataclasses

import pytest
import torch
from fused_cases import (
    MODEL_CONFIG,
    SEED,
    assert_router_matches,
    case_id,
    model_batch,
    router_cases,
    router_op_eager,
    run_router,
)
from op_recording import OpRecorder, saved_while
from tolerances import assert_close_to_scale, model_tolerance

from moe_engine import ModelConfig, build_model, kernels
from moe_engine.kernels import router as router_kernels
from moe_engine.moe.router import Router

OP_NAMES = {"moe_engine::router_scores", "moe_engine::router_scores_backward"}


@pytest.mark.parametrize("case", router_cases(), ids=case_id)
def test_fused_router_equals_eager_router(case, device):
    path = kernels.kernel_paths(device, torch.float32)["router_scores"]
    assert path.implementation == ("triton" if device.type == "cuda" else "reference"), path
    assert_router_matches(run_router(case, fused=True, device=device), case, device, path.details)


def test_flag_off_is_the_eager_router_bit_for_bit(device):
    """A new router has the switch off, runs no fused op, and computes bit for bit the eager chain it ran
    before the switch existed (transcribed here)."""
    import torch.nn.functional as F

    from moe_engine.moe.router import expert_counts, load_balancing_loss, z_loss

    for case in router_cases()[:4]:
        moe = case["params"]["moe"]
        with OpRecorder() as recorder:
            got = run_router(case, fused=False, device=device)
        assert not OP_NAMES & set(recorder.ops)
        t = {n: v.to(device) for n, v in case["tensors"].items()}
        x, weight = t["x"].requires_grad_(), t["router_weight"].requires_grad_()
        logits = F.linear(x.float(), weight.float())
        if moe.get("score_func") == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        w = scores.gather(1, got["expert_TK"])
        if moe.get("normalize_top_k"):
            w = w / w.sum(dim=-1, keepdim=True)
        if moe.get("routed_scaling_factor", 1.0) != 1.0:
            w = w * moe["routed_scaling_factor"]
        counts = expert_counts(got["expert_TK"], moe["num_experts"])
        aux, zl = load_balancing_loss(probs, counts, moe["top_k"]), z_loss(logits)
        loss = moe["aux_loss_weight"] * aux + moe["z_loss_weight"] * zl
        ((w * t["grad_weight_TK"]).sum() + t["grad_loss"] * loss).backward()
        want = {
            "weight_TK": w,
            "counts_E": counts,
            "aux_loss": aux,
            "z_loss": zl,
            "loss": loss,
            "grad_x": x.grad,
            "grad_router_weight": weight.grad,
        }
        for name, value in want.items():
            assert torch.equal(got[name], value.detach()), (case_id(case), name, SEED)


def test_fused_router_keeps_only_the_logits_and_experts(device):
    """The op saves the logits (4 T E bytes) and the experts (8 T k); the eager chain the logits, the
    scores and more. The GEMM's input, saved by F.linear, is the same either way."""
    case = router_cases()[0]
    logits = case["tensors"]["op_logits"].to(device).requires_grad_()
    expert_TK = case["tensors"]["op_expert_TK"].to(device)
    (tokens, experts), top_k = logits.shape, expert_TK.shape[1]
    saved = saved_while(lambda: kernels.router_scores(logits, expert_TK, False, True, 1.0))
    assert len(saved) == 2
    assert saved[0].data_ptr() == logits.data_ptr() and saved[0].shape == (tokens, experts)
    assert saved[1].data_ptr() == expert_TK.data_ptr()
    assert sum(t.numel() * t.element_size() for t in saved) == 4 * tokens * experts + 8 * tokens * top_k
    eager = saved_while(lambda: router_op_eager(case, device))
    assert sum(t.numel() * t.element_size() for t in eager if t.is_floating_point()) >= 8 * tokens * experts


def test_router_path_rules():
    assert router_kernels.path("cuda").details == "triton (CUDA)"
    assert router_kernels.path("cuda", torch.float32, router_kernels.MAX_EXPERTS).fused
    wide = router_kernels.path("cuda", torch.float32, router_kernels.MAX_EXPERTS + 1)
    assert (
        not wide.fused and f"rows of {router_kernels.MAX_EXPERTS + 1} experts exceed the kernel's 256" in wide.details
    )
    half = router_kernels.path("cuda", torch.bfloat16)
    assert not half.fused and "float32 logits (the router computes in fp32), not bfloat16" in half.details
    assert router_kernels.path("cpu").details == "reference: the Triton kernel runs on CUDA devices, not cpu"
    # The router's logits are fp32 in a model of any dtype.
    assert kernels.kernel_paths("cuda", torch.bfloat16)["router_scores"].fused


def _moe_config(**moe) -> ModelConfig:
    config = ModelConfig(**MODEL_CONFIG)
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe))


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {
            "score_func": "sigmoid",
            "normalize_top_k": True,
            "routed_scaling_factor": 2.5,
            "routing": "skewed",
            "z_loss_weight": 0.01,
        },
    ],
    ids=["softmax-learned", "sigmoid-normalised-scaled-skewed"],
)
def test_fused_moe_model_runs_the_router_op_and_equals_unfused(moe, device):
    """fp32, on the run's device: with fused kernels every router (built with the config's switch) runs
    the router op once per MoE layer each way, and no eager logsumexp or softmax backward, with the
    unfused model's loss and gradients."""
    config = _moe_config(**moe)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    tokens, labels = (t.to(device) for t in model_batch(vocab=config.vocab_size))
    results = {}
    for fused in (True, False):
        model = build_model(dataclasses.replace(config, fused_kernels=fused), device, seed=7)
        routers = [m for m in model.modules() if isinstance(m, Router)]
        assert len(routers) == moe_layers
        assert all(router.fused_kernels is fused for router in routers)
        with OpRecorder() as recorder:
            loss = model.loss(tokens, labels)
            loss.backward()
        ran = {n: c for n, c in recorder.fused().items() if n in OP_NAMES}
        assert ran == (dict.fromkeys(OP_NAMES, moe_layers) if fused else {})
        if fused:
            assert not {"aten::logsumexp", "aten::_softmax_backward_data", "aten::sigmoid_backward"} & set(recorder.ops)
        results[fused] = (loss.detach(), {name: p.grad for name, p in model.named_parameters()})
    (fused_loss, fused_grads), (loss, grads) = results[True], results[False]
    assert_close_to_scale(
        fused_loss, loss, model_tolerance(config, tokens.numel(), gradients=False), msg=f"loss, seed {SEED}"
    )
    tol = model_tolerance(config, tokens.numel())
    for name, grad in grads.items():
        assert fused_grads[name] is not None, name
        assert_close_to_scale(fused_grads[name], grad, tol, msg=f"{name}, seed {SEED}")


def test_router_ops_are_priced_as_one_pass_each():
    """bench.predict.fused_ops's rules by hand: T 10 tokens, E 40, k 4."""
    from bench.predict.ops import TensorSpec, TracedOp, op_work

    def spec(*shape, dtype="torch.float32"):
        return TensorSpec(tuple(shape), dtype)

    logits, expert = spec(10, 40), spec(10, 4, dtype="torch.int64")
    weight, mean_probs, lse = spec(10, 4), spec(40), spec(10)
    forward = op_work(
        TracedOp("moe_engine.router_scores.default", (logits, expert), (weight, mean_probs, lse), "forward")
    )
    # One pass, and torch's sum of the per-program partial rows (a launch).
    assert (forward.kind, forward.kernels, forward.flops) == ("fused", 2, 0.0)
    assert forward.nbytes == 10 * 40 * 4 + 10 * 4 * 8 + 10 * 4 * 4 + 40 * 4 + 10 * 4
    backward = op_work(
        TracedOp(
            "moe_engine.router_scores_backward.default",
            (weight, mean_probs, lse, logits, expert),
            (logits,),
            "backward",
        )
    )
    assert (backward.kind, backward.kernels) == ("fused", 1)
    assert backward.nbytes == 10 * 4 * 4 + 40 * 4 + 10 * 4 + 10 * 40 * 4 + 10 * 4 * 8 + 10 * 40 * 4
