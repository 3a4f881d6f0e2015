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


# What each chart shows legibly, as laid out at the page's width: the texts whose drawn outlines
# overlap (each text's box through its own transform, so rotated tick labels are boxes at their
# angle; two convex boxes overlap when no edge's normal separates them by more than a pixel), and the
# plot areas in which no mark of a trace is visible (each subplot's area from Plotly's own axes).
LEGIBILITY_JS = """
const corners = t => {
  const b = t.getBBox(), m = t.getScreenCTM();
  if (!m || b.width === 0 || b.height === 0) return null;
  const p = (x, y) => { const q = t.ownerSVGElement.createSVGPoint(); q.x = x; q.y = y;
                        const r = q.matrixTransform(m); return [r.x, r.y]; };
  return [p(b.x, b.y), p(b.x + b.width, b.y), p(b.x + b.width, b.y + b.height), p(b.x, b.y + b.height)];
};
const apart = (a, b) => [a, b].some(poly => poly.some((c, i) => {
  const d = poly[(i + 1) % 4], n = [d[1] - c[1], c[0] - d[0]], len = Math.hypot(n[0], n[1]) || 1;
  const proj = q => q.map(v => (v[0] * n[0] + v[1] * n[1]) / len);
  const pa = proj(a), pb = proj(b);
  return Math.min(Math.max(...pa), Math.max(...pb)) - Math.max(Math.min(...pa), Math.min(...pb)) < 1.5;
}));
return [...document.querySelectorAll('figure.chart')].map(figure => {
  const plot = figure.querySelector('.js-plotly-plot');
  if (!plot || !plot._fullLayout) return {kind: figure.dataset.chart, overlaps: [], empty: []};
  const texts = [...plot.querySelectorAll('.main-svg text, .main-svg tspan.line')]
    .filter(t => !t.closest('.hoverlayer, .modebar, .legend .bg') && t.textContent.trim()
                 && !(t.tagName === 'text' && t.querySelector('tspan.line')))
    .map(t => ({text: t.textContent.trim(), box: corners(t)})).filter(t => t.box);
  const overlaps = [];
  for (let i = 0; i < texts.length; i++)
    for (let j = i + 1; j < texts.length; j++)
      if (!apart(texts[i].box, texts[j].box)) overlaps.push([texts[i].text, texts[j].text]);
  const origin = plot.getBoundingClientRect(), empty = [];
  for (const [name, sub] of Object.entries(plot._fullLayout._plots || {})) {
    const x = sub.xaxis, y = sub.yaxis;
    const area = {left: origin.left + x._offset, right: origin.left + x._offset + x._length,
                  top: origin.top + y._offset, bottom: origin.top + y._offset + y._length};
    const node = plot.querySelector('.cartesianlayer .subplot.' + name);
    const marks = node ? [...node.querySelectorAll('g.trace path, g.trace text')] : [];
    const seen = marks.some(m => {
      const r = m.getBoundingClientRect();
      const w = Math.min(r.right, area.right) - Math.max(r.left, area.left);
      const h = Math.min(r.bottom, area.bottom) - Math.max(r.top, area.top);
      return w >= 0 && h >= 0 && (w > 1 || h > 1);
    });
    if (!seen) empty.push(name);
  }
  return {kind: figure.dataset.chart, overlaps: overlaps, empty: empty};
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
    legibility: list[dict[str, Any]] = field(default_factory=list)
    """Per chart in page order: its kind, the pairs of texts drawn over each other, the plot areas
    (subplots) in which no mark is visible (``LEGIBILITY_JS``)."""


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium driven by Selenium, quit on exit."""
    try:  # optional: selenium, a development dependency
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
    # optional: selenium (``chromium`` checked it is there)
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(Path(page).resolve().as_uri())

    def drawn(b: Any) -> bool:  # Plotly draws after the page loads
        found = b.execute_script(CHARTS_JS)
        return all(c["rendered"] and c["drawn"] == c["traces"] for c in found)

    with contextlib.suppress(TimeoutException):  # the caller judges what is missing from PageView.charts
        WebDriverWait(browser, DRAW_TIMEOUT_S, poll_frequency=0.2).until(drawn)
    view = PageView(charts=browser.execute_script(CHARTS_JS), legibility=browser.execute_script(LEGIBILITY_JS))
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


def illegible(view: PageView) -> list[str]:
    """The charts that do not read at the page's width, for people: labels drawn over each other, a
    plot area with nothing visible in it."""
    found = []
    for i, chart in enumerate(view.legibility):
        for a, b in chart["overlaps"][:3]:
            found.append(f"chart {i + 1} ({chart['kind']}): {a!r} drawn over {b!r}")
        if len(chart["overlaps"]) > 3:
            found.append(f"chart {i + 1} ({chart['kind']}): {len(chart['overlaps']) - 3} more overlapping labels")
        for name in chart["empty"]:
            found.append(f"chart {i + 1} ({chart['kind']}): plot area {name} shows nothing")
    return found
