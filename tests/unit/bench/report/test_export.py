"""bench.report.export: github-action-benchmark and Bencher Metric Format."""

from __future__ import annotations

import json

import pytest
from result_docs import make_doc

from bench.report.export import (
    BIGGER_TOOL,
    SMALLER_TOOL,
    export,
    export_bencher,
    export_files,
    export_github_action_benchmark,
    measure_slug,
)
from bench.results import load_results, metric, write_result

METRICS = {
    # samples 900, 950, 1000, 1050, 1100: median 1000, IQR 100 (inclusive quartiles 950..1050)
    "tokens_per_s_per_gpu": metric([900, 950, 1000, 1050, 1100], "tokens/s", "higher"),
    "step_time_s": metric([0.1, 0.2, 0.3, 0.4, 0.5], "s", "lower"),
    "peak_tensor_bytes": metric([2048], "bytes", "lower"),
    "loss": metric([2.5, 2.0], "nats", None),
}


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "results" / "0.1.0" / "1xnvidia-h200"
    write_result(make_doc(metrics=METRICS), folder)
    write_result(make_doc("broken", status="failed"), folder)
    return load_results(tmp_path / "results")


def test_github_action_benchmark_split_and_values(docs):
    out = export_github_action_benchmark(docs)
    assert set(out) == {BIGGER_TOOL, SMALLER_TOOL}
    assert [e["name"] for e in out[BIGGER_TOOL]] == ["smoke-e8/tokens_per_s_per_gpu"]
    assert [e["name"] for e in out[SMALLER_TOOL]] == ["smoke-e8/peak_tensor_bytes", "smoke-e8/step_time_s"]
    (tput,) = out[BIGGER_TOOL]
    assert tput["unit"] == "tokens/s"
    assert tput["value"] == 1000
    assert tput["range"] == "± 50"
    assert "1xnvidia-h200" in tput["extra"] and "0.1.0" in tput["extra"]
    assert set(tput) == {"name", "unit", "value", "range", "extra"}
    step = out[SMALLER_TOOL][1]
    assert step["value"] == pytest.approx(0.3)
    assert step["range"] == "± 0.1"
    # info metrics (better null) and not-ok documents are left out
    names = [e["name"] for entries in out.values() for e in entries]
    assert not any("loss" in n or n.startswith("broken/") for n in names)


def test_github_action_benchmark_files(docs):
    files = export_files(docs, "github-action-benchmark")
    assert set(files) == {"-bigger.json", "-smaller.json"}
    bigger = json.loads(files["-bigger.json"])
    smaller = json.loads(files["-smaller.json"])
    assert isinstance(bigger, list) and isinstance(smaller, list)
    assert [e["name"] for e in bigger] == ["smoke-e8/tokens_per_s_per_gpu"]
    assert len(smaller) == 2
    for entry in bigger + smaller:
        assert isinstance(entry["name"], str) and isinstance(entry["unit"], str)
        assert isinstance(entry["value"], (int, float))
    # export() gives the tool -> list object as JSON
    assert json.loads(export(docs, "github-action-benchmark")) == {BIGGER_TOOL: bigger, SMALLER_TOOL: smaller}


def test_bencher_bmf(docs):
    data = json.loads(export(docs, "bencher"))
    assert list(data) == ["smoke-e8"]  # failed scenario left out
    measures = data["smoke-e8"]
    assert set(measures) == {"tokens-per-s-per-gpu", "step-time-s", "peak-tensor-bytes", "loss"}
    assert measures["tokens-per-s-per-gpu"] == {"value": 1000, "lower_value": 900, "upper_value": 1100}
    assert measures["peak-tensor-bytes"] == {"value": 2048}  # one sample: no bounds
    assert measures["loss"] == {"value": 2.25, "lower_value": 2.0, "upper_value": 2.5}
    for metric_obj in measures.values():
        assert all(isinstance(v, (int, float)) for v in metric_obj.values())
        assert metric_obj.get("lower_value", metric_obj["value"]) <= metric_obj["value"]
        assert metric_obj["value"] <= metric_obj.get("upper_value", metric_obj["value"])
    files = export_files(docs, "bencher")
    assert list(files) == [".json"] and json.loads(files[".json"]) == data


