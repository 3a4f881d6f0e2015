"""The moe-bench subcommands over real result files: exit codes and outputs."""

from __future__ import annotations

import json

import pytest
from result_docs import make_doc

from bench.cli import main
from bench.results import metric, write_result
from bench.run.micro import fold_benchmarks


@pytest.fixture
def sides(tmp_path):
    base, cand = tmp_path / "base", tmp_path / "cand"
    write_result(make_doc("s", {"tokens_per_s_per_gpu": metric([1000, 1001, 999, 1000], "tokens/s", "higher")}), base)
    cand_metrics = {"tokens_per_s_per_gpu": metric([700, 701, 699, 700], "tokens/s", "higher")}
    write_result(make_doc("s", cand_metrics, version="0.2.0"), cand)
    return base, cand


def test_gate_exit_codes(sides, capsys):
    base, cand = sides
    assert main(["gate", "--baseline", str(base), "--candidate", str(cand)]) == 1
    assert "REGRESSION s tokens_per_s_per_gpu" in capsys.readouterr().out
    assert main(["gate", "--baseline", str(base), "--candidate", str(cand), "--tolerance", "40%"]) == 0
    assert main(["gate", "--baseline", str(base), "--candidate", str(base)]) == 0


def test_compare_prints_every_metric(sides, capsys):
    base, cand = sides
    assert main(["compare", str(base), str(cand)]) == 0
    out = capsys.readouterr().out
    assert "tokens_per_s_per_gpu" in out and "0.700" in out and "regressed" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gate", "--baseline", "{missing}", "--candidate", "{cand}"], "no such file or folder"),
        (["gate", "--baseline", "{base}", "--candidate", "{cand}", "--tolerance", "lots"], "tolerance"),
        (["compare", "{base}", "{missing}"], "no such file or folder"),
        (["export", "{missing}", "--format", "bencher"], "no such file or folder"),
        (["plot", "{missing}", "--out", "{tmp}/plots"], "no such results folder"),
    ],
)
def test_bad_input_exits_2(sides, tmp_path, capsys, argv, message):
    base, cand = sides
    values = {"base": base, "cand": cand, "missing": tmp_path / "missing", "tmp": tmp_path}
    assert main([a.format(**values) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error:") and message in err and "Traceback" not in err


def test_invalid_result_file_is_bad_input(sides, capsys):
    base, cand = sides
    (cand / "broken.json").write_text(json.dumps({"schema_version": 1}))
    assert main(["gate", "--baseline", str(base), "--candidate", str(cand)]) == 2
    assert "result document invalid" in capsys.readouterr().err


def test_export_and_plot_write_files(sides, tmp_path):
    base, cand = sides
    assert main(["export", str(cand), "--format", "github-action-benchmark", "--out", str(tmp_path / "e" / "gab")]) == 0
    bigger = json.loads((tmp_path / "e" / "gab-bigger.json").read_text())
    assert bigger[0]["name"] == "s/tokens_per_s_per_gpu" and bigger[0]["value"] == 700
    assert main(["plot", str(cand), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "index.html").exists()


def test_micro_benchmark_report_folds_into_metrics():
    report = {
        "benchmarks": [
            {"name": "test_moe_layer[E64-k8]", "stats": {"median": 2.0, "data": [2.0, 2.2, 1.9]},
             "extra_info": {"flops": 4e9, "tokens": 4096}},
            {"name": "test_dense_swiglu_same_flops", "stats": {"median": 1.0, "data": [1.0, 1.1]},
             "extra_info": {"flops": 4e9}},
        ],
        "derived": {"moe_layer_vs_dense_flops": {"ratio": 0.5, "target": 0.7}},
    }
    metrics = fold_benchmarks(report)
    assert metrics["moe_layer_e64_k8_time_s"]["samples"] == [2.0, 2.2, 1.9]
    assert metrics["moe_layer_e64_k8_gflops"]["median"] == pytest.approx(2.0)
    assert metrics["dense_swiglu_same_flops_gflops"]["median"] == pytest.approx((4 / 1.0 + 4 / 1.1) / 2)
    assert metrics["moe_layer_vs_dense_flops"]["median"] == 0.5
