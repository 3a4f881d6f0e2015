"""A tiny execute scenario for the runner's tests, its variants, and scenario files written from them."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

TINY = {
    "schema_version": 1,
    "mode": "execute",
    "model": {
        "vocab_size": 128,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "fp32",
    "run": {"warmup_steps": 1, "steps": 3, "tokens_per_step": 128, "timeout_s": 120},
}


def write_scenario(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def variant(**changes):
    """A copy of ``TINY`` with ``changes`` applied; ``a__b=v`` sets ``data["a"]["b"] = v``."""
    data = json.loads(json.dumps(TINY))
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data
