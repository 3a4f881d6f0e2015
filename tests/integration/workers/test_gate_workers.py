"""moe-bench ab end to end: both sides' workers against HEAD."""

from __future__ import annotations

import json

import pytest
from ab_checkout import needs_checkout, worktrees, write_tiny_ab

from bench.cli import main
from bench.gate import paired

# --------------------------------------------------------------------------------------------
# End to end: HEAD against this checkout
# --------------------------------------------------------------------------------------------


@needs_checkout
@pytest.mark.slow
def test_ab_against_head(tmp_path, capsys, monkeypatch):
    """Same engine on both sides (HEAD's code in a worktree vs this checkout): one full run per side,
    then resident blocks in alternation; the gate passes. The tolerance is wide on purpose: this tests the mechanism, and a timing
    verdict on a shared machine would test the machine's load (the gate's power is a benchmark). At
    least two worker pairs, not the gate's three: both places of the sides and the pooled interval are
    there, one pair's two worker start-ups less on a quiet machine (a loaded one extends the budget for
    more; the number of pairs is the fake sides' to test, test_resident.py)."""
    monkeypatch.setattr(paired, "MIN_WORKER_PAIRS", 2)
    tiny = write_tiny_ab(tmp_path)
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
