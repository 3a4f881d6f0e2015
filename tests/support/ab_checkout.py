"""The A/B tests' tiny scenario, and the git checkout that ``moe-bench ab`` compares against."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.results import REPO_ROOT

TINY_AB = """\
schema_version: 1
description: A tiny MoE for the A/B tests.
mode: execute
model:
  vocab_size: 512
  d_model: 128
  n_layers: 1
  n_heads: 4
  n_kv_heads: 2
  seq_len: 128
  moe: {num_experts: 4, top_k: 2, expert_hidden: 64}
routing: {mode: random, seed: 0}
precision: fp32
run: {warmup_steps: 1, steps: 3, tokens_per_step: 512, timeout_s: 120}
"""


def write_tiny_ab(folder: Path) -> Path:
    path = folder / "tiny-ab.yaml"
    path.write_text(TINY_AB)
    return path


def in_checkout() -> bool:
    try:
        done = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:  # no git
        return False
    return done.returncode == 0 and Path(done.stdout.strip()).resolve() == REPO_ROOT.resolve()


needs_checkout = pytest.mark.skipif(
    not in_checkout(), reason="not a git checkout (e.g. inside the image): ab needs the history"
)


def worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
