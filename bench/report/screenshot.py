"""The report page in headless Chromium: open it, check that every chart is drawn and legible, and save a
screenshot of the whole page (``moe-bench report --screenshot``, the browser test).

Each chart is an inline SVG drawn by matplotlib (``bench.report.charts``); its data series are tagged
``series-N`` (a bar ``series-N-J``), its plot areas ``axes-N`` with their background ``area-N``, and
its ``<figure>`` says how many series it has (``data-series``).

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

# What each chart drew: the series its figure declares, the series the browser laid out with a real
# geometry (a box of some width or height), and the marks (paths and markers) of those series.
CHARTS_JS = """
return [...document.querySelectorAll('figure.chart')].map(figure => {
  const svg = figure.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : null;
  if (!svg || box.width === 0 || box.height === 0) return {kind: figure.dataset.chart, rendered: false};
  const tagged = [...svg.querySelectorAll('g[id^="series-"]')].filter(g => {
    const r = g.getBoundingClientRect(); return r.width > 0 || r.height > 0; });
  const marks = [...svg.querySelectorAll('g[id^="series-"] path, g[id^="series-"] use')].filter(m => {
    const r = m.getBoundingClientRect(); return r.width > 0 || r.height > 0; });
  return {kind: figure.dataset.chart, rendered: true, series: Number(figure.dataset.series),
          drawn: new Set(tagged.map(g => g.id.split('-')[1])).size, marks: marks.length};
});
"""


# What each chart shows legibly, as laid out at the page's width: the texts whose drawn outlines
# overlap (matplotlib draws each text as glyphs in a group under ``text_N``; each group's box goes
# through its own transform, so rotated tick labels are boxes at their angle; two convex boxes overlap
# when no edge's normal separates them by more than a pixel), and the plot areas in which no mark of a
# series is visible.
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
const said = g => [...g.childNodes].filter(n => n.nodeType === Node.COMMENT_NODE).map(n => n.data.trim()).join(' ');
return [...document.querySelectorAll('figure.chart')].map(figure => {
  const svg = figure.querySelector('svg');
  if (!svg) return {kind: figure.dataset.chart, overlaps: [], empty: []};
  const texts = [...svg.querySelectorAll('g[id^="text_"]')].flatMap(g =>
    [...g.children].filter(c => c.tagName === 'g').map(c => ({text: said(g), box: corners(c)})))
    .filter(t => t.box && t.text);
  const overlaps = [];
  for (let i = 0; i < texts.length; i++)
    for (let j = i + 1; j < texts.length; j++)
      if (!apart(texts[i].box, texts[j].box)) overlaps.push([texts[i].text, texts[j].text]);
  const empty = [];
  for (const axes of svg.querySelectorAll('g[id^="axes-"]')) {
    const background = axes.querySelector('g[id^="area-"] path');
    if (!background) continue;
    const area = background.getBoundingClientRect();
    const seen = [...axes.querySelectorAll('g[id^="series-"] path, g[id^="series-"] use')].some(m => {
      const r = m.getBoundingClientRect();
      const w = Math.min(r.right, area.right) - Math.max(r.left, area.left);
      const h = Math.min(r.bottom, area.bottom) - Math.max(r.top, area.top);
      return w >= 0 && h >= 0 && (w > 1 || h > 1);
    });
    if (!seen) empty.push(axes.id);
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
    """Per chart in page order: its kind, whether its SVG was laid out, its series, drawn series, marks."""
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
    """Load ``page`` (the charts are drawn once it has loaded: they are SVG, no script draws them) and
    report what was drawn; with ``screenshot``, save the whole page there."""
    browser.get(Path(page).resolve().as_uri())
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
        + ("not rendered" if not c["rendered"] else f"{c['drawn']} of {c['series']} series drawn, {c['marks']} marks")
        for i, c in enumerate(view.charts)
        if not c["rendered"] or c["drawn"] != c["series"] or not c["series"] or not c["marks"]
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
