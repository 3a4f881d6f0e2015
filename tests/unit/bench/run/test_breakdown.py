"""``moe-bench project --breakdown``: each op lands in the module it ran in (router ops in the router,
expert GEMMs in the experts, AdamW in the optimizer, the log-softmax in the loss, forward and
backward), every op has a kind, and the breakdown's tables add up to the projected step: time
(counted and hidden), bytes, FLOPs and kernels."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from pipeline_scenario import pipeline

from bench.predict.breakdown import module_of, step_breakdown
from bench.predict.device import load_profile
from bench.predict.op_kinds import op_kind_of
from bench.predict.ops import TensorSpec, TracedOp, op_kind, op_work
from bench.predict.pricing import PricedOp, price_ops
from bench.run.project import project_on_device, traced_scenario
from bench.run.trace import trace_step
from bench.scenario import load_scenario
from bench.validate.variants import patched

T = 1024  # tokens of one rank of e8-ep2-nosync-bf16 (2048 per step, dp 2)


def _op(name, inputs=(), outputs=(), stage="forward", **kw):
    spec = lambda shape: TensorSpec(shape, "torch.bfloat16")
    return TracedOp(name, tuple(map(spec, inputs)), tuple(map(spec, outputs)), stage, **kw)


def _kind(op: TracedOp, profile="h100-sxm") -> str:
    return op_kind_of(price_ops([op], load_profile(profile))[0])


@pytest.mark.parametrize(
    "name,kind",
    [
        ("aten.mm.default", "gemm"),
        ("aten.bmm.default", "gemm"),
        ("aten.add_.Tensor", "elementwise"),
        ("aten.masked_fill_.Scalar", "elementwise"),
        ("aten.silu_backward.default", "elementwise"),
        ("aten.max.other", "elementwise"),
        ("aten.max.dim", "reduction"),
        ("aten._foreach_norm.Scalar", "reduction"),
        ("aten._log_softmax.default", "reduction"),
        ("aten._to_copy.default", "copy_cast"),
        ("aten.cat.default", "copy_cast"),
        ("aten.zeros_like.default", "fill"),
        ("aten.index_select.default", "index_sort"),
        ("aten.topk.default", "index_sort"),
        ("aten.normal_.default", "random"),
        ("aten.atan.default", "elementwise"),  # in no table: torch's pointwise tag
        ("aten.not_an_op.default", "other"),
        ("moe_engine.rms_norm.default", "fused"),
    ],
)
def test_op_kinds_by_name(name, kind):
    shape = (2, 64, 64) if "bmm" in name else (64, 64)
    assert _kind(_op(name, [shape, shape], [shape])) == kind


def test_op_kinds_of_priced_regions_and_collectives():
    grouped = _op("aten._grouped_mm.default", [(256, 64), (4, 64, 32), (4,)], [(256, 32)], group_rows=(64,) * 4)
    assert _kind(grouped) == "grouped_gemm"
    # An MXFP8 region: one GPU kernel (the grouped GEMM at the MX rate) on a GPU profile; its
    # quantization is a cast.
    region = [
        _op("aten.abs.default", [(256, 64)], [(256, 64)], region="mxfp8.grouped_mm", region_call=1),
        dataclasses.replace(grouped, region="mxfp8.grouped_mm", region_call=1),
    ]
    priced = price_ops(region, load_profile("h100-sxm"))
    assert [op_kind_of(p) for p in priced] == ["grouped_gemm", "free"]
    quantize = _op("aten.abs.default", [(256, 64)], [(256, 64)], region="mxfp8.quantize", region_call=2)
    assert _kind(quantize) == "copy_cast" and _kind(quantize, "cpu-2core") == "copy_cast"
    collective = _op(
        "c10d.alltoall_base_.default",
        [(8, 64)],
        [(8, 64)],
        collective={"op": "all_to_all", "ranks": [0, 1], "nbytes": 1024, "group_name": "1"},
    )
    assert _kind(collective) == "collective"


@pytest.mark.parametrize(
    "location,stage,module",
    [
        ("Transformer/Block/MoELayer/Router", "forward", "router"),
        ("Transformer/Block/MoELayer>Router", "forward", "dispatch"),
        ("Transformer/Block/MoELayer", "backward", "dispatch"),
        ("Transformer/Block/MoELayer>GroupedExperts", "backward", "combine"),
        ("Transformer/Block/MoELayer>SwiGLU", "forward", "combine"),
        ("Transformer/Block/MoELayer/GroupedExperts", "forward", "experts"),
        ("Transformer/Block/MoELayer/SwiGLU/Linear", "forward", "shared_expert"),
        ("Transformer/Block/SwiGLU/Linear", "forward", "mlp"),
        ("Transformer/Block/Attention/RMSNorm", "forward", "norms"),
        ("Transformer/Block/Attention>RotaryEmbedding", "backward", "attention"),
        ("Transformer/Block/RMSNorm", "forward", "norms"),
        ("Transformer/Block>Attention", "forward", "residual"),
        ("StageModule/Linear", "backward", "head"),
        ("Transformer", "forward", "head"),
        ("Transformer/Embedding", "backward", "embedding"),
        ("Attention/Linear", "backward", "attention"),  # a recomputed block's child, re-entered alone
        ("", "forward", "loss"),
        ("", "backward", "loss"),
        ("", "other", "other"),
        ("@optimizer", "optimizer", "optimizer"),
        ("@grad_sync", "optimizer", "grad_sync"),
        ("@accumulate_grad", "backward", "grad_sync"),
        ("@expert_bias", "forward", "router"),
        ("@proxy_peers", "forward", "proxy_peers"),
        ("@fsdp", "forward", "fsdp"),
    ],
)
def test_module_of_a_location(location, stage, module):
    assert module_of(location, stage) == module


def test_a_stage_message_is_the_pipelines_wherever_it_was_sent():
    assert module_of("", "forward", pipeline_message=True) == "pipeline"
    assert module_of("@proxy_peers", "backward", pipeline_message=True) == "pipeline"


def _unfused(scenario):
    """The reference (unfused) step, whose ATen ops these tests name one by one (the fused ops' modules
    are checked in tests/unit/moe_engine/kernels/test_fused_trace.py; the projection prices a fused op as the several
    kernels it launches on a GPU, where the count below takes one kernel per traced op)."""
    return patched(scenario, {"model": {"fused_kernels": False}})


def _modules(trace, name, stage=None, shape=None):
    """Modules of the ops called ``name`` (optionally of one stage and output shape), in trace order."""
    return [
        module_of(op.location, op.stage)
        for op in trace.ops
        if op.name == name and (stage is None or op.stage == stage) and (shape is None or op.outputs[0].shape == shape)
    ]


def _alltoalls(trace, stage):
    return [
        module_of(op.location, op.stage)
        for op in trace.ops
        if op.collective is not None and op.collective["op"] == "all_to_all" and op.stage == stage
    ]


@pytest.mark.parametrize("fake", [True, False])
def test_ops_land_in_the_modules_they_ran_in(fake):
    # Two MoE blocks, expert parallelism over 2 ranks (no-sync), d_model 256, vocab 1024, 8 experts,
    # T = 1024 tokens per rank, one microbatch.
    scenario = _unfused(load_scenario("scenarios/smoke/e8-ep2-nosync-bf16.yaml"))
    trace = trace_step(scenario, rank=1, fake=fake)
    d, e, v = 256, 8, 1024
    # The router's scores (fp32 T x E) and its weight's gradient (E x D): the router's, in each block.
    assert _modules(trace, "aten.mm.default", "forward", (T, e)) == ["router"] * 2
    assert _modules(trace, "aten.mm.default", "backward", (e, d)) == ["router"] * 2
    assert _modules(trace, "aten._softmax.default", "forward") == ["router"] * 2
    # Every expert GEMM, forward (gate-up, down) and backward (data gradients of both; their weight
    # gradients added into the gradient buffer by their GEMMs).
    assert _modules(trace, "aten._grouped_mm.default", "forward") == ["experts"] * 4
    assert _modules(trace, "aten._grouped_mm.default", "backward") == ["experts"] * 4
    assert _modules(trace, "moe_engine.grouped_wgrad_accumulate.default", "backward") == ["experts"] * 4
    # The attention projections' weight gradients, added into the buffer by theirs (q, k, v, o a block).
    assert _modules(trace, "moe_engine.wgrad_accumulate.default", "backward") == ["attention"] * 8
    assert set(_modules(trace, "aten.silu_backward.default")) == {"experts"}
    # Tokens go out twice per block (counts, rows) and come back once; the backward returns the
    # combine's gradients first, then the dispatch's.
    assert _alltoalls(trace, "forward") == ["dispatch", "dispatch", "combine"] * 2
    assert _alltoalls(trace, "backward") == ["combine", "dispatch"] * 2
    assert _modules(trace, "aten.bmm.default", "forward") == ["combine"] * 2
    # The loss, forward and backward; the LM head (T x V) and its weight gradient (V x D).
    assert _modules(trace, "aten._log_softmax.default") == ["loss"]
    assert _modules(trace, "aten._log_softmax_backward_data.default") == ["loss"]
    assert _modules(trace, "aten.nll_loss_backward.default") == ["loss"]
    assert _modules(trace, "aten.mm.default", "forward", (T, v)) == ["head"]
    # The backward starts at the loss: its first two products are the head's input and weight gradients.
    backward_mm = _modules(trace, "aten.mm.default", "backward")
    assert backward_mm[:2] == ["head"] * 2 and backward_mm.count("head") == 2
    assert _modules(trace, "aten.embedding_dense_backward.default") == ["embedding"]
    assert set(_modules(trace, "aten._scaled_dot_product_flash_attention_for_cpu_backward.default")) == {"attention"}
    assert set(_modules(trace, "aten.rsqrt.default")) == {"norms"}
    # AdamW's updates; the gradient buffers' accumulation and bucket reductions in the backward.
    for name in ("aten._foreach_addcdiv_.ScalarList", "aten._foreach_lerp_.Scalar", "aten._foreach_addcmul_.Scalar"):
        assert set(_modules(trace, name)) == {"optimizer"}, name
    reductions = [
        module_of(op.location, op.stage)
        for op in trace.ops
        if op.collective is not None and op.collective["op"] == "all_reduce" and op.stage == "backward"
    ]
    assert reductions and set(reductions) == {"grad_sync"}
    # Every op has a kind of the breakdown's, every module one of the step's parts.
    priced = price_ops(trace.ops, load_profile("h100-sxm"))
    assert "other" not in {op_kind_of(p) for p in priced}
    assert "other" not in {module_of(op.location, op.stage) for op in trace.ops if op.stage != "other"}


@pytest.mark.parametrize("name", ["e8-ep2-nosync-bf16-recompute-full", "e8-ep2-nosync-bf16-recompute-selective"])
def test_recomputed_ops_land_in_their_modules(name):
    trace = trace_step(_unfused(load_scenario(f"scenarios/smoke/{name}.yaml")), rank=1)
    # The recompute runs the experts' forward again inside the backward: 2 blocks x (2 forward + 2 input
    # gradients), and 2 blocks x 2 weight gradients added into the gradient buffer.
    assert _modules(trace, "aten._grouped_mm.default", "backward") == ["experts"] * 8
    assert _modules(trace, "moe_engine.grouped_wgrad_accumulate.default", "backward") == ["experts"] * 4
    assert set(_modules(trace, "aten._scaled_dot_product_flash_attention_for_cpu.default", "backward")) == {"attention"}
    if name.endswith("full"):
        assert _modules(trace, "aten.mm.default", "backward", (T, 8)) == ["router"] * 2
    assert _modules(trace, "aten._log_softmax.default") == ["loss"]


def test_the_fake_trace_locates_every_op_as_the_real_step_does():
    # A pipeline stage with experts over 2 ranks: stage messages, fabricated neighbours and peers.
    scenario = load_scenario("scenarios/smoke/e8-pp2-ep2-bf16.yaml")
    rank = scenario.world_size - 1
    kernels = lambda trace: [(op.name, op.location) for op in trace.ops if op_kind(op) != "free"]
    fake, real = trace_step(scenario, rank=rank, fake=True), trace_step(scenario, rank=rank, fake=False)
    assert kernels(fake) == kernels(real)
    messages = [
        module_of(op.location, op.stage, True)
        for op in fake.ops
        if op.collective is not None and op.collective["op"] in ("send", "recv")
    ]
    assert messages and set(messages) == {"pipeline"}


# ---- the tables add up to the step -------------------------------------------------------------


# Per-expert rows: the rows a proxy rank's trace sends, so that the independent counts below take the
# traced exchanges as they are (the projection's pricing of the engine's rows per destination from them
# is tests/unit/bench/predict/test_dispatch_rows.py's).
LAYOUTS = {
    # Four stages (bubble, stage messages), ZeRO-1 gathers under the optimizer, expert all-to-alls,
    # 4 microbatches of which 2 are traced.
    "pipeline": lambda: pipeline(
        **{
            "parallel.microbatches": 4,
            "parallel.dispatch_rows": "per-expert",
            "run.tokens_per_step": 2 * 4 * 32,
            "model.fused_kernels": False,
        }
    ),
    # No pipeline: gradient buckets overlapped with the backward.
    "ep2": lambda: patched(
        _unfused(load_scenario("scenarios/smoke/e8-ep2-nosync-bf16.yaml")),
        {"parallel": {"dispatch_rows": "per-expert"}},
    ),
}


def _sum(rows, key):
    return math.fsum(row[key] for row in rows.values())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_breakdown_adds_up_to_the_projected_step(layout):
    scenario = LAYOUTS[layout]()
    profile = load_profile("h100-sxm")
    doc = project_on_device(scenario, profile, breakdown=True)
    b, steps = doc["breakdown"], doc["breakdown_s"]
    stage = doc["stages"][b["pipeline_rank"]]
    m, m_t = scenario.parallel_config.microbatches, doc["traced_microbatches"]
    assert b["pipeline_rank"] == doc["slowest_stage"]

    for table in ("by_kind", "by_module"):
        rows = b[table]
        assert _sum(rows, "time_s") == pytest.approx(doc["step_s"], rel=1e-12), table
        for key in ("hidden_s", "bytes", "flops", "kernels"):
            assert _sum(rows, key) == pytest.approx(b["total"][key], rel=1e-12), (table, key)
        for row in rows.values():
            assert row["share"] == pytest.approx(row["time_s"] / doc["step_s"])
    kinds = b["by_kind"]
    compute = math.fsum(r["time_s"] for k, r in kinds.items() if k not in ("collective", "bubble", "skew"))
    assert compute == pytest.approx(steps["compute"] + steps["optimizer"], rel=1e-12)
    assert kinds["collective"]["time_s"] == pytest.approx(
        steps["expert_comm"]
        + steps["pipeline_comm"]
        + steps["fsdp_gather_exposed"]
        + steps["grad_sync_exposed"]
        + steps["param_gather_exposed"]
        + steps["other_comm"],
        rel=1e-12,
    )
    assert b["total"]["hidden_s"] == pytest.approx(
        steps["expert_comm_hidden"]
        + steps["grad_sync_hidden"]
        + steps["param_gather_hidden"]
        + steps["fsdp_gather_total"]
        - steps["fsdp_gather_exposed"],
        # The projection prices a microbatch's expert all-to-alls as their mean call, rounded to whole
        # bytes; the breakdown prices each call: their hidden parts differ in the rounding.
        rel=1e-6,
        abs=1e-15,
    )
    assert kinds.get("bubble", {"time_s": 0.0})["time_s"] == steps["bubble"]
    assert (layout == "pipeline") == (steps["bubble"] > 0)
    assert b["by_module"]["experts"]["flops"] > 0 and b["by_module"]["optimizer"]["flops"] == 0

    # Independent counts from the traced ops themselves (the trace of the slowest stage).
    traced = traced_scenario(scenario, m_t)
    trace = trace_step(traced, rank=stage["rank"])
    matmul_flops = stage["traced_matmul_flops_per_microbatch"] * m
    assert _sum({k: kinds[k] for k in ("gemm", "grouped_gemm", "attention") if k in kinds}, "flops") == pytest.approx(
        matmul_flops, rel=1e-12
    )
    # The projection's rules, restated: the proxy's stand-ins for its peers cost nothing (no kernel, no
    # bytes), and a gradient bucket's 1/dp scaling runs once per step, not once per microbatch.
    once = lambda op: op.name.startswith("aten.div_") and op.location in ("@accumulate_grad", "@grad_sync")
    weight = lambda op: (
        0.0
        if op.location == "@proxy_peers"
        else 1.0
        if once(op) or op.stage not in ("forward", "backward")
        else m / m_t
    )
    kernels = math.fsum(weight(op) for op in trace.ops if op_kind(op) not in ("free", "collective"))
    calls = [op for op in trace.ops if op_kind(op) == "collective"]
    per_microbatch = {"expert", "pipeline"}
    phase = lambda op: trace.group_phases.get(op.collective["group_name"], "other")
    call_weight = lambda op: m / m_t if phase(op) in per_microbatch else 1.0
    assert b["total"]["kernels"] == pytest.approx(kernels + math.fsum(map(call_weight, calls)), rel=1e-12)
    moved = math.fsum(weight(op) * op_work(op).nbytes for op in trace.ops if op_kind(op) not in ("free", "collective"))
    moved += math.fsum(call_weight(op) * op.collective["nbytes"] for op in calls)
    assert b["total"]["bytes"] == pytest.approx(moved, rel=1e-12)


def test_collectives_share_their_accounts_counted_time_by_their_prices():
    # Two gradient reductions priced 1 and 3 (alone) of which the projection counts 2 (exposed): they
    # count 0.5 and 1.5, the rest hidden; an expert all-to-all of a step of 4 microbatches, 2 traced,
    # counts twice.
    from bench.predict.collectives import Network
    from bench.predict.ops import OpWork
    from bench.predict.projection import BESIDE_KEYS, STEP_KEYS, Projection

    net = Network(gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
    reduce = lambda nbytes, location: _op(
        "c10d.allreduce_.default",
        stage="backward",
        location=location,
        collective={"op": "all_reduce", "ranks": [0, 1], "nbytes": nbytes, "group_name": "dp"},
    )
    alltoall = _op(
        "c10d.alltoall_base_.default",
        stage="forward",
        location="Transformer/Block/MoELayer>Router",
        collective={"op": "all_to_all", "ranks": [0, 1], "nbytes": 4e9, "group_name": "ep"},
    )
    mm = _op("aten.mm.default", [(64, 64), (64, 64)], [(64, 64)], stage="forward", location="Transformer/Linear")
    calls = (alltoall, reduce(1e9, "@expert_bias"), reduce(3e9, "@accumulate_grad"))
    priced = [PricedOp(mm, op_work(mm), 0.25)] + [
        PricedOp(op, OpWork("collective", 0.0, 0.0, "torch.bfloat16"), 0.0) for op in calls
    ]
    # all_reduce of B bytes over 2 ranks at 1 GB/s: 2 * (1/2) * B / 1e9 seconds = 1 s and 3 s;
    # the all-to-all: B (n - l) / n ... l = 2 on one node: B (l - 1) / n = 2 s, twice per step.
    breakdown_s = dict.fromkeys(STEP_KEYS + BESIDE_KEYS, 0.0)
    breakdown_s.update(compute=0.5, expert_comm=4.0, grad_sync_exposed=2.0, grad_sync_hidden=2.0, grad_sync_total=4.0)
    projection = Projection(6.5, 0.0, 0.0, breakdown_s, [])
    b = step_breakdown(priced, {"dp": "grad", "ep": "expert"}, 2, 4, projection, 0, net)
    mods = b["by_module"]
    assert (mods["router"]["time_s"], mods["router"]["hidden_s"]) == pytest.approx((0.5, 0.5))
    assert (mods["grad_sync"]["time_s"], mods["grad_sync"]["hidden_s"]) == pytest.approx((1.5, 1.5))
    assert (mods["dispatch"]["time_s"], mods["dispatch"]["hidden_s"]) == pytest.approx((4.0, 0.0))
    assert (mods["dispatch"]["kernels"], mods["dispatch"]["bytes"]) == pytest.approx((2, 8e9))
    assert (mods["head"]["time_s"], mods["head"]["kernels"], mods["head"]["flops"]) == pytest.approx(
        (0.5, 2, 2 * 2 * 64**3)
    )
    top = {row["op"]: row for row in b["top_ops"]}
    assert top["c10d.allreduce_"]["time_s"] == pytest.approx(2.0)
    assert _sum(b["by_kind"], "time_s") == pytest.approx(6.5)
    assert list(b["by_kind"]) == ["gemm", "collective"]


def test_the_breakdown_is_printed_and_written_only_when_asked(tmp_path, capsys):
    from bench.cli import main

    small = "scenarios/smoke/e8-ep2-nosync-bf16.yaml"
    assert main(["project", small, "--device", "h100-sxm", "--out", str(tmp_path / "plain")]) == 0
    assert "by module" not in capsys.readouterr().out
    assert "breakdown" not in json.loads((tmp_path / "plain" / "e8-ep2-nosync-bf16.h100-sxm.json").read_text())
    assert main(["project", small, "--device", "h100-sxm", "--out", str(tmp_path), "--breakdown"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "e8-ep2-nosync-bf16.h100-sxm.json").read_text())
    b = doc["breakdown"]
    assert b["step_s"] == doc["step_s"] and b["pipeline_rank"] == 0
    table = out[out.index("  by module") :]
    for module, row in b["by_module"].items():
        assert f"  {module:<16}{row['time_s'] * 1e3:>11.1f}{row['share']:>8.1%}" in table, module
    assert f"  {'total':<16}{doc['step_s'] * 1e3:>11.1f}{1:>8.1%}" in table
    assert "  by op kind" in out and "  top ops" in out
