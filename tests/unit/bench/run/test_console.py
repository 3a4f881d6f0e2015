"""What the main job prints: the runner's lines and real warnings, no library chatter from the workers."""

import pytest

from bench.run.process import QUIET_LIBRARIES, worker_env


def test_the_worker_environment_quiets_the_libraries_unless_the_caller_chose(monkeypatch):
    for name in QUIET_LIBRARIES:
        monkeypatch.delenv(name, raising=False)
    assert {name: worker_env(2)[name] for name in QUIET_LIBRARIES} == QUIET_LIBRARIES
    monkeypatch.setenv("KINETO_LOG_LEVEL", "4")
    assert worker_env(2)["KINETO_LOG_LEVEL"] == "4"


def test_plan_rows_give_their_fit_verdict_and_counts_in_t_b_m(tmp_path, capsys):
    """The 1.2T layout needs more than a B300 holds per rank: the summary says so, in GiB, beside
    parameter counts in T and B (hand-checked against the plan's own document)."""
    import json

    from bench.cli import main

    files = ["scenarios/olmo-core3/moe-1.2t-512gpu-fsdp.yaml", "scenarios/olmo-core3/moe-128e-47b.yaml"]
    assert main(["run", *files, "--out", str(tmp_path), "--no-report"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    for name in ("moe-1.2t-512gpu-fsdp", "moe-128e-47b"):
        (path,) = tmp_path.rglob(f"{name}.json")
        doc = json.loads(path.read_text())
        need, have = doc["details"]["memory_total_gib"], doc["details"]["cluster"]["gpu_memory_gib"]
        total = doc["metrics"]["total_params"]["median"]
        if doc["details"]["fits"]:
            assert f"fits b300 ({need:.1f} of {have:.1f} GiB)" in rows[name]
        else:
            assert f"DOES NOT FIT b300 ({need:.1f} > {have:.1f} GiB)" in rows[name]
        assert (need > have) == (not doc["details"]["fits"])
        unit, scale = ("T", 1e12) if total >= 1e12 else ("B", 1e9)
        assert f"{total / scale:.3g}{unit} /" in rows[name]
    assert "DOES NOT FIT" in rows["moe-1.2t-512gpu-fsdp"] and "1.19T /" in rows["moe-1.2t-512gpu-fsdp"]
    assert "fits b300" in rows["moe-128e-47b"]


@pytest.mark.parametrize(
    "n,text",
    [(1193.9e9, "1.19T"), (46.9e9, "46.9B"), (3.18e9, "3.18B"), (3.2e6, "3.2M"), (2.38e12, "2.38T"), (512, "512")],
)
def test_parameter_counts_read_in_t_b_m(n, text):
    from bench.units import format_count

    assert format_count(n) == text
