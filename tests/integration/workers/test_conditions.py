"""A busy machine is recorded ``noisy`` and never read as a regression; one results folder, one run at a time.

- the verdict's arithmetic on hand-made counters (other processes' share, steal, the calibration's move);
- a tiny scenario run while a planted busy loop spins on the cores: the result says ``noisy`` and
  why, the console says so, and neither the gate nor the page built from it reports "Regressed";
- ``results_lock``: a second run into the same folder waits for the first and says why.
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from scenario_files import TINY

from bench.cli import main
from bench.gate.compare import compare
from bench.gate.verdict import gate
from bench.report.page import build_report
from bench.results import REPO_ROOT, load_result, load_results, metric, write_result
from bench.run.conditions import CALIBRATION_MOVE, SHARED_CORES, Snapshot, conditions
from bench.run.runner import LOCK_NAME, results_lock


def calibration(gflops: float) -> dict:
    return {"kernel": "test", "gflops": gflops, "samples": [gflops]}


def test_quiet_counters_are_not_noisy():
    # 2 cores for 10 s = 20 core-seconds; this run used 18.5 of the 19 busy ones: others 0.5 s = 2.5%.
    start = Snapshot(wall=100.0, busy=50.0, steal=1.0, own=3.0, load=0.1)
    end = Snapshot(wall=110.0, busy=69.0, steal=1.2, own=21.5, load=1.9)
    found = conditions(start, end, calibration(100.0), calibration(95.0), cores=2)
    assert found["noisy"] is False and found["reasons"] == []
    assert found["other_cpu_s"] == pytest.approx(0.5)
    assert found["other_cpu_share"] == pytest.approx(0.025)
    assert found["steal_share"] == pytest.approx(0.01)
    assert (found["load_before"], found["load_after"]) == (0.1, 1.9)


def test_shared_cores_steal_and_a_moving_calibration_each_make_a_run_noisy():
    start = Snapshot(wall=0.0, busy=0.0, steal=0.0, own=0.0, load=3.0)
    # Others used 9 of 20 core-seconds (45%), steal 2 (10%), the calibration fell 40%.
    end = Snapshot(wall=10.0, busy=19.0, steal=2.0, own=10.0, load=3.5)
    found = conditions(start, end, calibration(100.0), calibration(60.0), cores=2)
    assert found["noisy"] is True
    assert found["other_cpu_share"] == pytest.approx(0.45)
    reasons = " | ".join(found["reasons"])
    assert "other processes used 45% of the 2 cores" in reasons
    assert "CPU steal 10%" in reasons
    assert "calibration moved -40%" in reasons
    # Just under each threshold: quiet.
    end = Snapshot(wall=10.0, busy=10.0 + 20 * SHARED_CORES * 0.9, steal=0.0, own=10.0, load=0.0)
    moved = 100.0 * (1 - CALIBRATION_MOVE * 0.9)
    assert conditions(start, end, calibration(100.0), calibration(moved), cores=2)["noisy"] is False


def _write_tiny(folder: Path) -> Path:
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


@pytest.mark.slow
def test_a_run_beside_a_busy_loop_is_noisy_and_the_page_reports_no_regression(tmp_path, capsys):
    out = tmp_path / "results"
    # The planted busy loop: one process spinning for as long as the run lasts.
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert main(["run", str(_write_tiny(tmp_path)), "--out", str(out), "--device", "cpu", "--no-plots"]) == 0
    finally:
        spinner.kill()
        spinner.wait()
    console = capsys.readouterr().out
    (noisy_doc,) = load_results(out)
    found = noisy_doc.data["conditions"]
    assert found["noisy"] is True, found
    assert any("other processes used" in r for r in found["reasons"]), found["reasons"]
    assert found["other_cpu_share"] > SHARED_CORES
    assert "NOISY" in console and "other processes used" in console
    assert noisy_doc.status == "ok" and noisy_doc.metrics  # what was measured is kept
    assert noisy_doc.data["scenario"]["file"] == "tiny.yaml"  # not where this machine keeps it
    assert len(noisy_doc.data["scenario"]["digest"]) == 64

    # A quiet baseline of an older version on the same machine, twice as fast: read as a regression
    # were the noisy run compared.
    base = copy.deepcopy(noisy_doc.data)
    base["engine"]["version"] = "0.0.1"
    base["conditions"] = {**base["conditions"], "noisy": False, "reasons": []}
    for name in ("step_time_s", "tokens_per_s_per_gpu"):
        entry = base["metrics"][name]
        factor = 0.5 if name == "step_time_s" else 2.0
        base["metrics"][name] = metric([v * factor for v in entry["samples"]], entry["unit"], entry["better"])
    base_path = write_result(base, out / "0.0.1" / noisy_doc.machine)

    comparison = compare([load_result(base_path)], [noisy_doc])
    assert comparison.regressions == () and comparison.compared == ()
    (issue,) = comparison.not_compared
    assert issue.kind == "noisy" and issue.side == "candidate"
    verdict = gate(comparison)
    assert verdict.exit_code == 3 and verdict.report.startswith("NOT COMPARED: ")  # not compared, not regressed
    assert any(line.startswith("NOISY tiny") and "other processes used" in line for line in verdict.failures)

    report = build_report(out, tmp_path / "page", releases=[])
    assert report.comparison is not None and report.comparison.outcome == "not-compared"
    page = report.path.read_text()
    assert "data-gate='not-compared'" in page
    assert "<b>Regressed</b>" not in page and "class='verdict verdict-regressed'" not in page
    assert "NOISY tiny" in page


def test_a_second_run_into_one_results_folder_waits_and_says_why(tmp_path, caplog):
    folder = tmp_path / "results"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from bench.run.runner import results_lock; "
            "lock = results_lock(Path(sys.argv[1])); print('held', flush=True); time.sleep(1.5); lock.close()",
            str(folder),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="bench.run.runner"):
            lock = results_lock(folder)
        waited = time.monotonic() - started
        lock.close()
    finally:
        holder.kill()
        holder.wait()
    assert waited > 0.5, "the second run did not wait for the first"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "bench.run.runner"]
    assert line.startswith(f"waiting: moe-bench run (pid {holder.pid}") and str(folder) in line
    assert json.dumps(line)  # one printable line
    assert (folder / LOCK_NAME).exists()
