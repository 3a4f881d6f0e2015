"""``moe-bench report``: the page's content and order, and bad input (one line, exit 2, no traceback)."""

from __future__ import annotations

import html
import re
from collections import Counter

import pytest
from report_results import BASE, EXPECTED_CHARTS, FAILED, MACHINE, NEW, write_comparisons, write_two_versions
from result_docs import make_doc

from bench.cli import main
from bench.report.comparisons import load_comparisons
from bench.report.page import build_report
from bench.results import REPO_ROOT, result_dir, write_result

TRUNCATED = '{"schema_version": 2, "engine": {"vers'


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_two_versions(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def report(folder, tmp_path_factory):
    comparisons = load_comparisons(write_comparisons(tmp_path_factory.mktemp("c") / "comparisons.yaml"))
    return build_report(folder, tmp_path_factory.mktemp("page"), releases=[BASE], comparisons=comparisons)


def test_the_page_holds_every_chart_and_needs_no_network(report):
    assert Counter(report.charts) == EXPECTED_CHARTS
    text = report.path.read_text()
    figures = re.findall(r'<figure class="chart" id="chart-\d+" data-chart="[a-z-]+" data-series="\d+"><svg ', text)
    assert len(figures) == sum(EXPECTED_CHARTS.values())
    assert "<script" not in text and "<link" not in text and "<img" not in text  # SVG inline, nothing to load
    assert len(text) < 1_500_000  # no JavaScript bundle: the charts are the page's bulk


def test_problems_come_first_then_the_comparison_trends_and_experiments(report):
    text = report.path.read_text()
    body = text[text.index("<body>") :]
    order = [body.index(f"id='{section}'") for section in ("problems", "comparison", "trends", "experiments")]
    assert order == sorted(order)
    problems = body[order[0] : order[1]]
    for (name, version), (status, error) in FAILED.items():
        assert re.search(
            rf"status-{status}'>{status}</span></td><td>{name}</td><td>{MACHINE}</td><td>{version}</td>"
            rf"<td><pre>{re.escape(error)}</pre>",
            problems,
        )


def test_the_comparison_table_names_its_versions_and_machine_and_the_gates_verdict(report):
    text = report.path.read_text()
    # Three rows regressed (e8-random-bf16's tokens/s and step time, e8-ep2-nosync-bf16's host syncs) and
    # e8-dp2-fsdp-bf16 failed in the new version: the banner says regressed first and counts each kind.
    assert "data-gate='regressed'><b>Regressed</b>: " in text
    banner = dict(re.findall(r"<span class='count' data-count='([a-z-]+)'>([^<]+)</span>", text))
    assert banner.pop("unchanged").endswith(" unchanged")  # the plan's figures among them
    assert banner == {
        "regressed": "3 regressed",
        "accepted": "0 accepted",
        "inconclusive": "0 inconclusive",
        "missing": f"0 scenarios missing in {NEW}",
        "not-ok": "1 not ok or changed",
        "improved": "2 improved",
        "one-side": "0 metrics on one side only",
    }
    tables = re.findall(
        r"<table class='comparison' data-scenario='([^']+)' data-machine='([^']+)' "
        r"data-base='([^']+)' data-new='([^']+)'>",
        text,
    )
    assert {t[0] for t in tables} == {"e8-random-bf16", "e64-random-bf16", "e8-ep2-nosync-bf16", "moe-128e-47b"}
    assert {t[1:] for t in tables} == {(MACHINE, BASE, NEW)}
    assert (
        "<td>tokens_per_s_per_gpu</td><td>1,000 tokens/s</td><td>800 tokens/s</td><td>0.800</td><td>-20.0%</td>" in text
    )


def test_every_hover_label_names_its_machine_and_version(report):
    """Each series of each chart carries its hover text into the page's SVG, and each names a machine and
    a version."""
    text = report.path.read_text()
    for chart in report.figures:
        assert chart.series and chart.tips, f"a chart without series: {chart.title}"
        tagged = {gid.split("-")[1] for gid in chart.tips}
        assert tagged == {str(k) for k in range(len(chart.series))}, chart.title
        for gid, tip in chart.tips.items():
            assert MACHINE in tip and (BASE in tip or NEW in tip), tip
            assert f'<g id="{gid}"><title>{html.escape(tip)}</title>' in text


def test_report_command_on_the_results_folder(folder, tmp_path, capsys):
    out = tmp_path / "page"
    assert main(["report", str(folder), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert f"release comparison {BASE} -> {NEW}: FAIL" in captured.out
    assert f"wrote {out / 'index.html'}" in captured.out
    assert main(["report", str(folder), "--base", NEW, "--new", BASE, "--out", str(out)]) == 0
    assert f"release comparison {NEW} -> {BASE}" in capsys.readouterr().out


def test_report_of_the_repositorys_own_results(tmp_path, capsys):
    documents = [p for p in (REPO_ROOT / "results").rglob("*.json") if p.name != "schema.json"]
    if not documents:
        pytest.skip("no committed results here (the image leaves results/ out: .dockerignore)")
    assert main(["report", str(REPO_ROOT / "results"), "--out", str(tmp_path / "page")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert "id='experiments'" in (tmp_path / "page" / "index.html").read_text()


def _bad(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_exit_2(folder, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = ["--out", str(tmp_path / "page")]
    assert (
        _bad(["report", str(empty), *out], capsys)
        == f"moe-bench: error: {empty}: no result documents; nothing to draw\n"
    )
    assert (
        _bad(["report", str(tmp_path / "nowhere"), *out], capsys)
        == f"moe-bench: error: {tmp_path / 'nowhere'}: no such results folder\n"
    )
    assert _bad(["report", str(folder), "--base", "0.0.7", *out], capsys) == (
        f"moe-bench: error: --base 0.0.7: no results of that version in {folder} (versions there: {BASE}, {NEW})\n"
    )
    assert _bad(["report", str(folder), "--new", "1.0.0", *out], capsys).startswith(
        "moe-bench: error: --new 1.0.0: no results of that version"
    )
    assert _bad(["report", str(folder), "--base", BASE, "--new", BASE, *out], capsys).count("\n") == 1
    assert _bad(["report", str(folder), "--tolerance", "5", *out], capsys).startswith(
        "moe-bench: error: invalid tolerance '5'"
    )
    assert not (tmp_path / "page").exists()


def test_unreadable_documents_are_named_and_skipped(tmp_path, capsys):
    root = tmp_path / "results"
    folder = result_dir(root, "0.1.0", "m")
    folder.mkdir(parents=True)
    (folder / "old.json").write_text(TRUNCATED)
    (folder / "list.json").write_text("[1, 2]")
    out = ["--out", str(tmp_path / "page")]
    err = _bad(["report", str(root), *out], capsys).splitlines()
    assert err[0] == (
        f"moe-bench: warning: {folder / 'list.json'}: not a result document: the JSON is an array, "
        "not an object; skipped"
    )
    assert err[1].startswith(f"moe-bench: warning: {folder / 'old.json'}: not valid JSON: ")
    assert err[1].endswith("; skipped")
    assert err[2:] == [f"moe-bench: error: {root}: no result documents (2 unreadable files skipped); nothing to draw"]
    write_result(make_doc("s", version="0.1.0"), folder)
    assert main(["report", str(root), *out]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("moe-bench: warning:") for line in err)
    page = (tmp_path / "page" / "index.html").read_text()
    assert str(folder / "old.json") in page and str(folder / "list.json") in page
    assert "One version only (0.1.0): nothing to compare yet." in page


def test_a_screenshot_without_a_browser_is_one_line_and_exit_2(folder, tmp_path, capsys, monkeypatch):
    from bench.report import screenshot

    monkeypatch.setattr(screenshot.shutil, "which", lambda name: None)
    err = _bad(
        ["report", str(folder), "--out", str(tmp_path / "page"), "--screenshot", str(tmp_path / "p.png")], capsys
    )
    assert err.strip() == (
        "moe-bench: error: --screenshot: no headless browser: needs Chromium and its driver "
        "(apt-get install chromium chromium-driver)"
    )
    assert (tmp_path / "page" / "index.html").exists() and not (tmp_path / "p.png").exists()


def test_every_section_is_filled_after_the_default_suite(tmp_path):
    """A results folder holding what ``moe-bench run`` of the default suite writes on a CPU host (every one
    of its scenarios: the real plans, and execute runs with made-up timings) fills every section of the
    page; the only experiment it cannot draw is the proxies' projection breakdown (the default suite
    runs no proxy), and the page names it once in the collapsed list."""
    import copy

    import torch

    from bench.predict.plan import plan_scenario
    from bench.results import metric
    from bench.run.suites import suite_files
    from bench.scenario import load_scenario

    folder = result_dir(tmp_path / "results", NEW, MACHINE)
    for i, path in enumerate(suite_files("default", torch.device("cpu"))):
        scenario = load_scenario(path)
        if scenario.mode == "plan":
            metrics, details = plan_scenario(scenario)
        else:
            tokens = [1000.0 + 10 * i + d for d in (0, 5, -5, 10, -10)]
            metrics = {
                "tokens_per_s_per_gpu": metric(tokens, "tokens/s", "higher"),
                "step_time_s": metric([1000 / t for t in tokens], "s", "lower"),
                "peak_tensor_bytes": metric([(100 + i) * 2**20], "bytes", "lower"),
            }
            details = None
        doc = make_doc(scenario.name, metrics, spec=copy.deepcopy(scenario.spec), version=NEW, machine=MACHINE)
        doc["mode"] = scenario.mode
        doc["scenario"]["file"] = str(path.relative_to(REPO_ROOT))
        if details is not None:
            doc["details"] = details
        write_result(doc, folder)
    report = build_report(tmp_path / "results", tmp_path / "page", releases=[])
    page = report.path.read_text()
    experiments = page[page.index("id='experiments'") :]
    headings = re.findall(r"<h3>([^<]+)</h3>", experiments)
    assert headings == ["Expert-count sweep", "Pair comparisons", "Activation recompute", "Plan memory per rank"]
    assert re.findall(r"<summary>Not drawn from these results: ([^<]+)</summary>", page) == ["Projection breakdowns"]
    assert "Nothing to draw" not in page
    kinds = Counter(report.charts)
    assert kinds["pair"] >= 4 and kinds["sweep"] >= 1 and kinds["recompute"] == 1 and kinds["plan-memory"] == 1
