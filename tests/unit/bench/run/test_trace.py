"""A step traced under fake tensors has the ops of the same step run for real: same ops, shapes,
dtypes, stages and rows per expert group (the routing replayed by the shadows)."""

from __future__ import annotations

import pytest

from bench.predict.ops import op_kind, op_work
from bench.run.project import traced_scenario
from bench.run.trace import UntraceableStep, trace_step
from bench.scenario import load_scenario, scenario_from_dict
from moe_engine.flops import training_flops_per_token

LAYOUTS = [
    "e8-dp2-bf16",  # dp, buckets
    "e8-dp2-zero1-bf16",  # reduce-scatter + gathers in the optimizer
    "e8-ep2-nosync-bf16",  # capacity buffers, peers' counts replayed
    "e8-ep2-sync-bf16",  # uneven split sizes read on the host
    "e8-pp2-1f1b-bf16",  # a pipeline stage
    "e8-pp2-ep2-bf16",
    "e64-skewed-bf16",  # skewed routes
    "e8-random-mxfp8",  # the MXFP8 regions
    "e8-random-bf16-recompute-full",
    "e8-dp2-fsdp-bf16",  # FSDP2: the real build path, its gathers on the fake world
]


def _kernels(trace):
    # Views and host reads dispatch differently on fake and real tensors; kernels do not.
    return [op.signature() for op in trace.ops if op_kind(op) != "free"]


@pytest.mark.parametrize(
    "name",
    # The fast lane keeps the first layouts; the rest (a few seconds each) run in CI.
    [pytest.param(n, marks=pytest.mark.slow) if i >= 3 else n for i, n in enumerate(LAYOUTS)],
)
def test_fake_trace_has_the_ops_of_the_real_step(name):
    scenario = load_scenario(f"scenarios/smoke/{name}.yaml")
    rank = scenario.world_size - 1  # the last rank: the last pipeline stage, the last ep rank
    real = trace_step(scenario, rank=rank, fake=False)
    fake = trace_step(scenario, rank=rank, fake=True)
    assert _kernels(fake) == _kernels(real)
    grouped = [op for op in fake.ops if op.name == "aten._grouped_mm.default"]
    assert grouped and all(op.group_rows is not None for op in grouped)
    stages = {op.stage for op in fake.ops}
    assert {"forward", "backward", "optimizer"} <= stages
    # Each op where it runs: attention's backward kernel in the backward, Adam's update in the optimizer.
    assert {op.stage for op in fake.ops if op.name.endswith("attention_for_cpu_backward.default")} == {"backward"}
    assert {op.stage for op in fake.ops if op.name.endswith("attention_for_cpu.default")} <= {"forward", "backward"}
    # The foreach update where the optimizer is build_adamw's, the per-parameter one under FSDP2.
    updates = ("aten._foreach_addcdiv_", "aten.addcdiv_")
    assert {op.stage for op in fake.ops if op.name.startswith(updates)} == {"optimizer"}


def test_learned_routes_are_unknown_to_a_fake_trace_but_the_ops_match():
    scenario = load_scenario("scenarios/smoke/e8-learned-bf16.yaml")
    real, fake = trace_step(scenario, fake=False), trace_step(scenario, fake=True)
    strip = lambda sig: sig[:-1]
    assert [strip(s) for s in _kernels(fake)] == [strip(s) for s in _kernels(real)]
    assert all(op.group_rows is None for op in fake.ops if op.name == "aten._grouped_mm.default")
    assert all(op.group_rows is not None for op in real.ops if op.name == "aten._grouped_mm.default")


def test_sync_dispatch_under_learned_routing_cannot_be_traced():
    spec = load_scenario("scenarios/smoke/e8-ep2-sync-bf16.yaml").spec
    spec["routing"]["mode"] = "learned"
    with pytest.raises(UntraceableStep, match="learned routing"):
        trace_step(scenario_from_dict(spec), fake=True)


def test_traced_matmul_flops_match_the_flops_formula():
    # The formula (Megatron's convention) leaves out the router (2 T D E forward, 4 T D E backward)
    # and the combine's weighted sum of each token's k expert outputs (a (1 x k) @ (k x D) product per
    # token: 2 T k D forward, 4 T k D backward), and counts attention's backward as twice its
    # forward, where the fused kernel recomputes the scores: 2.5 times. The traced step must hold
    # exactly those on top.
    scenario = _fused("e8-random-bf16", on=False)  # the fused loss adds 2 N V D: see below
    model = scenario.model
    trace = trace_step(scenario, fake=True)
    counted = sum(op_work(op).flops for op in trace.ops if op_work(op).kind in ("gemm", "grouped_gemm", "attention"))
    tokens, d, e, layers = scenario.run.tokens_per_step, model.d_model, model.moe.num_experts, model.n_layers
    sequences, s = tokens // model.seq_len, model.seq_len
    router = 6 * tokens * d * e * layers
    combine = 6 * tokens * model.moe.top_k * d * layers
    attention_forward = 4 * sequences * model.n_heads * s * s * model.head_dim / 2 * layers
    formula = training_flops_per_token(model) * tokens
    assert counted == pytest.approx(formula + router + combine + 0.5 * attention_forward, rel=1e-9)


@pytest.mark.slow
def test_a_full_size_rank_traces_without_allocating_it():
    # 47B on 8 ranks: the rank's parameters alone are ~40 GB; one microbatch of 16k tokens.
    scenario = traced_scenario(load_scenario("scenarios/olmo-core3/moe-128e-47b.yaml"), 1)
    trace = trace_step(scenario, fake=True)
    grouped = [op for op in trace.ops if op.name == "aten._grouped_mm.default" and op.stage == "forward"]
    # 16 local experts per MoE block; each receives about 16384 * 4 / 128 * 8 = 4096 rows (random routing).
    rows = [r for op in grouped for r in op.group_rows]
    assert len(grouped[0].group_rows) == 16
    assert 3500 < sum(rows) / len(rows) < 4700


def _fused(name: str, on: bool = True):
    spec = load_scenario(f"scenarios/smoke/{name}.yaml").spec
    spec["model"]["fused_kernels"] = on
    return scenario_from_dict(spec)


@pytest.mark.parametrize("name", ["e8-random-bf16", pytest.param("e8-pp2-1f1b-bf16", marks=pytest.mark.slow)])
def test_fused_kernels_trace_as_they_run_and_price_the_loss_gemms(name):
    scenario = _fused(name)
    rank = scenario.world_size - 1  # the last stage computes the loss
    real = trace_step(scenario, rank=rank, fake=False)
    fake = trace_step(scenario, rank=rank, fake=True)
    assert _kernels(fake) == _kernels(real)
    losses = [op for op in fake.ops if op.packet == "moe_engine.linear_cross_entropy"]
    assert losses and all(dict(op.arguments).get("chunk_rows", 0) > 0 for op in losses)
    assert {op.packet for op in fake.ops} >= {
        "moe_engine.rms_norm",
        "moe_engine.swiglu",
        "moe_engine.linear_cross_entropy_backward",
    }
    # Against the same step unfused: the LM head's three products (6 N V D) are now inside the fused
    # loss, which recomputes the logits once more in its backward: 2 N V D more FLOPs, N the step's
    # tokens on this stage.
    plain = trace_step(_fused(name, on=False), rank=rank, fake=True)
    model = scenario.model
    extra = 2 * scenario.run.tokens_per_step * model.vocab_size * model.d_model
    flops = lambda trace: sum(op_work(op).flops for op in trace.ops)
    assert flops(fake) == pytest.approx(flops(plain) + extra, rel=1e-9)
