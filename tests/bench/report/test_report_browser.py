"""The report page in a real browser: headless Chromium driven by Selenium.

On a results folder with two versions and failed scenarios (``report_results``): no console errors,
every chart drawn (its traces in the SVG, with marks of non-empty geometry), the comparison table's
verdicts as worked out by hand, and a screenshot of the whole page in the test's folder. Skipped, with
the reason, only where Selenium, Chromium or its driver is not installed (``.ci/run`` installs them:
Debian's ``chromium`` and ``chromium-driver``, and ``selenium`` from the dev extras).
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
from report_results import BASE, EXPECTED_CHARTS, EXPECTED_VERDICTS, NEW, write_comparisons, write_two_versions

from bench.report.comparisons import load_comparisons
from bench.report.page import build_report

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.support.ui import WebDriverWait

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _chromium():
    binary = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless browser: needs Chromium and its driver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                 "--window-size=1300,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=options)


# What each chart drew: its traces (``g.trace`` in the plot area, one per trace of its data) and
# the marks with a real geometry (a path longer than a degenerate "M0,0Z").
CHARTS_JS = """
return [...document.querySelectorAll('figure.chart')].map(figure => {
  const plot = figure.querySelector('.js-plotly-plot');
  if (!plot) return {kind: figure.dataset.chart, rendered: false};
  const marks = [...plot.querySelectorAll('.cartesianlayer g.trace path')]
    .filter(p => (p.getAttribute('d') || '').length > 8);
  return {kind: figure.dataset.chart, rendered: true, traces: (plot.data || []).length,
          drawn: plot.querySelectorAll('.cartesianlayer g.trace').length, marks: marks.length};
});
"""
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
    browser = _chromium()
    try:
        browser.get(report.path.as_uri())
        expected = sum(EXPECTED_CHARTS.values())

        def drawn(b) -> bool:  # Plotly draws after the page loads: wait until every chart has its traces
            found = b.execute_script(CHARTS_JS)
            return len(found) == expected and all(c["rendered"] and c["drawn"] == c["traces"] for c in found)

        with contextlib.suppress(TimeoutException):  # the assertions below say what is missing
            WebDriverWait(browser, 15, poll_frequency=0.2).until(drawn)
        charts = browser.execute_script(CHARTS_JS)
        verdicts = {(s, m): v for s, m, v in browser.execute_script(VERDICTS_JS)}
        gate = browser.find_element("css selector", "[data-gate]").get_attribute("data-gate")
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1300, height)
        screenshot = tmp_path / "report.png"
        assert browser.save_screenshot(str(screenshot))
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    finally:
        browser.quit()
    assert errors == []
    assert [c["kind"] for c in charts] == report.charts and len(charts) == expected
    for chart in charts:
        assert chart["rendered"] and chart["traces"] > 0 and chart["drawn"] == chart["traces"], chart
        assert chart["marks"] > 0, chart
    assert {key: verdicts.get(key) for key in EXPECTED_VERDICTS} == EXPECTED_VERDICTS
    assert gate == "regressed"
    assert screenshot.stat().st_size > 50_000
    print(f"screenshot of the {BASE} -> {NEW} report: {screenshot}")
