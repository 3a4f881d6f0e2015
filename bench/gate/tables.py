"""A comparison as a plain-text table, a rich table and JSON."""

from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from bench.gate.compare import Comparison
from bench.gate.work import work_findings
from bench.units import format_number, format_percent, format_ratio

_COLUMNS = ("scenario", "metric", "unit", "base", "cand", "ratio", "noise", "verdict")


def _table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    multi_machine = len({r.machine for r in comparison.rows}) > 1
    header = list(_COLUMNS)
    if multi_machine:
        header.insert(1, "machine")
    body = []
    for r in comparison.rows:
        cells = [
            r.scenario,
            r.metric,
            r.unit,
            format_number(r.base),
            format_number(r.cand),
            format_ratio(r.ratio),
            "exact" if r.exact and r.noise == 0 else format_percent(r.noise, 1),
            r.verdict,
        ]
        if multi_machine:
            cells.insert(1, r.machine)
        body.append(cells)
    return header, body


def render_table(comparison: Comparison) -> str:
    """Plain-text table of every metric row (a machine column appears when rows span machines)."""
    header, body = _table_rows(comparison)
    if not body:
        return "(no metrics compared)\n"
    numeric = {"base", "cand", "ratio", "noise"}
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if header[i] in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in body)]) + "\n"


_VERDICT_STYLE = {
    "regressed": "bold red",
    "accepted": "cyan",
    "inconclusive": "magenta",
    "improved": "green",
    "unchanged": "",
    "info": "dim",
    "missing": "yellow",
}


def render_rich_table(comparison: Comparison, title: str | None = None):
    """The same table as a ``rich.table.Table`` (verdicts coloured)."""

    header, body = _table_rows(comparison)
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="right" if name in {"base", "cand", "ratio", "noise"} else "left")
    for cells in body:
        verdict = cells[-1]
        style = _VERDICT_STYLE.get(verdict, "")
        table.add_row(*(Text(c) for c in cells[:-1]), Text(verdict, style=style))
    return table


def to_json(comparison: Comparison) -> str:
    """The comparison as indented JSON text."""
    return json.dumps({**comparison.to_dict(), "work": work_findings(comparison)}, indent=2) + "\n"
