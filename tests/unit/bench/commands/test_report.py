"""bench.commands.report: ``moe-bench report`` checks its options and output folder, prints what it wrote, and
checks the page's screenshot; the page and the browser are stood in for."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

import bench.commands.report as report_command
from bench.cli import main
from bench.report.page import ReportError
from bench.report.screenshot import BrowserMissing


@pytest.fixture
def built(monkeypatch):
    """A stand-in page: records the call, warns once, and has a release comparison."""
    calls = []

    def fake_build_report(results, out, base, new, tolerance, on_warning):
        calls.append((results, out, base, new, tolerance))
        on_warning("releases.json: 0.9.0 has no results here")
        versions = SimpleNamespace(base="0.2.0", new="0.3.0")
        comparison = SimpleNamespace(
            versions=versions, header="PASS: 4 scenario(s) compared", sources=["results/0.2.0/m", "results/0.3.0/m"]
        )
        return SimpleNamespace(path=out / "index.html", charts=["trend", "pair", "trend"], comparison=comparison)

    monkeypatch.setattr(report_command, "build_report", fake_build_report)
    return calls


def test_the_page_is_written_and_its_comparison_summarised(tmp_path, built, capsys):
    results = tmp_path / "results"
    assert main(["report", str(results), "--base", "0.2.0", "--new", "0.3.0", "--tolerance", "2.5%"]) == 0
    assert built == [(results, results / "report", "0.2.0", "0.3.0", 0.025)]
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "release comparison 0.2.0 -> 0.3.0: PASS: 4 scenario(s) compared",
        "  compared from results/0.2.0/m",
        "  compared from results/0.3.0/m",
        f"wrote {results / 'report' / 'index.html'} (3 charts)",
    ]
    assert err == "moe-bench: warning: releases.json: 0.9.0 has no results here\n"


def test_a_page_without_a_comparison_says_only_where_it_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        report_command,
        "build_report",
        lambda results, out, **kwargs: SimpleNamespace(path=out / "index.html", charts=[], comparison=None),
    )
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "page")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'page' / 'index.html'} (0 charts)\n"


def test_bad_input_writes_no_page(tmp_path, built, monkeypatch, capsys):
    assert main(["report", str(tmp_path), "--tolerance", "5"]) == 2
    assert "invalid tolerance '5'" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["report", str(tmp_path), "--out", str(blocker / "page")]) == 2
    assert capsys.readouterr().err.startswith(f"moe-bench: error: {blocker / 'page'}: results folder not writable")
    assert built == []

    def refuse(*args, **kwargs):
        raise ReportError(f"{tmp_path}: no result documents")

    monkeypatch.setattr(report_command, "build_report", refuse)
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {tmp_path}: no result documents\n"


@pytest.fixture
def browser(monkeypatch):
    """A stand-in browser whose view of the page each test sets."""
    state = SimpleNamespace(view=SimpleNamespace(screenshot=None, errors=[]), undrawn=[], illegible=[], shots=[])

    @contextlib.contextmanager
    def fake_chromium():
        yield "browser"

    def fake_view_page(browser, page, screenshot):
        state.shots.append((browser, page, screenshot))
        state.view.screenshot = screenshot
        return state.view

    monkeypatch.setattr(report_command, "chromium", fake_chromium)
    monkeypatch.setattr(report_command, "view_page", fake_view_page)
    monkeypatch.setattr(report_command, "undrawn", lambda view: state.undrawn)
    monkeypatch.setattr(report_command, "illegible", lambda view: state.illegible)
    return state


def test_a_clean_screenshot(tmp_path, built, browser, capsys):
    shot = tmp_path / "page.png"
    assert main(["report", str(tmp_path), "--screenshot", str(shot)]) == 0
    assert browser.shots == [("browser", tmp_path / "report" / "index.html", shot)]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {shot} (every chart drawn in headless Chromium, no label over another)"
    )


def test_a_page_that_did_not_render_cleanly_fails_naming_every_problem(tmp_path, built, browser, capsys):
    browser.undrawn = ["chart 2 (trend): not rendered"]
    browser.illegible = ["chart 3 (pair): labels overlap"]
    browser.view.errors = ["Uncaught TypeError"]
    assert main(["report", str(tmp_path), "--screenshot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "moe-bench: error: --screenshot: the page did not render cleanly: chart 2 (trend): not rendered; "
        "chart 3 (pair): labels overlap; browser console: Uncaught TypeError"
    )


@pytest.mark.parametrize("error", [BrowserMissing("selenium is not installed"), OSError("disk full")])
def test_no_browser_is_bad_input_naming_the_option(tmp_path, built, monkeypatch, capsys, error):
    @contextlib.contextmanager
    def missing():
        raise error
        yield

    monkeypatch.setattr(report_command, "chromium", missing)
    assert main(["report", str(tmp_path), "--screenshot", str(Path(tmp_path) / "p.png")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"moe-bench: error: --screenshot: {error}"
