"""The report page in a real browser: headless Chromium driven by Selenium.

On a results folder with two versions and failed scenarios (``report_results``): no console errors,
every chart drawn (each of its series in the SVG, with marks of non-empty geometry), the comparison table's
verdicts as worked out by hand, and a screenshot of the whole page in the test's folder. Skipped, with
the reason, only where Selenium, Chromium or its driver is not installed (``.ci/run`` installs them:
Debian's ``chromium`` and ``chromium-driver``, and ``selenium`` from the dev extras).
"""

from __future__ import annotations

import contextlib
import re

import pytest
from report_results import BASE, EXPECTED_CHARTS, EXPECTED_VERDICTS, NEW, write_comparisons, write_two_versions

from bench.cli import main
from bench.report.comparisons import load_comparisons
from bench.report.page import build_report
from bench.report.screenshot import BrowserMissing, chromium, illegible, undrawn, view_page
from bench.results import REPO_ROOT

pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")


@contextlib.contextmanager
def _chromium():
    try:
        with chromium() as browser:
            yield browser
    except BrowserMissing as err:
        pytest.skip(str(err))


VERDICTS_JS = """
return [...document.querySelectorAll('table.comparison')].flatMap(table =>
  [...table.tBodies[0].rows].map(row => [table.dataset.scenario, row.cells[0].textContent,
                                         row.cells[row.cells.length - 1].textContent]));
"""


@pytest.mark.slow
def test_the_report_renders_in_chromium(tmp_path):
    results = write_two_versions(tmp_path / "results")
    comparisons = load_comparisons(write_comparisons(tmp_path / "comparisons.yaml"))
    report = build_report(results, tmp_path / "page", releases=[BASE], comparisons=comparisons)
    screenshot = tmp_path / "report.png"
    with _chromium() as browser:
        view = view_page(browser, report.path, screenshot)
        verdicts = {(s, m): v for s, m, v in browser.execute_script(VERDICTS_JS)}
        gate = browser.find_element("css selector", "[data-gate]").get_attribute("data-gate")
    assert view.errors == []
    assert [c["kind"] for c in view.charts] == report.charts and len(view.charts) == sum(EXPECTED_CHARTS.values())
    assert undrawn(view) == []
    assert illegible(view) == []
    assert {key: verdicts.get(key) for key in EXPECTED_VERDICTS} == EXPECTED_VERDICTS
    assert gate == "regressed"
    assert screenshot.stat().st_size > 50_000
    print(f"screenshot of the {BASE} -> {NEW} report: {screenshot}")


# Each section of the page as the browser lays it out: its heading and whether a chart, a table or text
# follows it before the next heading.
SECTIONS_JS = """
const heads = [...document.querySelectorAll('h2, h3')];
return heads.map((h, i) => {
  let filled = false;
  for (let n = h.nextElementSibling; n && !['H2', 'H3'].includes(n.tagName); n = n.nextElementSibling) {
    if (n.matches('figure.chart, table, ul, div.gate, details') || n.querySelector('figure.chart, table')
        || (n.tagName === 'P' && !n.classList.contains('absent') && n.textContent.trim())) filled = true;
  }
  return [h.tagName, h.textContent.trim(), filled];
});
"""


