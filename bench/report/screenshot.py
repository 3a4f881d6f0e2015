"""The report page in headless Chromium: open it, wait until Plotly has drawn every chart, and save a
screenshot of the whole page (``moe-bench report --screenshot``, the browser test).

Needs Selenium (the dev extras) and Chromium with its driver (Debian: ``chromium`` and
``chromium-driver``); without them ``BrowserMissing`` says which is missing.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WIDTH = 1300
DRAW_TIMEOUT_S = 15.0

# What each chart drew: its traces (``g.trace`` in the plot area, one per trace of its data) and the
# marks with a real geometry (a path longer than a degenerate "M0,0Z").
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


class BrowserMissing(RuntimeError):
    """Selenium, Chromium or its driver is not installed (the message says which, and how to get it)."""


@dataclass
class PageView:
    """What the browser saw of a page once its charts were drawn."""

    charts: list[dict[str, Any]]
    """Per chart in page order: its kind, whether Plotly rendered it, its traces, drawn traces, marks."""
    errors: list[str] = field(default_factory=list)
    """The console's SEVERE messages (script errors, failed loads)."""
    screenshot: Path | None = None
    """The whole page as PNG, when asked for."""


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium driven by Selenium, quit on exit."""
    try:
        from selenium import webdriver
    except ImportError as err:
        raise BrowserMissing("selenium is not installed (pip install -e '.[dev]')") from err
    binary = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        raise BrowserMissing(
            "no headless browser: needs Chromium and its driver (apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--window-size={WIDTH},1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def view_page(browser: Any, page: Path, screenshot: Path | None = None) -> PageView:
    """Load ``page``, wait (at most ``DRAW_TIMEOUT_S``) until every chart has drawn each of its traces, and
    report what was drawn; with ``screenshot``, save the whole page there."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(Path(page).resolve().as_uri())

    def drawn(b: Any) -> bool:  # Plotly draws after the page loads
        found = b.execute_script(CHARTS_JS)
        return all(c["rendered"] and c["drawn"] == c["traces"] for c in found)

    with contextlib.suppress(TimeoutException):  # the caller judges what is missing from PageView.charts
        WebDriverWait(browser, DRAW_TIMEOUT_S, poll_frequency=0.2).until(drawn)
    view = PageView(charts=browser.execute_script(CHARTS_JS))
    if screenshot is not None:
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(WIDTH, height)
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        if not browser.save_screenshot(str(screenshot)):
            raise OSError(f"{screenshot}: the browser could not write the screenshot")
        view.screenshot = Path(screenshot)
    view.errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    return view


def undrawn(view: PageView) -> list[str]:
    """The charts the browser did not draw completely, for people."""
    return [
        f"chart {i + 1} ({c['kind']}): "
        + ("not rendered" if not c["rendered"] else f"{c['drawn']} of {c['traces']} traces drawn, {c['marks']} marks")
        for i, c in enumerate(view.charts)
        if not c["rendered"] or c["drawn"] != c["traces"] or not c["traces"] or not c["marks"]
    ]
