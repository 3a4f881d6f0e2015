"""Cutting a release runs its ci baseline in worker processes here and records where it is."""

from __future__ import annotations

import pytest
from git_repo import SHA

from bench.release import record
from bench.release.record import Release, load_releases, write_releases

TINY = {
    "schema_version": 1,
    "mode": "execute",
    "model": {
        "vocab_size": 128,
        "d_model": 64,
        "n_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "fp32",
    "run": {"warmup_steps": 1, "steps": 2, "tokens_per_step": 64, "timeout_s": 120},
}


@pytest.mark.slow
def test_cutting_a_release_runs_its_baseline_here_and_records_where_it_is(tmp_path, monkeypatch, capsys):
    import yaml

    from bench import results
    from bench.commands import release as release_command
    from bench.commands.release import _record_baseline

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    path = tmp_path / "releases.json"
    write_releases([Release("0.1.0", SHA, "2025-01-01")], path)
    monkeypatch.setattr(record, "RELEASES_PATH", path)
    monkeypatch.setattr(results, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(release_command, "REPO_ROOT", tmp_path)
    # The command's own bindings of the repository root and the suite's files (it imports the names).
    monkeypatch.setattr(release_command, "suite_files", lambda name, device: [scenario] if name == "ci" else [])
    code = _record_baseline(load_releases(path)[0], "ci")
    out = capsys.readouterr().out
    (release,) = load_releases(path)
    assert release.baseline is not None and release.baseline["results"].startswith("results/")
    written = list((tmp_path / release.baseline["results"]).glob("tiny.json"))
    assert len(written) == 1 and release.baseline["machine"] == written[0].parent.name
    assert f"baseline: 1 scenario(s) of the ci suite in {release.baseline['results']}" in out
    assert "moe-bench ab --baseline-ref v0.1.0" in out
    # On a busy machine the baseline is noisy: the command says to rerun it and exits 1.
    noisy = "not ok or noisy: tiny" in out
    assert code == (1 if noisy else 0)
