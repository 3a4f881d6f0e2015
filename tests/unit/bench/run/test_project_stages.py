"""Identical pipeline stages share one trace: each stage still gets the ops, and the projection, that
tracing it for itself gives (``bench.run.project.shared_traces``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from pipeline_scenario import pipeline

from bench.predict.device import load_profile
from bench.run.project import (
    TRACED_MICROBATCHES,
    memory_fit,
    projection_document,
    shared_traces,
    stage_traces,
    traced_scenario,
)
from bench.run.trace import retarget, trace_step
from moe_engine.parallel.layout import Layout


def _without_sharing(doc: dict) -> dict:
    # What only a shared projection can say: who shared, and how long each stage took.
    doc = copy.deepcopy(doc)
    doc["assumptions"] = [a for a in doc["assumptions"] if "trace_shared_with" not in a]
    for stage in doc["stages"]:
        del stage["trace_shared_with"], stage["trace_s"]
    return doc


@pytest.mark.slow
def test_shared_stages_have_the_ops_and_the_projection_of_stages_traced_one_by_one():
    # Balanced routes are the same in every block, so a stage that takes its twin's trace must match
    # its own trace exactly, rows per expert included.
    scenario = pipeline()
    traced = traced_scenario(scenario, TRACED_MICROBATCHES)
    profile = load_profile("h100-sxm")
    shared = list(stage_traces(traced, profile))
    every = list(stage_traces(traced, profile, share=False))
    assert [s.shared_with for s in shared] == [None, None, 1, None]
    assert [s.shared_with for s in every] == [None] * 4
    for mine, own in zip(shared, every):
        assert mine.rank == own.rank
        assert mine.trace.ops == own.trace.ops, mine.pipeline_rank
        assert mine.trace.group_phases == own.trace.group_phases
        assert mine.trace.family_groups == own.trace.family_groups
        assert [p.seconds for p in mine.priced] == [p.seconds for p in own.priced]
    # The twins' messages go to different ranks: the retargeted trace is not its twin's.
    messages = [
        [op.collective["ranks"] for op in s.trace.ops if op.collective and op.collective["op"] == "send"]
        for s in shared[1:3]
    ]
    assert messages[0] != messages[1]

    fit = memory_fit(scenario, profile)
    doc = projection_document(scenario, profile, fit, shared)
    reference = projection_document(scenario, profile, fit, every)
    assert _without_sharing(doc) == _without_sharing(reference)
    assert [s["trace_shared_with"] for s in doc["stages"]] == [None, None, 1, None]
    assert any(a.startswith("stage 2: the trace of an identical stage") for a in doc["assumptions"])


@pytest.mark.slow
def test_random_routes_change_only_the_rows_per_expert_of_a_shared_trace():
    # No-sync dispatch: the capacity buffers fix every shape; the routes, drawn per block, decide
    # only how the buffers' rows split between the experts.
    scenario = traced_scenario(pipeline(**{"routing.mode": "random"}), TRACED_MICROBATCHES)
    layout = Layout(scenario.parallel_config)
    assert shared_traces(scenario) == [0, 1, 1, 3]
    twin = trace_step(scenario, rank=layout.rank_of(1, 0, 0))
    own = trace_step(scenario, rank=layout.rank_of(2, 0, 0))
    shared = retarget(twin, scenario, own.rank)
    rows_aside = lambda ops: [dataclasses.replace(op, group_rows=None) for op in ops]
    assert rows_aside(shared.ops) == rows_aside(own.ops)
    assert [len(op.group_rows or ()) for op in shared.ops] == [len(op.group_rows or ()) for op in own.ops]
    assert shared.groups == own.groups
    assert (shared.group_phases, shared.family_groups) == (own.group_phases, own.family_groups)


@pytest.mark.parametrize(
    "changes,microbatches,expected",
    [
        ({}, 2, [0, 1, 1, 3]),
        ({"parallel.schedule": "gpipe"}, 2, [0, 1, 1, 3]),
        # 1F1B: stage s runs pp - s - 1 warm-up forwards; of three traced microbatches, stage 3 of 5
        # runs one (F F B F B B), stages 1 and 2 run all three.
        (
            {
                "model.n_layers": 5,
                "parallel.pp": 5,
                "parallel.microbatches": 4,
                "run.tokens_per_step": 2 * 4 * 32,
                "cluster.gpus": 10,
            },
            3,
            [0, 1, 1, 3, 4],
        ),
        # Stages of 2, 2, 1, 1 blocks; then 2, 1, 1, 1.
        ({"model.n_layers": 6}, 2, [0, 1, 2, 3]),
        ({"model.n_layers": 5}, 2, [0, 1, 1, 3]),
        # Dense blocks 0-2: stage 1 holds a dense and an MoE block, stage 2 two MoE blocks.
        ({"model.n_layers": 8, "model.n_dense_layers": 3, "model.dense_hidden": 128}, 2, [0, 1, 2, 3]),
        ({"model.n_layers": 8, "model.moe_every": 2, "model.dense_hidden": 128}, 2, [0, 1, 1, 3]),
        # Recomputed blocks by global index: every 2nd block recomputes the first of each stage's two;
        # every 4th, stage 2's first only.
        ({"model.n_layers": 8, "recompute": {"mode": "full", "every": 2}}, 2, [0, 1, 1, 3]),
        ({"model.n_layers": 8, "recompute": {"mode": "full", "every": 4}}, 2, [0, 1, 2, 3]),
        # Sync dispatch: random routes, drawn per block, size the buffers; balanced ones do not.
        ({"routing.mode": "random", "parallel.dispatch": "sync"}, 2, [0, 1, 2, 3]),
        ({"parallel.dispatch": "sync"}, 2, [0, 1, 1, 3]),
        ({"routing.mode": "random", "parallel.dispatch": "sync", "parallel.ep": 1}, 2, [0, 1, 1, 3]),
    ],
)
def test_which_stages_are_identical(changes, microbatches, expected):
    assert shared_traces(traced_scenario(pipeline(**changes), microbatches)) == expected
