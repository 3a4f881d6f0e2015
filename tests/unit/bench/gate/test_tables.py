"""bench.gate.tables: a comparison as a plain-text table, a rich table and JSON."""

from __future__ import annotations

import json

from result_docs import make_doc

from bench.gate.compare import Comparison, MetricRow, compare
from bench.gate.tables import render_rich_table, render_table, to_json
from bench.results import ResultDocument, metric


def row(metric_name, unit, base, cand, ratio, noise, verdict, *, machine="m", exact=False, scenario="smoke-e8"):
    return MetricRow(
        scenario,
        machine,
        metric_name,
        unit=unit,
        better="lower",
        base=base,
        cand=cand,
        base_rel_iqr=None,
        cand_rel_iqr=None,
        base_n=1,
        cand_n=1,
        ratio=ratio,
        noise=noise,
        threshold=None,
        outside_noise=False,
        verdict=verdict,
        exact=exact,
    )


def comparison(*rows: MetricRow) -> Comparison:
    return Comparison(
        rows=rows,
        compared=(),
        missing_in_candidate=(),
        missing_in_baseline=(),
        not_ok=(),
        mismatched=(),
        tolerance=0.05,
    )


ROWS = (
    row("step_time_s", "s", 0.5, 0.55, 1.1, 0.02, "regressed"),
    row("tokens_per_s_per_gpu", "tokens/s", 12000.0, 12500.0, 12500 / 12000, 0.0, "unchanged", exact=True),
)


def test_render_table_aligns_text_left_and_numbers_right():
    expected = (
        "scenario  metric                unit       base   cand  ratio  noise  verdict\n"
        "--------  --------------------  --------  -----  -----  -----  -----  ---------\n"
        "smoke-e8  step_time_s           s           0.5   0.55  1.100   2.0%  regressed\n"
        "smoke-e8  tokens_per_s_per_gpu  tokens/s  12000  12500  1.042  exact  unchanged\n"
    )
    assert render_table(comparison(*ROWS)) == expected


def test_missing_values_and_an_exact_row_with_a_noise_floor():
    table = render_table(
        comparison(
            row("rss_peak_bytes", "bytes", 100.0, None, None, None, "missing"),
            row("peak_tensor_bytes", "bytes", 4.0, 4.0, 1.0, 0.1, "unchanged", exact=True),
        )
    )
    lines = table.splitlines()
    assert lines[2].split() == ["smoke-e8", "rss_peak_bytes", "bytes", "100", "-", "-", "-", "missing"]
    # Exact, but with a noise allowance of its own: the allowance is shown, not "exact".
    assert lines[3].split() == ["smoke-e8", "peak_tensor_bytes", "bytes", "4", "4", "1.000", "10.0%", "unchanged"]


def test_a_machine_column_appears_only_when_rows_span_machines():
    one = render_table(comparison(row("step_time_s", "s", 1.0, 1.0, 1.0, 0.0, "unchanged", machine="a")))
    assert "machine" not in one
    two = render_table(
        comparison(
            row("step_time_s", "s", 1.0, 1.0, 1.0, 0.0, "unchanged", machine="cpu-a"),
            row("step_time_s", "s", 2.0, 3.0, 1.5, 0.0, "regressed", machine="cpu-b"),
        )
    )
    header, _, first, second = two.splitlines()
    assert header.split() == ["scenario", "machine", "metric", "unit", "base", "cand", "ratio", "noise", "verdict"]
    assert first.split()[:3] == ["smoke-e8", "cpu-a", "step_time_s"]
    assert second.split() == ["smoke-e8", "cpu-b", "step_time_s", "s", "2", "3", "1.500", "0.0%", "regressed"]


def test_nothing_compared_says_so():
    assert render_table(comparison()) == "(no metrics compared)\n"


def test_rich_table_has_the_same_cells_and_colours_the_verdicts():
    table = render_rich_table(comparison(*ROWS), title="smoke")
    assert table.title == "smoke"
    headers = [c.header for c in table.columns]
    assert headers == ["scenario", "metric", "unit", "base", "cand", "ratio", "noise", "verdict"]
    assert [c.justify for c in table.columns] == ["left", "left", "left", "right", "right", "right", "right", "left"]
    cells = [[str(cell) for cell in column._cells] for column in table.columns]
    assert [column[0] for column in cells] == [
        "smoke-e8",
        "step_time_s",
        "s",
        "0.5",
        "0.55",
        "1.100",
        "2.0%",
        "regressed",
    ]
    assert [column[1] for column in cells][-2:] == ["exact", "unchanged"]
    verdicts = table.columns[-1]._cells
    assert (verdicts[0].style, verdicts[1].style) == ("bold red", "")


def test_rich_table_gives_an_unknown_verdict_no_style():
    table = render_rich_table(comparison(row("x", "s", 1.0, 1.0, 1.0, 0.0, "odd")))
    assert table.columns[-1]._cells[0].style == ""


def test_to_json_of_two_documents_writes_infinite_ratios_as_text_and_the_work_verdicts():
    base = make_doc(metrics={"step_time_s": metric([0.0], "s", "lower"), "work_aten_ops": metric([10], "ops", "lower")})
    cand = make_doc(metrics={"step_time_s": metric([1.0], "s", "lower"), "work_aten_ops": metric([12], "ops", "lower")})
    data = json.loads(to_json(compare([ResultDocument(base)], [ResultDocument(cand)])))
    rows = {r["metric"]: r for r in data["rows"]}
    assert rows["step_time_s"]["ratio"] == "inf"
    assert rows["step_time_s"]["verdict"] == "regressed"
    assert rows["work_aten_ops"]["ratio"] == 1.2
    assert data["counts"]["regressed"] == 2
    assert data["compared"] == [["smoke-e8", "1xnvidia-h200"]]
    assert data["work"] == [
        "REGRESSION smoke-e8 work_aten_ops: work increased: +2 ops per step (+20.0%, 10 -> 12) [1xnvidia-h200]"
    ]
    assert data["tolerance"] == 0.05


def test_to_json_ends_with_a_newline_and_is_indented():
    text = to_json(comparison(*ROWS))
    assert text.endswith("}\n")
    assert text.startswith('{\n  "tolerance": 0.05,')
    assert json.loads(text)["work"] == []
