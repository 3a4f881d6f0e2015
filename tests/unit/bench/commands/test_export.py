"""bench.commands.export: ``moe-bench export`` writes one file per suffix beside the --out prefix."""

from __future__ import annotations

import json

from result_docs import make_doc

from bench.cli import main
from bench.commands import export
from bench.results import metric, write_result


def results(tmp_path):
    folder = tmp_path / "results"
    write_result(make_doc("s", {"step_time_s": metric([0.5], "s", "lower")}), folder / "0.1.0" / "m")
    return folder


def test_each_suffix_is_a_file_beside_the_prefix_in_a_folder_made_for_it(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_export_files(docs, fmt, include_machine):
        calls.append(([d.name for d in docs], fmt, include_machine))
        return {"-bigger.json": "[1]\n", "-smaller.json": "[2]\n"}

    monkeypatch.setattr(export, "export_files", fake_export_files)
    prefix = tmp_path / "new" / "dir" / "bench"
    code = main(
        [
            "export",
            str(results(tmp_path)),
            "--format",
            "github-action-benchmark",
            "--out",
            str(prefix),
            "--include-machine",
        ]
    )
    assert code == 0
    assert calls == [(["s"], "github-action-benchmark", True)]
    assert (tmp_path / "new" / "dir" / "bench-bigger.json").read_text() == "[1]\n"
    assert (tmp_path / "new" / "dir" / "bench-smaller.json").read_text() == "[2]\n"
    assert capsys.readouterr().out.splitlines() == [f"wrote {prefix}-bigger.json", f"wrote {prefix}-smaller.json"]


def test_bencher_export_of_a_real_folder(tmp_path, capsys):
    prefix = tmp_path / "out" / "x"
    assert main(["export", str(results(tmp_path)), "--format", "bencher", "--out", str(prefix)]) == 0
    data = json.loads((tmp_path / "out" / "x.json").read_text())
    # Bencher Metric Format: benchmark -> measure (a slug of the metric) -> value.
    assert data == {"s": {"step-time-s": {"value": 0.5}}}
    assert capsys.readouterr().out == f"wrote {prefix}.json\n"


def test_a_bad_file_is_skipped_with_a_warning_and_nothing_readable_is_bad_input(tmp_path, capsys):
    folder = results(tmp_path)
    bad = folder / "0.1.0" / "m" / "bad.json"
    bad.write_text("{")
    assert main(["export", str(folder), "--format", "bencher", "--out", str(tmp_path / "x")]) == 0
    assert f"moe-bench: warning: {bad}: " in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(empty), "--format", "bencher", "--out", str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {empty}: no result documents\n"
    assert not (tmp_path / "y.json").exists()


def test_a_missing_results_folder_writes_nothing(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["export", str(missing), "--format", "bencher", "--out", str(tmp_path / "o" / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error: ") and str(missing) in err
    assert not (tmp_path / "o").exists()
