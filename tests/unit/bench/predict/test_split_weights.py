"""The paired plan's split weight backwards: how many each rank runs, and what adding their gradients into
the buffer costs (``bench.predict.split_weights``), on hand-worked cases."""

from __future__ import annotations

import dataclasses

import pytest

from bench.predict.device import load_profile
from bench.predict.plan.bytes import Params, parameter_pieces, precision_bytes
from bench.predict.split_weights import split_weight_add_s, stage_params, weight_add_s, weight_backwards_by_stage
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig


def test_weight_backwards_by_stage_by_hand():
    # pp 2, two stages per rank, 4 microbatches (tests/unit/moe_engine/parallel/test_paired_plan.py's plans):
    # rank 0 ends "B0.1 I2.2 [I2.3&W2.2] [B0.2&W2.3] B0.3", rank 1 "I3.3 [I1.2&W3.3] [I1.3&W1.2] W1.3".
    assert weight_backwards_by_stage("interleaved1f1b", 2, 2, 4, 0) == {2: 2}
    assert weight_backwards_by_stage("interleaved1f1b", 2, 2, 4, 1) == {3: 1, 1: 2}
    # DualPipeV's weight backwards are torch's own: counted as well (the caller decides what they cost).
    assert sum(weight_backwards_by_stage("dualpipev", 2, 2, 4, 0).values()) > 0


def test_weight_add_by_hand():
    profile = load_profile("b300")
    eff = profile.efficiency
    b = precision_bytes("bf16", "fp32")  # bf16 weights (2 bytes), fp32 buffer (4); the router fp32 (4, 4)
    params = {2: Params(lowp=1000, fp32=10), 3: Params(lowp=500)}
    # Per weight backward: the gradient read in the weights' dtype, the buffer read and written.
    per_stage = {2: 1000 * 2 + 10 * 4 + 2 * (1000 * 4 + 10 * 4), 3: 500 * 2 + 2 * 500 * 4}
    assert per_stage == {2: 10120, 3: 5000}

    def one(nbytes):
        return nbytes / (profile.hbm_gbps * 1e9 * eff["memory"]) + eff["launch_overhead_us"] * 1e-6

    want = 2 * one(10120) + 3 * one(5000)
    assert weight_add_s({2: 2, 3: 3}, params, b, "bf16", profile) == pytest.approx(want, rel=1e-12)
    assert weight_add_s({}, params, b, "bf16", profile) == 0.0


MODEL = ModelConfig(
    vocab_size=64, d_model=16, n_layers=4, n_heads=2, n_kv_heads=2, seq_len=8, moe=MoEConfig(num_experts=4, top_k=2)
)


def test_stage_params_hold_the_model_once_per_expert_shard():
    parallel = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved1f1b", ep=2, dp=2)
    by_stage = stage_params(MODEL, parallel)
    pieces = parameter_pieces(MODEL)
    block = pieces.block + pieces.moe_dense + pieces.expert * (MODEL.moe.num_experts // 2)
    assert by_stage[0] == block + pieces.embedding
    assert by_stage[1] == by_stage[2] == block
    assert by_stage[3] == block + pieces.head


def test_only_interleaved_1f1b_under_pipelines_adds():
    profile = load_profile("b300")
    parallel = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved1f1b", ep=2, dp=2, microbatches=4)
    got = split_weight_add_s(MODEL, parallel, "bf16", profile, 1)
    b = precision_bytes("bf16", parallel.grad_dtype.value, parallel.dp_mode.value)
    params = stage_params(MODEL, parallel)
    assert got == pytest.approx(weight_add_s({3: 1, 1: 2}, params, b, "bf16", profile))
    assert got > 0
    for other in (
        dataclasses.replace(parallel, pp=1, virtual_stages=1, microbatches=4),
        ParallelConfig(pp=2, schedule="1f1b"),
    ):
        assert split_weight_add_s(MODEL, other, "bf16", profile, 0) == 0.0
