"""A four-stage pipeline proxy scenario (dp 2, ep 2, pp 4) for the projection's stage tests."""

from __future__ import annotations

import copy
from typing import Any

from bench.scenario import scenario_from_dict

# Four stages of one block each: the first embeds, the last runs the head; the two middle ones hold
# one MoE block each. Expert parallelism (no-sync) inside each stage.
PIPELINE = {
    "schema_version": 1,
    "name": "pipeline-of-four",
    "mode": "proxy",
    "model": {
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 4,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96, "shared_expert_hidden": 64},
    },
    "routing": {"mode": "balanced", "seed": 0},
    "precision": "bf16",
    "parallel": {
        "dp": 2,
        "ep": 2,
        "pp": 4,
        "schedule": "1f1b",
        "microbatches": 2,
        "optimizer_sharding": "zero1",
        "dispatch": "no-sync",
        "capacity_factor": 1.25,
    },
    "run": {"tokens_per_step": 2 * 2 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 0, "threads": 1},
    "cluster": {"gpus": 8, "gpus_per_node": 4, "gpu_memory_gib": 1, "peak_tflops": 1},
}


def pipeline(**changes):
    """``PIPELINE`` with ``changes`` applied, a scenario; ``"a.b": v`` sets ``spec["a"]["b"] = v``."""
    spec = copy.deepcopy(PIPELINE)
    for path, value in changes.items():
        node: Any = spec
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return scenario_from_dict(spec)