def _committed_results(folder):
    """A copy of the result files git tracks under results/: what a user's own commands wrote there
    (the README's commands run scenarios into results/) is theirs, not the repository's."""
    import shutil
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "-z", "results"], cwd=REPO_ROOT, capture_output=True, check=True)
        names = [n for n in listed.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # no git: the folder as it is
        return REPO_ROOT / "results"
    for name in names:
        target = folder / name.removeprefix("results/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target)
    return folder


@pytest.mark.slow
def test_the_repositorys_own_results_read_right_in_chromium(tmp_path, capsys):
    """``moe-bench report results --screenshot`` on the committed results, as a new user runs it: every
    chart drawn, no console error, no empty section, the releases named as releases.json has them, and
    the accepted changes shown with their reasons."""
    if not any(p.suffix == ".json" and p.name != "schema.json" for p in (REPO_ROOT / "results").rglob("*")):
        pytest.skip("no committed results here (the image leaves results/ out: .dockerignore)")
    with _chromium():
        pass  # skips here, with the reason, where there is no browser to take the screenshot
    out, screenshot = tmp_path / "page", tmp_path / "report.png"
    code = main(
        ["report", str(_committed_results(tmp_path / "results")), "--out", str(out), "--screenshot", str(screenshot)]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "every chart drawn in headless Chromium" in printed.out
    with _chromium() as browser:
        view = view_page(browser, out / "index.html")
        sections = browser.execute_script(SECTIONS_JS)
        text = browser.find_element("tag name", "body").text
        gate = browser.find_element("css selector", "[data-gate]").get_attribute("data-gate")
    assert view.errors == [] and undrawn(view) == [] and view.charts
    assert illegible(view) == []
    empty = [title for _, title, filled in sections if not filled]
    assert empty == [], f"sections with nothing under them: {empty}"
    assert "Nothing to draw" not in text
    from bench.release.record import load_releases

    releases = [r.version for r in load_releases()]
    for called in re.findall(r"([\w.+-]+),? the latest release", text):
        assert called == releases[-1], f"{called} called the latest release; releases.json: {releases}"
    assert gate != "regressed", "the project's own release fails its own gate on the page"
    for release in load_releases():
        for accepted in release.accepted:
            assert f"accepted: {accepted.reason}" in text


def _planted_page(path):
    """Four charts at the page's width: tick labels forced level and crowded, two points' text labels over
    each other, a series entirely outside its axis range, and one chart that reads right."""
    from matplotlib.figure import Figure

    from bench.report.charts import Chart

    def chart(kind):
        figure = Figure(figsize=(12, 4), layout="constrained")
        made = Chart(kind, kind, kind, kind, figure)
        return made, figure.subplots()

    crowded, ax = chart("crowded")
    crowded.add("bars", ax.bar(range(30), range(30)), [f"bar {i}" for i in range(30)])
    ax.set_xticks(range(30), [f"scenario-with-a-long-name-{i}" for i in range(30)], rotation=0)
    labelled, ax = chart("labelled")
    labelled.add("points", ax.scatter([1, 1.02, 2], [1, 1, 1]), "points")
    ax.annotate("a long label here", (1, 1), xytext=(0, 8), textcoords="offset points")
    ax.annotate("and another", (1.02, 1), xytext=(0, 8), textcoords="offset points")
    nothing, ax = chart("nothing")
    nothing.add("line", ax.plot([1, 2, 3], [5, 6, 7])[0], "line")
    ax.set_ylim(100, 200)
    fine, ax = chart("fine")
    fine.add("bars", ax.bar(["a", "b"], [1, 2]), ["a", "b"])
    body = "".join(
        f"<figure class='chart' data-chart='{c.kind}' data-series='{len(c.series)}'>{c.svg()}</figure>"
        for c in (crowded, labelled, nothing, fine)
    )
    path.write_text(f"<html><head><meta charset='utf-8'></head><body>{body}</body></html>")
    return path


@pytest.mark.slow
def test_the_legibility_check_finds_overlapping_labels_and_a_chart_that_draws_nothing(tmp_path):
    page = _planted_page(tmp_path / "planted.html")
    with _chromium() as browser:
        view = view_page(browser, page)
    found = illegible(view)
    # matplotlib clips a line to its axes: one outside them leaves no geometry, which both checks see.
    assert undrawn(view) == ["chart 3 (nothing): 0 of 1 series drawn, 0 marks"]
    assert any(line.startswith("chart 1 (crowded): 'scenario-with-a-long-name-0' drawn over") for line in found)
    assert any(line.startswith("chart 2 (labelled): 'a long label here' drawn over") for line in found)
    assert "chart 3 (nothing): plot area axes-0 shows nothing" in found
    assert not any("(fine)" in line for line in found)


@pytest.mark.slow
def test_the_plans_of_every_scenario_read_right_in_chromium(tmp_path):
    """The page of the largest results folder a CPU machine writes quickly: the plan of every scenario of
    the repository (the expert-count sweep, the recompute modes and plan memory per rank crowd with
    them): no labels over each other, no empty plot area."""
    from bench.results import REPO_ROOT as root

    files = sorted(str(p) for p in (root / "scenarios").glob("*/*.yaml"))
    assert main(["plan", *files, "--out", str(tmp_path / "plans")]) == 0
    report = build_report(tmp_path / "plans", tmp_path / "page", releases=[])
    with _chromium() as browser:
        view = view_page(browser, report.path)
    assert view.errors == [] and undrawn(view) == []
    assert illegible(view) == []
