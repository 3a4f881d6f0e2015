"""A tiny proxy scenario (one rank of dp 4, ep 4, pp 2) and its variants, for the proxy tests."""

from __future__ import annotations

import copy

TINY = {
    "schema_version": 1,
    "name": "tiny-proxy",
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
    "routing": {"mode": "random", "seed": 0},
    "precision": "bf16",
    "parallel": {
        "dp": 4,
        "ep": 4,
        "pp": 2,
        "schedule": "1f1b",
        "microbatches": 4,
        "optimizer_sharding": "zero1",
        "dispatch": "no-sync",
        "capacity_factor": 1.25,
    },
    "run": {"tokens_per_step": 4 * 4 * 2 * 32, "warmup_steps": 1, "steps": 2, "timeout_s": 120},
    "proxy": {"rank": 1, "threads": 1},
    "cluster": {"gpus": 8, "gpus_per_node": 4, "gpu_memory_gib": 1, "peak_tflops": 1},
}


def tiny(**changes) -> dict:
    spec = copy.deepcopy(TINY)
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return spec
