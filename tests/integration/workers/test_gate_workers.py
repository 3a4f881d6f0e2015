"""moe-bench ab end to end: both sides' workers against HEAD."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.ab.sides import SideRun
from bench.cli import main
from bench.gate import paired
from bench.results import REPO_ROOT, metric

TINY = """\
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


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-ab.yaml"
    path.write_text(TINY)
    return path


# --------------------------------------------------------------------------------------------
# The paired gate
# --------------------------------------------------------------------------------------------


def entry(value: float, better: str | None = "lower") -> dict:
    return metric([value * 0.99, value, value * 1.01], "s", better)


def run(status: str = "ok", step: float = 1.0, error: str | None = None) -> SideRun:
    metrics = {"step_time_s": entry(step), "loss": entry(2.0, None)} if status == "ok" else {}
    return SideRun(status, error, metrics, "0.1.0")


# --------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written, no worktree left
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# End to end: HEAD against this checkout
# --------------------------------------------------------------------------------------------


@needs_checkout
@pytest.mark.slow
def test_ab_against_head(tmp_path, tiny, capsys, monkeypatch):
    """Same engine on both sides (HEAD's code in a worktree vs this checkout): one full run per side,
    then resident blocks in alternation; the gate passes. The tolerance is wide on purpose: this tests the mechanism, and a timing
    verdict on a shared machine would test the machine's load (the gate's power is a benchmark). At
    least two worker pairs, not the gate's three: both places of the sides and the pooled interval are
    there, one pair's two worker start-ups less on a quiet machine (a loaded one extends the budget for
    more; the number of pairs is the fake sides' to test, test_resident.py)."""
    monkeypatch.setattr(paired, "MIN_WORKER_PAIRS", 2)
    before = worktrees()
    keep = tmp_path / "kept"
    code = main(
        [
            "ab",
            str(tiny),
            "--baseline-ref",
            "HEAD",
            "--budget",
            "10",
            "--tolerance",
            "95%",
            "--device",
            "cpu",
            "--out",
            str(keep),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS: A/B HEAD" in out
    assert any(line.startswith("tiny-ab ") and " step_time_s " in line for line in out.splitlines()), out
    assert worktrees() == before

    def docs(side):
        return [json.loads(p.read_text()) for p in sorted((keep / side / "tiny-ab").rglob("tiny-ab.json"))]

    base, cand = docs("baseline"), docs("candidate")
    assert len(base) == len(cand) == 1 and all(d["status"] == "ok" for d in base + cand)
    blocks = next(line for line in out.splitlines() if line.startswith("tiny-ab ") and " step_time_s " in line)
    assert " x " in blocks and " steps, " in blocks  # the resident blocks ran and were counted
    # Same seed, same code: the state bytes agree exactly, the losses to fp32 rounding (the CPU's
    # threaded reductions are not bit-reproducible from process to process).
    for b, c in zip(base, cand):
        assert b["metrics"]["optimizer_state_bytes"]["median"] == c["metrics"]["optimizer_state_bytes"]["median"]
        assert b["metrics"]["loss"]["samples"] == pytest.approx(c["metrics"]["loss"]["samples"], rel=1e-5)
