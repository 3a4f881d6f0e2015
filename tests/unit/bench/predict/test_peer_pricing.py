"""The proxy's stand-ins for its simulated peers (ops traced at ``@proxy_peers``) cost nothing: a real rank
receives what they fabricate through the collectives the network prices. By hand, and on a traced step."""

from __future__ import annotations

import copy

import pytest

from bench.predict.collectives import Network
from bench.predict.device import load_profile
from bench.predict.op_projection import project_priced_step, step_prices
from bench.predict.ops import TensorSpec, TracedOp
from bench.predict.pricing import is_stand_in, price_ops
from bench.predict.projection import Schedule
from bench.run.trace import trace_step
from bench.scenario import scenario_from_dict


def spec(*shape, dtype="torch.bfloat16"):
    return TensorSpec(tuple(shape), dtype)


def op(name, inputs, outputs, stage="forward", location="Transformer/Block/MoELayer"):
    return TracedOp(name, tuple(inputs), tuple(outputs), stage, location=location)


# Received rows copied into the receive buffer (1024 x 512 bf16, in place: read and written) and a
# gather of 1024 rows of 512 bf16 by an int64 index.
COPY = ("aten.copy_.default", [spec(1024, 512), spec(1024, 512)], [spec(1024, 512)])
GATHER = ("aten.index_select.default", [spec(4096, 512), spec(1024, dtype="torch.int64")], [spec(1024, 512)])
COPY_BYTES = 3 * 1024 * 512 * 2
GATHER_BYTES = 4096 * 512 * 2 + 1024 * 8 + 1024 * 512 * 2


@pytest.mark.parametrize("profile", ["b300", "h100-sxm", "cpu-2core"])
def test_a_stand_in_costs_nothing_on_every_profile(profile):
    device = load_profile(profile)
    own, stand_in = price_ops([op(*COPY), op(*COPY, location="@proxy_peers")], device)
    assert own.seconds > 0 and own.work.kind == "memory" and own.work.nbytes == COPY_BYTES
    # No kernel, no bytes, no time: not even a CPU profile's host time per op.
    assert (stand_in.seconds, stand_in.work.kind, stand_in.work.nbytes, stand_in.work.flops) == (0.0, "free", 0.0, 0.0)


def test_a_step_by_hand_leaves_the_stand_ins_out():
    # b300 (no curves): memory ops at bytes / (8000e9 B/s * 0.75) + 4 us. Two traced microbatches, each
    # a gather of its own and the stand-ins' copy of the received rows (forward) and of the gradients
    # sent back (backward); the optimizer one copy.
    b300 = load_profile("b300")
    memory_s = lambda nbytes: nbytes / (8000e9 * 0.75) + 4e-6
    trace = []
    for _ in range(2):
        trace += [
            op(*GATHER),
            op(*COPY, location="@proxy_peers"),
            op(*GATHER, stage="backward"),
            op(*COPY, stage="backward", location="@proxy_peers"),
        ]
    trace.append(op(*COPY, stage="optimizer", location="@optimizer"))
    prices = step_prices(price_ops(trace, b300), 2, {})
    assert prices.timing.microbatch_s == pytest.approx(2 * memory_s(GATHER_BYTES), rel=1e-12)
    assert prices.timing.optimizer_s == pytest.approx(memory_s(COPY_BYTES), rel=1e-12)
    assert prices.stand_ins == 4
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=8, kind="1f1b")
    net = Network(gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
    projection = project_priced_step(prices, 0, schedule, net, 1024, 1, 1e6)
    assert projection.step_s == pytest.approx(8 * 2 * memory_s(GATHER_BYTES) + memory_s(COPY_BYTES), rel=1e-12)
    (stated,) = [a for a in projection.assumptions if "stand-ins" in a]
    assert "4 traced ops" in stated and "cost 0" in stated


# A pipeline stage between two others, with experts over 2 ranks: fabricated stage messages, received
# rows and counts, and the peers' routers replayed.
STAGE = {
    "schema_version": 1,
    "name": "peers-stage",
    "mode": "proxy",
    "model": {
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 4,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "bf16",
    "parallel": {
        "dp": 2,
        "ep": 2,
        "pp": 4,
        "schedule": "1f1b",
        "microbatches": 2,
        "dispatch": "no-sync",
        "capacity_factor": 1.25,
    },
    "run": {"tokens_per_step": 2 * 2 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 0, "threads": 1},
    "cluster": {"gpus": 8, "gpus_per_node": 4, "gpu_memory_gib": 1, "peak_tflops": 1},
}


def test_a_traced_stage_prices_as_if_the_stand_ins_were_not_there():
    trace = trace_step(scenario_from_dict(copy.deepcopy(STAGE)), rank=2)
    stand_ins = [o for o in trace.ops if is_stand_in(o)]
    names = {o.packet for o in stand_ins}
    # Received activations drawn, received rows copied in, the peers' routes sorted.
    assert {"aten.normal_", "aten.copy_", "aten.sort"} <= names
    without = [o for o in trace.ops if not is_stand_in(o)]
    for profile in ("b300", "cpu-2core"):
        device = load_profile(profile)
        priced = step_prices(price_ops(trace.ops, device), 2, trace.group_phases)
        reference = step_prices(price_ops(without, device), 2, trace.group_phases)
        assert priced.stand_ins == len(stand_ins) and reference.stand_ins == 0
        assert priced.timing == reference.timing, profile
        assert priced.seconds_by_kind == pytest.approx(reference.seconds_by_kind, rel=1e-12)
        assert [b.window_s for b in priced.grad_buckets] == [b.window_s for b in reference.grad_buckets]