def test_repeated_runs_are_pooled(tmp_path):
    folder = tmp_path / "r"
    write_result(make_doc(metrics={"tokens_per_s_per_gpu": metric([100, 200], "tokens/s", "higher")}), folder)
    write_result(
        make_doc(
            metrics={"tokens_per_s_per_gpu": metric([300], "tokens/s", "higher")}, timestamp="2025-01-02T00:00:00Z"
        ),
        folder,
    )
    bmf = export_bencher(load_results(folder))
    assert bmf == {"smoke-e8": {"tokens-per-s-per-gpu": {"value": 200, "lower_value": 100, "upper_value": 300}}}


def test_single_sample_metrics_are_exported_without_a_spread(tmp_path):
    """One sample per run (a peak, a count) has no spread: no range, no bounds, even pooled over runs."""
    folder = tmp_path / "r"
    write_result(make_doc(metrics={"peak_tensor_bytes": metric([2048], "bytes", "lower")}), folder)
    gab = export_github_action_benchmark(load_results(folder))
    assert gab[SMALLER_TOOL] == [
        {
            "name": "smoke-e8/peak_tensor_bytes",
            "unit": "bytes",
            "value": 2048,
            "extra": "machine: 1xnvidia-h200\nengine: 0.1.0 (0123456789ab)\nsamples: 1",
        }
    ]
    write_result(
        make_doc(metrics={"peak_tensor_bytes": metric([4096], "bytes", "lower")}, timestamp="2025-01-02T00:00:00Z"),
        folder,
    )
    docs = load_results(folder)
    assert export_bencher(docs) == {"smoke-e8": {"peak-tensor-bytes": {"value": 3072}}}
    (entry,) = export_github_action_benchmark(docs)[SMALLER_TOOL]
    assert "range" not in entry and entry["value"] == 3072 and "samples: 2 (2 runs)" in entry["extra"]


def test_several_machines_need_machine_in_name(tmp_path):
    for machine in ("1xnvidia-h200", "cpu-16c-test"):
        write_result(
            make_doc(metrics={"tokens_per_s_per_gpu": metric([1.0], "tokens/s", "higher")}, machine=machine),
            tmp_path / machine,
        )
    docs = load_results(tmp_path)
    with pytest.raises(ValueError, match="include_machine"):
        export(docs, "bencher")
    with pytest.raises(ValueError, match="include_machine"):
        export(docs, "github-action-benchmark")
    assert set(export_bencher(docs, include_machine=True)) == {"1xnvidia-h200/smoke-e8", "cpu-16c-test/smoke-e8"}
    names = [e["name"] for e in export_github_action_benchmark(docs, include_machine=True)[BIGGER_TOOL]]
    assert names == ["1xnvidia-h200/smoke-e8/tokens_per_s_per_gpu", "cpu-16c-test/smoke-e8/tokens_per_s_per_gpu"]


def test_measure_slug():
    assert measure_slug("tokens_per_s_per_gpu") == "tokens-per-s-per-gpu"
    assert measure_slug("MoE_fwd_bwd_time_s") == "moe-fwd-bwd-time-s"
    with pytest.raises(ValueError, match=r"Bencher measure slug 'x{65}' is longer than 64 characters"):
        measure_slug("x" * 65)


def test_unknown_format(docs):
    with pytest.raises(ValueError, match="github-action-benchmark"):
        export(docs, "csv")


def test_empty_export():
    assert json.loads(export([], "bencher")) == {}
    files = export_files([], "github-action-benchmark")
    assert json.loads(files["-bigger.json"]) == [] and json.loads(files["-smaller.json"]) == []
