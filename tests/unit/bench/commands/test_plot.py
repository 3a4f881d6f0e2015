"""bench.commands.plot: ``moe-bench plot`` checks its folder, warns of unreadable files and says what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.report.plot
from bench.cli import main
from bench.results import ResultFileError, ResultValidationError


@pytest.fixture
def plotted(monkeypatch):
    """Stand in for the charts: record the call, report one unreadable file, write two files."""
    calls = []

    def fake_plot_results(results_dir, out_dir, on_bad_file=None):
        calls.append((results_dir, out_dir))
        on_bad_file(ResultFileError(results_dir / "old.json", "not JSON"))
        return [out_dir / "index.html", out_dir / "trend.png"]

    monkeypatch.setattr(bench.report.plot, "plot_results", fake_plot_results)
    return calls


def test_plot_says_how_many_files_and_where_the_index_is(tmp_path, plotted, capsys):
    out = tmp_path / "plots"
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert plotted == [(tmp_path, out)]
    captured = capsys.readouterr()
    assert captured.out == f"wrote 2 files; open {out / 'index.html'}\n"
    assert captured.err == f"moe-bench: warning: {tmp_path / 'old.json'}: not JSON; skipped\n"


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_plot_refuses_what_is_not_a_folder(tmp_path, plotted, capsys, kind):
    target = tmp_path / "results.json"
    if kind == "file":
        target.write_text("{}")
    assert main(["plot", str(target), "--out", str(tmp_path / "plots")]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {target}: no such results folder\n"
    assert plotted == []


@pytest.mark.parametrize("error", [ValueError("bad scale"), ResultValidationError("result document invalid at x")])
def test_an_error_while_plotting_is_one_line_of_bad_input(tmp_path, monkeypatch, capsys, error):
    def broken(results_dir: Path, out_dir: Path, on_bad_file=None):
        raise error

    monkeypatch.setattr(bench.report.plot, "plot_results", broken)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "plots")]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {error}\n"
