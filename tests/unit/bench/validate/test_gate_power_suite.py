"""``python -m bench.validate.gate_power --suite-runs``: whole-suite gate runs, resumable records, and the
suite-level table with its exact interval, without running a gate (``run_ab`` and the clones stubbed)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.ab.gate import ABReport
from bench.ab.resident import ResidentComparison
from bench.validate import gate_power


def test_clopper_pearson_against_closed_forms_and_the_tables():
    # 0 of n: [0, 1 - (alpha/2)^(1/n)]; n of n: [(alpha/2)^(1/n), 1]; 1 of n: lower 1 - (1 - alpha/2)^(1/n).
    assert gate_power.clopper_pearson(0, 20) == pytest.approx((0.0, 1 - 0.025 ** (1 / 20)))
    assert gate_power.clopper_pearson(10, 10) == pytest.approx((0.025 ** (1 / 10), 1.0))
    low, high = gate_power.clopper_pearson(1, 20)
    assert low == pytest.approx(1 - 0.975 ** (1 / 20), rel=1e-9)
    assert high == pytest.approx(0.2487, abs=1e-4)  # the tables' 0.2487
    # 5 of 100, as scipy.stats.beta.ppf(0.025, 5, 96) and beta.ppf(0.975, 6, 95) give it.
    assert gate_power.clopper_pearson(5, 100) == pytest.approx((0.01643, 0.11284), abs=1e-5)
    # The ends are where the binomial tails reach 2.5%.
    low, high = gate_power.clopper_pearson(3, 51)
    tail = sum(math.comb(51, i) * high**i * (1 - high) ** (51 - i) for i in range(4))
    assert tail == pytest.approx(0.025, rel=1e-6)
    with pytest.raises(ValueError, match="3 of 2: not a binomial count"):
        gate_power.clopper_pearson(3, 2)


def suite_record(planted_scenario=None, planted=0.0, failing=(), warned=(), seconds=500.0):
    names = ("a", "b", "c", "d")
    rows = [{"scenario": n, "fails": n in failing, "warned": n in warned} for n in names]
    return {
        "kind": "suite",
        "planted": planted,
        "planted_scenario": planted_scenario,
        "fails": bool(failing),
        "warned": bool(warned),
        "scenarios": rows,
        "seconds": seconds,
        "tolerance": 0.045,
        "warn_above": 0.03,
        "budget_s": 45.0,
        "machine": "a CPU",
    }


def test_the_suite_table_puts_the_false_alarm_rate_first():
    records = [
        suite_record(planted_scenario="b", planted=0.10, failing=("b",)),
        suite_record(planted_scenario="b", planted=0.10, failing=("b", "d"), seconds=620.0),
        *[suite_record(seconds=400.0 + i) for i in range(18)],
        suite_record(failing=("c",)),
        suite_record(warned=("a",)),
        suite_record(planted_scenario="a", planted=0.05, warned=("a",)),
    ]
    lines = gate_power.render_suite(records).splitlines()
    rows = [line.split(" | ") for line in lines[2:5]]
    assert [r[0] for r in rows] == ["| none (A/A)", "| +5% in a", "| +10% in b"]
    assert rows[0][1:5] == ["20", "1 of 20 (5%; 95% interval 0.1% to 24.9%)", "1", "c 1"]
    assert rows[2][1:6] == ["2", "2 of 2 (100%; 95% interval 15.8% to 100.0%)", "0", "b 2, d 1", "560, 620 (1) |"]
    assert lines[-1] == "measured on: a CPU"


def fake_tree(tmp_path: Path, name: str) -> Path:
    tree = tmp_path / name
    tree.mkdir()
    return tree


def test_a_suite_run_plants_one_scenario_and_fails_when_any_scenario_fails(tmp_path, monkeypatch):
    trees = {0.0: fake_tree(tmp_path, "same"), 0.1: fake_tree(tmp_path, "slow")}
    monkeypatch.setattr(gate_power, "head_commit", lambda tree: "f" * 40)
    roots = {}

    def run_ab(plan, device, root, deadline=None):
        (scenario,) = plan.scenarios
        roots[scenario.name] = root
        assert plan.commit == "f" * 40 and plan.tolerance == 0.045 and plan.warn_above == 0.03
        report = ABReport("HEAD", "this checkout", plan.tolerance, 1, warn_above=plan.warn_above)
        if root == trees[0.1]:
            report.failures.append(f"NOT-OK {scenario.name}: planted")
        report.resident = [ResidentComparison(scenario.name, 1, verdict="unchanged")]
        return report

    monkeypatch.setattr(gate_power, "run_ab", run_ab)
    scenarios = [SimpleNamespace(name=n, mode="execute") for n in ("a", "b", "c")]
    record = gate_power.suite_run(scenarios, trees, ("b", 0.1), 0.045, 0.03, 45.0, "cpu")
    assert roots == {"a": trees[0.0], "b": trees[0.1], "c": trees[0.0]}
    assert record["fails"] and [row["fails"] for row in record["scenarios"]] == [False, True, False]
    assert record["scenarios"][1]["failures"] == ["NOT-OK b: planted"]
    assert (record["planted_scenario"], record["planted"]) == ("b", 0.1)
    same = gate_power.suite_run(scenarios, trees, None, 0.045, 0.03, 45.0, "cpu")
    assert not same["fails"] and set(roots.values()) == {trees[0.0]}


def test_a_suite_run_shares_one_time_limit_as_the_gate_does(tmp_path, monkeypatch):
    """With a time limit, the plan-mode scenario runs first and every scenario's gate gets the same
    ``SuiteDeadline`` (run_ab tells it which scenario runs); the record carries the limit."""
    trees = {0.0: fake_tree(tmp_path, "same")}
    monkeypatch.setattr(gate_power, "head_commit", lambda tree: "f" * 40)
    seen = []

    def run_ab(plan, device, root, deadline=None):
        (scenario,) = plan.scenarios
        seen.append((scenario.name, deadline, plan.deadline_s))
        report = ABReport("HEAD", "this checkout", plan.tolerance, 1, warn_above=plan.warn_above)
        report.resident = (
            [ResidentComparison(scenario.name, 1, verdict="unchanged")] if scenario.mode == "execute" else []
        )
        return report

    monkeypatch.setattr(gate_power, "run_ab", run_ab)
    scenarios = [SimpleNamespace(name=n, mode=m) for n, m in (("a", "execute"), ("p", "plan"), ("b", "execute"))]
    record = gate_power.suite_run(scenarios, trees, None, 0.045, 0.03, 45.0, "cpu", deadline_s=570.0)
    assert [name for name, _, _ in seen] == ["p", "a", "b"]
    deadlines = {id(d) for _, d, _ in seen}
    assert len(deadlines) == 1 and seen[0][1].scenarios == ["a", "b"] and seen[0][1].limit_s == 570.0
    assert {limit for _, _, limit in seen} == {570.0} and record["deadline_s"] == 570.0
    without = gate_power.suite_run(scenarios, trees, None, 0.045, 0.03, 45.0, "cpu")
    assert without["deadline_s"] is None and seen[-1][1] is None


def test_suite_runs_resume_from_their_records(tmp_path, monkeypatch, capsys):
    """Each whole-suite run is appended as it ends; a second invocation runs only what is missing."""
    ran = []

    def suite_run(scenarios, trees, cell, tolerance, warn_above, budget_s, device, deadline_s=None):
        ran.append(cell)
        name, fraction = cell if cell else (None, 0.0)
        return suite_record(planted_scenario=name, planted=fraction) | {"tolerance": tolerance}

    monkeypatch.setattr(gate_power, "suite_run", suite_run)
    monkeypatch.setattr(gate_power, "candidate_copy", lambda patch: contextlib.nullcontext(tmp_path))
    records = tmp_path / "suite.jsonl"
    argv = ["--suite-runs", "--aa-runs", "3", "--runs", "1", "--slowdowns", "10%", "--tolerance", "4.5%"]
    argv += ["--warn-above", "3%", "--budget", "45", "--records", str(records)]
    assert gate_power.main(argv) == 0
    # A/A first in each round, then each execute scenario of the ci suite planted once.
    assert ran[0] is None and ran.count(None) == 3 and len(ran) == 3 + 4
    assert {cell[0] for cell in ran if cell} == {
        "e8-random-bf16",
        "e64-random-bf16",
        "e8-skewed-fp32",
        "e8-ep2-nosync-bf16",
    }
    assert (
        len(records.read_text().splitlines()) == 7 and json.loads(records.read_text().splitlines()[0])["fails"] is False
    )
    assert "| none (A/A) | 3 | 0 of 3" in capsys.readouterr().out
    ran.clear()
    argv[2] = "5"
    assert gate_power.main(argv) == 0  # two A/A runs more, nothing else
    assert ran == [None, None]
    ran.clear()
    assert gate_power.main([*argv, "--deadline", "570"]) == 0  # another rule: none of the records counts
    assert ran.count(None) == 5 and len(ran) == 5 + 4
