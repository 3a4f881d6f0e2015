"""The report's release comparison prefers results measured on one machine in one job (``moe-bench ab --out``,
``moe-bench versions``) over stored results of the two versions from different machines, and says so.

The crafted machines: one label, ``cpu-2c-intel-r-xeon``; the stored 0.2.0 result calibrated at 100 GFLOP/s
and 18,617 tokens/s, the stored 0.3.0 result on another VM at 80 GFLOP/s and 14,678 tokens/s (x0.79: read
across machines, a regression). The A/B folder measured both versions on one machine at 90 GFLOP/s:
10,000 tokens/s in both, so the comparison it gives is "unchanged".
"""

from __future__ import annotations

import copy
from pathlib import Path

from result_docs import make_doc

from bench.report.collect import choose_versions, load_result_set, same_machine_sources
from bench.report.page import build_report
from bench.report.release_table import release_comparison
from bench.results import metric, write_result

MACHINE = "cpu-2c-intel-r-xeon"
IDENTITY = {
    "cpu_model": "Intel(R) Xeon(R) Processor",
    "cpu_cores": 2,
    "isa_flags": ["avx", "avx2", "avx512f", "fma"],
    "memory_gib": 23.6,
    "gpu": None,
    "calibration": {"kernel": "fp32 512x512 matmul", "gflops": 100.0, "samples": [100.0]},
}


def _result(folder: Path, version: str, gflops: float, tokens: float, scenario: str = "e8-skewed-fp32") -> Path:
    metrics = {
        "tokens_per_s_per_gpu": metric([tokens * f for f in (0.99, 1.0, 1.01)], "tokens/s", "higher"),
        "step_time_s": metric([2048 / tokens * f for f in (0.99, 1.0, 1.01)], "s", "lower"),
    }
    data = make_doc(scenario, metrics, version=version, machine=MACHINE)
    data["scenario"]["file"] = f"scenarios/smoke/{scenario}.yaml"
    identity = copy.deepcopy(IDENTITY)
    identity["calibration"]["gflops"] = gflops
    data["machine"] = {**data["machine"], "gpu_name": None, "gpu_count": 0, "identity": identity}
    return write_result(data, folder / version / MACHINE)


def _stored_pair(root: Path) -> None:
    _result(root, "0.2.0", gflops=100.0, tokens=18617.0)
    _result(root, "0.3.0", gflops=80.0, tokens=14678.0)


def _ab_pair(root: Path, folder: str = "ab-0.2.0") -> None:
    """``moe-bench ab --out root/folder``'s layout: <side>/<scenario>/<version>/<machine>/<scenario>.json."""
    _result(root / folder / "baseline" / "e8-skewed-fp32", "0.2.0", gflops=90.0, tokens=10000.0)
    _result(root / folder / "candidate" / "e8-skewed-fp32", "0.3.0", gflops=91.0, tokens=10000.0)


def test_stored_results_of_two_machines_alone_are_not_compared(tmp_path):
    _stored_pair(tmp_path)
    results = load_result_set(tmp_path, ["0.2.0"])
    comparison = release_comparison(results, choose_versions(results))
    assert comparison.outcome == "not-compared" and comparison.sources == ()


def test_the_release_comparison_uses_the_ab_pair_and_says_so(tmp_path):
    _stored_pair(tmp_path)
    _ab_pair(tmp_path)
    results = load_result_set(tmp_path, ["0.2.0"])
    (source,) = same_machine_sources(results)
    assert (source.kind, source.folder, len(source.docs)) == ("ab", "ab-0.2.0", 2)
    comparison = release_comparison(results, choose_versions(results))
    assert comparison.comparison.not_compared == ()
    rows = {r.metric: r for r in comparison.comparison.rows}
    # 10,000 -> 10,000 tokens/s: the A/B medians, not the stored 18,617 -> 14,678.
    assert (rows["tokens_per_s_per_gpu"].base, rows["tokens_per_s_per_gpu"].cand) == (10000.0, 10000.0)
    assert rows["tokens_per_s_per_gpu"].verdict == "unchanged" and comparison.outcome == "pass"
    assert comparison.sources == (
        "A/B results (moe-bench ab --out) in ab-0.2.0, both versions on one machine: e8-skewed-fp32",
    )

    page = build_report(tmp_path, tmp_path / "page", releases=["0.2.0"]).path.read_text()
    assert "data-gate='pass'" in page and "different machines: not compared" not in page
    assert "Compared from A/B results (moe-bench ab --out) in ab-0.2.0" in page


def test_moe_bench_report_names_the_ab_pair_it_compared(tmp_path, capsys):
    from bench.cli import main

    _stored_pair(tmp_path)
    _ab_pair(tmp_path)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "page")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("release comparison 0.2.0 -> 0.3.0: PASS: 1 scenario(s) compared")
    assert (
        "  compared from A/B results (moe-bench ab --out) in ab-0.2.0, both versions on one machine: e8-skewed-fp32"
        in out
    )


def test_image_results_are_preferred_and_stored_results_fill_the_rest(tmp_path):
    """A ``moe-bench versions`` run (its report/versions-results.txt lists the images' result files) covers
    one scenario; a second scenario has stored results from one machine only, compared as before."""
    _stored_pair(tmp_path)
    images = tmp_path / "images"
    written = [
        _result(images, "0.2.0", gflops=90.0, tokens=10000.0),
        _result(images, "0.3.0", gflops=90.0, tokens=12000.0),
    ]
    (images / "report").mkdir()
    (images / "report" / "versions-results.txt").write_text(
        "".join(f"{p.relative_to(images).as_posix()}\n" for p in written)
    )
    # A stored result in the same folder that the versions run did not write: not one of the images'.
    _result(images / "stored", "0.3.0", gflops=50.0, tokens=1.0, scenario="e8-random-bf16")
    _result(tmp_path, "0.2.0", gflops=100.0, tokens=500.0, scenario="e64-random-bf16")
    _result(tmp_path, "0.3.0", gflops=99.0, tokens=500.0, scenario="e64-random-bf16")

    results = load_result_set(tmp_path, ["0.2.0"])
    comparison = release_comparison(results, choose_versions(results))
    rows = {(r.scenario, r.metric): r for r in comparison.comparison.rows}
    assert rows[("e8-skewed-fp32", "tokens_per_s_per_gpu")].cand == 12000.0
    assert rows[("e8-skewed-fp32", "tokens_per_s_per_gpu")].verdict == "improved"
    assert rows[("e64-random-bf16", "tokens_per_s_per_gpu")].verdict == "unchanged"
    assert comparison.comparison.not_compared == ()
    assert comparison.sources == (
        "image results (moe-bench versions) in images, both versions on one machine: e8-skewed-fp32",
        "stored results of each version: 1 other scenario",
    )


def test_an_ab_folder_of_other_versions_leaves_the_stored_comparison_alone(tmp_path):
    _stored_pair(tmp_path)
    _result(tmp_path / "ab" / "baseline" / "e8-skewed-fp32", "0.1.0", gflops=90.0, tokens=10000.0)
    _result(tmp_path / "ab" / "candidate" / "e8-skewed-fp32", "0.2.0", gflops=90.0, tokens=10000.0)
    results = load_result_set(tmp_path, ["0.1.0", "0.2.0"])
    comparison = release_comparison(results, choose_versions(results, base="0.2.0", new="0.3.0"))
    assert comparison.sources == () and comparison.outcome == "not-compared"
