"""``index.html`` of ``moe-bench plot``: a self-contained page with every figure, the reference release's
comparisons (``comparison_rows``: each pair's ratio per version and machine, pooled as the gate pools), the
documents that are not ok, the files skipped and a table of every document (``write_index``).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path

from bench.report.collect import ResultSet
from bench.report.comparisons import PairComparison, PairRatio, load_comparisons, pair_ratios
from bench.report.ordering import version_sort_key
from bench.results import ResultDocument, ResultFileError, age_key

__all__ = ["INDEX_NAME", "comparison_rows", "write_index"]

INDEX_NAME = "index.html"

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em; color: #222; }
h1, h2 { font-weight: 600; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #555; margin-top: 0.3em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr.notok td { background: #fff0f0; }
td.status-ok { color: #1a7f37; }
td.status-bad { color: #b42318; font-weight: 600; }
"""


def comparison_rows(
    results: ResultSet, comparisons: list[PairComparison] | None = None
) -> list[tuple[str, str, PairRatio]]:
    """(version, machine, pair ratio) for every comparison pair with both sides ok there (default
    comparisons: those of ``scenarios/suites.yaml``)."""
    comparisons = load_comparisons() if comparisons is None else comparisons
    rows = []
    for version in results.versions:
        for machine in results.machines:
            by_name = {s: (g.status, g.metrics) for (s, m), g in results.ok_groups(version).items() if m == machine}
            rows += [(version, machine, r) for r in pair_ratios(comparisons, by_name)]
    return rows


def _comparisons_html(rows: list[tuple[str, str, PairRatio]]) -> list[str]:
    e = html.escape
    parts = [
        "<h2>Comparisons</h2>",
        (
            "<p>The reference release's comparisons: each pair's ratio of the medians, numerator / denominator, "
            'with its 95% interval from the two runs\' own samples ("within noise" when it holds 1; '
            "<code>bench.report.comparisons</code>). Pairs defined in <code>scenarios/suites.yaml</code>, "
            "<code>comparisons</code>.</p>"
        ),
        (
            "<table><thead><tr><th>version</th><th>machine</th><th>comparison</th><th>numerator</th>"
            "<th>denominator</th><th>metric</th><th>ratio</th><th>published</th><th>mirrors</th></tr></thead><tbody>"
        ),
    ]
    for version, machine, r in rows:
        parts.append(
            f"<tr><td>{e(version)}</td><td>{e(machine)}</td><td>{e(r.comparison.label)}</td><td>{e(r.numerator)}</td>"
            f"<td>{e(r.denominator)}</td><td>{e(r.metric or '')}</td><td>{e(r.describe())}</td>"
            f"<td>{e(r.comparison.reference)}</td><td>{e(r.comparison.mirrors)}</td></tr>"
        )
    parts.append("</tbody></table>")
    return parts


def write_index(
    out_dir: Path,
    figures: list[tuple[Path, str]],
    docs: list[ResultDocument],
    results_dir: Path,
    skipped: Iterable[ResultFileError] = (),
    comparisons: Iterable[tuple[str, str, PairRatio]] = (),
) -> Path:
    """Write ``out_dir/index.html``: every figure, the comparisons, the documents not ok, the skipped files
    and a table of every document; returns its path."""
    e = html.escape
    skipped = list(skipped)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>moe-bench results</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>moe-bench results</h1>",
        f"<p>Source: <code>{e(str(results_dir))}</code> — {len(docs)} document(s).</p>",
        "<h2>Figures</h2>",
    ]
    if figures:
        for path, caption in figures:
            parts.append(
                f'<figure><img src="{e(path.name, quote=True)}" alt="{e(caption, quote=True)}">'
                f"<figcaption>{e(caption)}</figcaption></figure>"
            )
    else:
        parts.append("<p>No figures (no ok results with metrics).</p>")

    # Both sides are ok runs here; a pair whose metric one side lacks has no ratio to show.
    comparisons = [row for row in comparisons if row[2].ratio is not None]
    if comparisons:
        parts += _comparisons_html(comparisons)
    bad = [d for d in docs if d.status != "ok"]
    rows_sorted = sorted(docs, key=lambda d: (version_sort_key(d.version), d.machine, d.name, age_key(d)))
    if bad:
        parts.append(f"<h2>Not ok ({len(bad)})</h2><ul>")
        for d in sorted(bad, key=lambda d: (version_sort_key(d.version), d.machine, d.name)):
            parts.append(
                f"<li>{e(d.name)} — {e(d.machine)}, {e(d.version)}: <b>{e(d.status)}</b>"
                + (f" — {e(str(d.data.get('error')))}" if d.data.get("error") else "")
                + "</li>"
            )
        parts.append("</ul>")
    if skipped:
        parts.append(f"<h2>Skipped files ({len(skipped)})</h2><ul>")
        for err in skipped:
            parts.append(f"<li><code>{e(str(err.path))}</code>: {e(err.reason)}</li>")
        parts.append("</ul>")
    parts.append("<h2>Documents</h2>")
    parts.append(
        "<table><thead><tr><th>version</th><th>machine</th><th>scenario</th><th>mode</th>"
        "<th>status</th><th>error</th><th>file</th></tr></thead><tbody>"
    )
    for d in rows_sorted:
        ok = d.status == "ok"
        try:
            rel = str(d.path.relative_to(results_dir)) if d.path is not None else ""
        except ValueError:
            rel = str(d.path)
        parts.append(
            f'<tr class="{"ok" if ok else "notok"}"><td>{e(d.version)}</td><td>{e(d.machine)}</td>'
            f"<td>{e(d.name)}</td><td>{e(str(d.data.get('mode', '')))}</td>"
            f'<td class="{"status-ok" if ok else "status-bad"}">{e(d.status)}</td>'
            f"<td>{e(str(d.data.get('error') or ''))}</td><td><code>{e(rel)}</code></td></tr>"
        )
    parts.append("</tbody></table></body></html>")
    path = out_dir / INDEX_NAME
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path
