"""The warm-up measurement counts the expert GEMM shapes a step meets for the first time."""

from __future__ import annotations

import logging

import pytest

from bench.validate.cpu_warmup import step_decay


@pytest.mark.slow  # 12 s of bf16 steps on a core without bf16 units
def test_balanced_routes_meet_every_shape_in_the_first_step(caplog):
    # Balanced routing gives every expert the same rows every step: the six GEMM forms of an expert
    # MLP (gate-up and down, forward, input gradient, weight gradient) at one row count each, shared
    # by both layers, all met in step 1 and never again.
    with caplog.at_level(logging.INFO, logger="bench.validate.cpu_warmup"):
        blocks = step_decay("scenarios/smoke/e8-balanced-bf16.yaml", steps=3, block=1)
    assert [b["new_expert_gemm_shapes_per_step"] for b in blocks] == [6, 0, 0]
    # One line a block, as it ends.
    assert [m.split(":")[0] for m in caplog.messages] == ["  steps 1-1", "  steps 2-2", "  steps 3-3"]
    assert caplog.messages[0].endswith("6.0 new expert GEMM shapes a step")
    assert [b["steps"] for b in blocks] == [[1, 1], [2, 2], [3, 3]]


@pytest.mark.slow
def test_random_routes_keep_making_new_shapes():
    blocks = step_decay("scenarios/smoke/e8-random-bf16.yaml", steps=2, block=1)
    assert blocks[0]["new_expert_gemm_shapes_per_step"] > 6
    assert blocks[1]["new_expert_gemm_shapes_per_step"] > 0
