"""Folding a priced trace into a step: windows, per-microbatch collectives, and the rank-skew waits, by hand."""

from __future__ import annotations

import math

import pytest

from bench.predict.collectives import Network
from bench.predict.op_projection import project_priced_step, step_prices
from bench.predict.ops import OpWork, TensorSpec, TracedOp
from bench.predict.pricing import PricedOp
from bench.predict.projection import Schedule
from bench.predict.skew import SkewModel, expected_max_normal

X = (TensorSpec((4,), "torch.float32"),)
PHASES = {"dp": "grad", "ep": "expert"}


def compute(stage, seconds):
    return PricedOp(TracedOp("aten.mm.default", X, X, stage), OpWork("gemm", 1.0, 1.0, "torch.float32"), seconds)


def collective(stage, group, op="all_reduce", nbytes=1000, ranks=(0, 1)):
    traced = TracedOp(
        "c10d.x.default",
        X,
        X,
        stage,
        collective={"op": op, "ranks": list(ranks), "nbytes": nbytes, "group_name": group},
    )
    return PricedOp(traced, OpWork("collective", 0.0, nbytes, "torch.float32"), 0.0)


def trace():
    # Two microbatches; microbatch 2's backward launches two buckets; the optimizer one gather.
    return [
        compute("other", 0.5),  # zeroing buffers
        compute("forward", 1.0),
        collective("forward", "ep", "all_to_all", 4000),
        compute("backward", 2.0),
        collective("backward", "ep", "all_to_all", 4000),
        compute("forward", 1.0),
        collective("forward", "ep", "all_to_all", 6000),
        compute("backward", 1.5),
        collective("backward", "dp", "all_reduce", 800),
        compute("backward", 0.5),
        collective("backward", "dp", "all_reduce", 200),
        compute("backward", 0.25),
        compute("optimizer", 0.4),
        collective("optimizer", "dp", "all_gather", 100),
        compute("optimizer", 0.1),
        collective("other", "world", "all_reduce", 4),
    ]


def test_step_prices_by_hand():
    prices = step_prices(trace(), microbatches_traced=2, group_phases=PHASES)
    assert prices.timing.microbatch_s == pytest.approx((1 + 2 + 1 + 1.5 + 0.5 + 0.25) / 2)
    assert prices.timing.optimizer_s == pytest.approx(0.4 + 0.1 + 0.5)
    (a2a,) = prices.per_microbatch
    # Three all-to-alls over two microbatches: rounded to 2 per microbatch, of their mean size.
    assert (a2a.op, a2a.count, a2a.nbytes) == ("all_to_all", 2, round((4000 + 4000 + 6000) / 3))
    # Windows: the backward compute traced after each launch.
    assert [b.window_s for b in prices.grad_buckets] == pytest.approx([0.5 + 0.25, 0.25])
    assert [b.window_s for b in prices.gather_buckets] == pytest.approx([0.1])
    assert [(c.op, c.phase) for c in prices.per_step] == [("all_reduce", "other")]


def test_expected_max_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-4)


def test_skew_is_z_n_sqrt_s_cv_compute():
    prices = step_prices(trace(), microbatches_traced=2, group_phases=PHASES)
    schedule = Schedule(pp=1, virtual_stages=1, microbatches=8, kind="1f1b")
    net = Network(gpus_per_node=2, intra_node_gbps=1.0, inter_node_gbps=1.0, latency_us=0.0)
    plain = project_priced_step(prices, 0, schedule, net, 1024, 2, 1e6)
    skewed = project_priced_step(prices, 0, schedule, net, 1024, 2, 1e6, SkewModel(0.1, "test"))
    # S = 8 microbatches x 2 all-to-alls + 1 "other" all-reduce + the step's end = 18; n = 2.
    wait = 1 / math.sqrt(math.pi) * math.sqrt(18) * 0.1 * 8 * prices.timing.microbatch_s
    assert skewed.breakdown_s["skew"] == pytest.approx(wait, rel=1e-6)
    assert skewed.step_s == pytest.approx(plain.step_s + wait, rel=1e-9)
    assert plain.breakdown_s["skew"] == 0.0
