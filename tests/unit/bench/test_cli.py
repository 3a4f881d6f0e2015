"""The moe-bench subcommands over real result files: exit codes and outputs."""

from __future__ import annotations

import json

import pytest
from result_docs import make_doc, refuse_reads

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


# A result file cut off mid-write, one that is valid JSON but not a result document, and one that
# cannot be read: gate and compare stop on it (exit 2), export and plot skip it with a warning.
TRUNCATED = '{"timestamp": '
INVALID = json.dumps(make_doc("t", status="exploded"))
BAD_FILES = {
    "truncated": "not valid JSON: Expecting value: line 1 column 15 (char 14)",
    "schema": "result document invalid at status: 'exploded' is not one of "
    "['ok', 'failed', 'oom', 'timeout', 'skipped']",
    "unreadable": "cannot read: Permission denied",
}


@pytest.fixture(params=sorted(BAD_FILES))
def bad_file(request, sides, monkeypatch):
    """(path, reason) of a bad file planted in the candidate side."""
    _, cand = sides
    path = cand / "old.json"
    path.write_text(INVALID if request.param == "schema" else TRUNCATED)
    if request.param == "unreadable":
        refuse_reads(monkeypatch, path)
    return path, BAD_FILES[request.param]


@pytest.mark.parametrize("command", ["gate", "compare"])
def test_gate_and_compare_stop_on_a_bad_result_file(sides, bad_file, command, capsys):
    base, cand = sides
    path, reason = bad_file
    argv = (
        ["gate", "--baseline", str(base), "--candidate", str(cand)]
        if command == "gate"
        else ["compare", str(base), str(cand)]
    )
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"moe-bench: error: {path}: {reason}\n"
    assert captured.out == ""


def test_export_skips_a_bad_result_file(sides, bad_file, tmp_path, capsys):
    _, cand = sides
    path, reason = bad_file
    out = tmp_path / "e" / "bmf"
    assert main(["export", str(cand), "--format", "bencher", "--out", str(out)]) == 0
    assert capsys.readouterr().err == f"moe-bench: warning: {path}: {reason}; skipped\n"
    exported = json.loads((tmp_path / "e" / "bmf.json").read_text())
    assert exported["s"]["tokens-per-s-per-gpu"]["value"] == 700  # the good document, still exported


def test_plot_skips_a_bad_result_file(sides, bad_file, tmp_path, capsys):
    _, cand = sides
    path, reason = bad_file
    assert main(["plot", str(cand), "--out", str(tmp_path / "plots")]) == 0
    assert capsys.readouterr().err == f"moe-bench: warning: {path}: {reason}; skipped\n"
    assert (tmp_path / "plots" / "1xnvidia-h200--s.png").is_file()  # the good document, still drawn
    assert str(path) in (tmp_path / "plots" / "index.html").read_text()


def test_run_rewrites_the_report_past_a_bad_old_result_file(tmp_path, capsys):
    from bench.scenario import SCENARIOS_DIR

    out = tmp_path / "results"
    old = out / "0.0.1" / "cpu-box" / "old.json"
    old.parent.mkdir(parents=True)
    old.write_text(TRUNCATED)
    assert (
        main(["run", str(SCENARIOS_DIR / "olmo-core3" / "moe-8e-4.6b.yaml"), "--device", "cpu", "--out", str(out)]) == 0
    )
    captured = capsys.readouterr()
    assert f"moe-bench: warning: {old}: {BAD_FILES['truncated']}; skipped" in captured.err.splitlines()
    assert "Traceback" not in captured.err and "report page failed" not in captured.err
    page = (out / "report" / "index.html").read_text()
    assert "moe-8e-4.6b" in page and str(old) in page
    assert f"report: {out / 'report' / 'index.html'}" in captured.out.splitlines()
    assert not (out / "plots").exists()


def test_no_report_and_its_old_name_skip_the_page(tmp_path):
    from bench.scenario import SCENARIOS_DIR

    for flag in ("--no-report", "--no-plots"):
        out = tmp_path / flag
        assert (
            main(
                [
                    "run",
                    str(SCENARIOS_DIR / "olmo-core3" / "moe-8e-4.6b.yaml"),
                    "--device",
                    "cpu",
                    "--out",
                    str(out),
                    flag,
                ]
            )
            == 0
        )
        assert not (out / "report").exists()


@pytest.mark.parametrize("command", ["gate", "compare", "export"])
def test_a_folder_without_result_documents_is_bad_input(sides, tmp_path, command, capsys):
    base, _ = sides
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = {
        "gate": ["gate", "--baseline", str(base), "--candidate", str(empty)],
        "compare": ["compare", str(base), str(empty)],
        "export": ["export", str(empty), "--format", "bencher", "--out", str(tmp_path / "e")],
    }[command]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {empty}: no result documents\n"
    (empty / "old.json").write_text(TRUNCATED)
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    if command == "export":  # skipped with a warning, then nothing is left
        assert err == [
            f"moe-bench: warning: {empty / 'old.json'}: {BAD_FILES['truncated']}; skipped",
            f"moe-bench: error: {empty}: no result documents (1 unreadable file skipped)",
        ]
    else:
        assert err == [f"moe-bench: error: {empty / 'old.json'}: {BAD_FILES['truncated']}"]


