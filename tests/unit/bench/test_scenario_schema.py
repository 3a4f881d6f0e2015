"""scenarios/schema.json's model section and the engine's config dataclasses name the same fields, and
a scenario that sets every new model field builds the config it says."""

from __future__ import annotations

import dataclasses
import json

from bench.scenario import SCENARIO_SCHEMA_PATH, scenario_from_dict
from moe_engine.config import MLAConfig, ModelConfig, MoEConfig

# Set from other sections of a scenario: precision (dtype) and routing (mode, seed, Zipf exponent).
FROM_OTHER_SECTIONS = {"dtype", "routing", "routing_seed", "zipf_exponent"}


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - FROM_OTHER_SECTIONS


def test_schema_and_dataclasses_agree():
    model = json.loads(SCENARIO_SCHEMA_PATH.read_text())["properties"]["model"]
    assert set(model["properties"]) == _names(ModelConfig)
    assert set(model["properties"]["moe"]["properties"]) == _names(MoEConfig)
    assert set(model["properties"]["mla"]["properties"]) == _names(MLAConfig)


def test_a_scenario_sets_every_new_model_field():
    scenario = scenario_from_dict(
        {
            "schema_version": 1,
            "mode": "execute",
            "model": {
                "vocab_size": 128,
                "d_model": 64,
                "n_layers": 4,
                "n_heads": 4,
                "n_kv_heads": 4,
                "seq_len": 32,
                "n_dense_layers": 1,
                "moe_every": 3,
                "dense_hidden": 48,
                "tie_embeddings": True,
                "mla": {
                    "q_lora_rank": None,
                    "kv_lora_rank": 24,
                    "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 4,
                    "v_head_dim": 12,
                },
                "moe": {
                    "num_experts": 8,
                    "top_k": 2,
                    "expert_hidden": 32,
                    "n_groups": 4,
                    "top_groups": 2,
                    "routed_scaling_factor": 2.5,
                    "score_func": "sigmoid",
                },
            },
            "precision": "fp32",
            "run": {"tokens_per_step": 128},
        }
    )
    model = scenario.model
    assert model.mla == MLAConfig(
        kv_lora_rank=24, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12
    )
    assert (model.tie_embeddings, model.moe_every, model.moe_layer_indices, model.head_dim) == (True, 3, [3], None)
    assert (model.moe.n_groups, model.moe.top_groups, model.moe.routed_scaling_factor) == (4, 2, 2.5)
    gqa = scenario_from_dict(
        {
            "schema_version": 1,
            "mode": "execute",
            "precision": "fp32",
            "run": {"tokens_per_step": 64},
            "model": {
                "vocab_size": 64,
                "d_model": 32,
                "n_layers": 1,
                "n_heads": 4,
                "n_kv_heads": 2,
                "seq_len": 32,
                "head_dim": 12,
                "moe": {"num_experts": 4, "top_k": 1, "expert_hidden": 16},
            },
        }
    )
    assert gqa.model.head_dim == 12
