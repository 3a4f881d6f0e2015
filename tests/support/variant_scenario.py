"""A tiny execute scenario for the variant tests, and its file."""

from __future__ import annotations

from pathlib import Path

import yaml

TINY = {
    "schema_version": 1,
    "description": "A tiny MoE for the variant tests.",
    "mode": "execute",
    "model": {
        "vocab_size": 256,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 3},
    "precision": "fp32",
    "recompute": {"mode": "none", "every": 2},
    "run": {"warmup_steps": 1, "steps": 2, "tokens_per_step": 128, "timeout_s": 120},
}


def write_tiny(folder: Path) -> Path:
    path = folder / "tiny-variants.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path