def test_plot_of_a_folder_without_result_documents_writes_an_empty_page(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty), "--out", str(tmp_path / "plots")]) == 0
    assert capsys.readouterr().err == ""
    assert "0 document(s)" in (tmp_path / "plots" / "index.html").read_text()


def test_gate_on_the_committed_release_baseline(tmp_path, capsys):
    """The committed (version 1) documents still gate: against themselves, and with peak memory +6%."""
    import shutil

    from bench.results import REPO_ROOT

    baseline = REPO_ROOT / "results" / "0.1.0" / "cpu-2c-amd-epyc"
    if not baseline.is_dir():
        pytest.skip("no committed results here (the image leaves results/ out: .dockerignore)")
    assert main(["gate", "--baseline", str(baseline), "--candidate", str(baseline)]) == 0
    assert capsys.readouterr().out.startswith("PASS: 5 scenario(s) compared")
    cand = tmp_path / "cand"
    shutil.copytree(baseline, cand)
    path = cand / "e8-skewed-fp32.json"
    doc = json.loads(path.read_text())
    entry = doc["metrics"]["optimizer_state_bytes"]
    entry["samples"] = [entry["median"] * 1.06]
    entry["median"] = entry["spread"]["min"] = entry["spread"]["max"] = entry["samples"][0]
    path.write_text(json.dumps(doc))
    assert main(["gate", "--baseline", str(baseline), "--candidate", str(cand)]) == 1
    regressions = [line for line in capsys.readouterr().out.splitlines() if line.startswith("REGRESSION")]
    assert len(regressions) == 1
    assert regressions[0].startswith("REGRESSION e8-skewed-fp32 optimizer_state_bytes: ")
    assert "(x1.060, tolerance 5%, exact value) bytes [cpu-2c-amd-epyc]" in regressions[0]


def test_export_and_plot_write_files(sides, tmp_path):
    _base, cand = sides
    assert main(["export", str(cand), "--format", "github-action-benchmark", "--out", str(tmp_path / "e" / "gab")]) == 0
    bigger = json.loads((tmp_path / "e" / "gab-bigger.json").read_text())
    assert bigger[0]["name"] == "s/tokens_per_s_per_gpu" and bigger[0]["value"] == 700
    assert main(["plot", str(cand), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "index.html").exists()


def test_micro_benchmark_report_folds_into_metrics():
    report = {
        "benchmarks": [
            {
                "name": "test_moe_layer[E64-k8]",
                "stats": {"median": 2.0, "data": [2.0, 2.2, 1.9]},
                "extra_info": {"flops": 4e9, "tokens": 4096},
            },
            {
                "name": "test_dense_swiglu_same_flops",
                "stats": {"median": 1.0, "data": [1.0, 1.1]},
                "extra_info": {"flops": 4e9},
            },
        ],
        "derived": {"moe_layer_vs_dense_flops": {"ratio": 0.5, "target": 0.7}},
    }
    metrics = fold_benchmarks(report)
    assert metrics["moe_layer_e64_k8_time_s"]["samples"] == [2.0, 2.2, 1.9]
    assert metrics["moe_layer_e64_k8_gflops"]["median"] == pytest.approx(2.0)
    assert metrics["dense_swiglu_same_flops_gflops"]["median"] == pytest.approx((4 / 1.0 + 4 / 1.1) / 2)
    assert metrics["moe_layer_vs_dense_flops"]["median"] == 0.5


def test_the_run_summary_shows_a_proxy_at_its_gpu_projection_not_at_cpu_compute(capsys, tmp_path):
    from bench.commands.run import print_summary
    from bench.run.runner import Outcome
    from bench.scenario import load_scenario

    scenario = load_scenario("scenarios/olmo-core3/moe-1.2t-512gpu-proxy.yaml")
    metrics = {
        "projected_tokens_per_s_per_gpu": metric([0.195], "tokens/s", None),
        "projected_tflops_per_gpu": metric([0.069], "TFLOP/s", None),
    }
    details = {"device_projections": {"b300": {"tokens_per_s_per_gpu": 1012.99, "tflops_per_gpu": 358.32}}}
    print_summary([Outcome(scenario, "ok", None, tmp_path / "r.json", metrics, 1.0, details=details)])
    out = capsys.readouterr().out
    assert "1,013 (proj. b300)" in out and "358.3 (proj. b300)" in out
    assert "0.069" not in out
