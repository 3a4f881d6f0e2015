"""Ops that run once per step inside the backward (a gradient bucket's 1/dp scaling as its reduction
launches) count once, not once per microbatch: by hand, and as the same projection whatever the number
of microbatches traced."""

from __future__ import annotations

import pytest

from bench.predict.collectives import Network
from bench.predict.device import load_profile
from bench.predict.op_projection import ONCE_PER_STEP, project_priced_step, runs_every_microbatch, step_prices
from bench.predict.ops import OpWork, TensorSpec, TracedOp
from bench.predict.pricing import PricedOp, price_ops
from bench.predict.projection import Schedule
from bench.run.project import traced_scenario
from bench.run.trace import trace_step
from bench.scenario import scenario_from_dict

X = (TensorSpec((4,), "torch.float32"),)


def priced(name, stage, seconds, location="Transformer/Linear", collective=None):
    kind = "collective" if collective else "memory"
    op = TracedOp(name, X, X, stage, location=location, collective=collective)
    return PricedOp(op, OpWork(kind, 0.0, 16.0, "torch.float32"), seconds)


def test_which_ops_run_once_per_step():
    add = TracedOp("aten.add_.Tensor", X, X, "backward", location="@accumulate_grad")
    div = TracedOp("aten.div_.Tensor", X, X, "backward", location="@accumulate_grad")
    assert runs_every_microbatch(add) and not runs_every_microbatch(div)
    # A division of the model's own, in the forward or backward, runs every microbatch.
    assert runs_every_microbatch(TracedOp("aten.div_.Tensor", X, X, "backward", location="Transformer/Block/RMSNorm"))
    assert not runs_every_microbatch(TracedOp("aten.div_.Tensor", X, X, "optimizer", location="@grad_sync"))
    assert ("@accumulate_grad", "aten.div_") in ONCE_PER_STEP


def test_the_bucket_scaling_counts_once_by_hand():
    # Two microbatches traced of m = 8; each backward accumulates its gradients (0.25 s); the second
    # launches one bucket: its scaling (0.5 s) and its reduction of 1e9 bytes over 2 ranks at 1 GB/s
    # (2 (n-1)/n B / beta = 1 s), issued with 0.75 s of backward still to run.
    reduce = {"op": "all_reduce", "ranks": [0, 1], "nbytes": 10**9, "group_name": "dp"}
    trace = [
        priced("aten.mm.default", "forward", 1.0),
        priced("aten.mm.default", "backward", 2.0),
        priced("aten.add_.Tensor", "backward", 0.25, "@accumulate_grad"),
        priced("aten.mm.default", "forward", 1.0),
        priced("aten.mm.default", "backward", 1.25),
        priced("aten.add_.Tensor", "backward", 0.25, "@accumulate_grad"),
        priced("aten.div_.Tensor", "backward", 0.5, "@accumulate_grad"),
        priced("c10d.allreduce_.default", "backward", 0.0, "@accumulate_grad", reduce),
        priced("aten.mm.default", "backward", 0.75),
        priced("aten.lerp_.Scalar", "optimizer", 0.4, "@optimizer"),
    ]
    prices = step_prices(trace, 2, {"dp": "grad"})
    microbatch_s = (1 + 2 + 0.25 + 1 + 1.25 + 0.25 + 0.75) / 2  # 3.25
    assert prices.timing.microbatch_s == pytest.approx(microbatch_s)
    assert prices.timing.optimizer_s == pytest.approx(0.4 + 0.5)
    assert prices.once_per_step_s == pytest.approx(0.5)
    assert [b.window_s for b in prices.grad_buckets] == pytest.approx([0.75])
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=8, kind="1f1b")
    net = Network(gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
    projection = project_priced_step(prices, 0, schedule, net, 1024, 2, 1e6)
    # 8 microbatches of 3.25 s, the reduction's 1 s of which 0.75 s hidden, the optimizer 0.4 s and the
    # scaling 0.5 s once: 26 + 0.25 + 0.9.
    assert projection.step_s == pytest.approx(8 * 3.25 + 0.25 + 0.9)
    (stated,) = [a for a in projection.assumptions if "once per step" in a]
    assert "500.000 ms" in stated


# Data parallel over 2 ranks with experts over both, 4 microbatches of one 32-token sequence per rank,
# balanced routes: every microbatch runs the same ops at the same sizes.
SCENARIO = {
    "schema_version": 1,
    "name": "buckets",
    "mode": "proxy",
    "model": {
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96},
    },
    "routing": {"mode": "balanced", "seed": 0},
    "precision": "bf16",
    "parallel": {"dp": 2, "ep": 2, "microbatches": 4, "dispatch": "no-sync", "capacity_factor": 1.25},
    "run": {"tokens_per_step": 2 * 4 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 0, "threads": 1},
    "cluster": {"gpus": 2, "gpus_per_node": 2, "gpu_memory_gib": 1, "peak_tflops": 1},
}


@pytest.mark.parametrize("sharding", ["none", pytest.param("zero1", marks=pytest.mark.slow)])
def test_the_projection_does_not_depend_on_the_microbatches_traced(sharding):
    scenario = scenario_from_dict({**SCENARIO, "parallel": {**SCENARIO["parallel"], "optimizer_sharding": sharding}})
    b300 = load_profile("b300")
    prices, per_microbatch_s, once_s = {}, {}, {}
    for traced in (2, 3):
        trace = trace_step(traced_scenario(scenario, traced), rank=0)
        scalings = [o for o in trace.ops if o.stage == "backward" and not runs_every_microbatch(o)]
        # One scaling per bucket (divisor dp = 2), all in the last backward, whatever was traced.
        assert scalings and all(o.packet == "aten.div_" for o in scalings)
        priced_ops = price_ops(trace.ops, b300)
        prices[traced] = step_prices(priced_ops, traced, trace.group_phases)
        # The trainer's mean of the step's losses (a stack of the m_t losses, then its mean, outside
        # the model) also runs once per step, and is still counted per microbatch: take it out here.
        average = [
            p
            for p in priced_ops
            if p.op.location == ""
            and p.op.stage == "forward"
            and (
                (p.op.packet == "aten.stack" and [s.shape for s in p.op.inputs] == [()] * traced)
                or (p.op.packet == "aten.mean" and [s.shape for s in p.op.inputs] == [(traced,)])
            )
        ]
        assert len(average) == 2
        per_microbatch_s[traced] = prices[traced].timing.microbatch_s - sum(p.seconds for p in average) / traced
        # The trace draws its own batch of tokens and labels (m_t microbatches' worth) before the step.
        batch = [p for p in priced_ops if p.op.stage == "other" and p.op.packet == "aten.randint"]
        assert len(batch) == 2
        once_s[traced] = prices[traced].timing.optimizer_s - sum(p.seconds for p in batch)
    two, three = prices[2], prices[3]
    assert two.once_per_step_s > 0
    assert three.once_per_step_s == pytest.approx(two.once_per_step_s, rel=1e-12)
    assert per_microbatch_s[3] == pytest.approx(per_microbatch_s[2], rel=1e-12)
    assert once_s[3] == pytest.approx(once_s[2], rel=1e-12)
