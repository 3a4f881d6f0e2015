"""bench.gate.compare: matching, pooling, the noise model, the gate and its report."""

from __future__ import annotations

import json

import pytest
from result_docs import make_doc
from rich.table import Table

from bench.gate.compare import classify, compare, compare_paths
from bench.gate.formatting import parse_tolerance
from bench.gate.groups import group_documents
from bench.gate.tables import render_rich_table, render_table, to_json
from bench.gate.verdict import EXIT_NOT_COMPARED, gate
from bench.gate.work import work_verdicts
from bench.results import load_results, metric, write_result


def spread(median: float, rel_iqr: float, n: int = 5) -> list[float]:
    """n samples around ``median`` whose relative IQR is exactly ``rel_iqr`` (n = 5, inclusive quartiles)."""
    assert n == 5
    half = rel_iqr * median / 2
    return [median - 2 * half, median - half, median, median + half, median + 2 * half]


def tput(median: float, rel_iqr: float = 0.01) -> dict:
    return metric(spread(median, rel_iqr), "tokens/s", "higher")


def side(tmp_path, label: str, *docs: dict):
    """Write docs under ``tmp_path/label/<version>/<machine>/`` (the results layout) and load them back."""
    folder = tmp_path / label
    folder.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        write_result(doc, folder / doc["engine"]["version"] / doc["machine"]["name"])
    return load_results(folder)


def run_gate(tmp_path, base_docs, cand_docs, tolerance=0.05):
    base = side(tmp_path, "base", *base_docs)
    cand = side(tmp_path, "cand", *cand_docs)
    return gate(compare(base, cand), tolerance)


def row_of(result, metric_name, scenario="smoke-e8"):
    (row,) = [r for r in result.comparison.rows if r.metric == metric_name and r.scenario == scenario]
    return row


# ---------------------------------------------------------------------------------------------


def test_spread_helper_gives_requested_rel_iqr():
    m = tput(1000, 0.3)
    assert m["median"] == 1000
    assert m["spread"]["rel_iqr"] == pytest.approx(0.3)


def test_regression_caught(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000, 0.01)})],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(800, 0.01)})],
    )
    assert result.exit_code == 1
    assert not result.passed
    row = row_of(result, "tokens_per_s_per_gpu")
    assert row.verdict == "regressed"
    assert row.ratio == pytest.approx(0.8)
    assert row.noise == pytest.approx(0.02)
    assert row.outside_noise
    assert "REGRESSION smoke-e8 tokens_per_s_per_gpu: 1000 -> 800 (x0.800, tolerance 5%, noise 2.0%)" in result.report
    assert result.report.splitlines()[0].startswith("FAIL")
    assert "1 regressed" in result.report.splitlines()[0]
    assert len(result.failures) == 1


def test_a_change_within_the_noise_is_inconclusive_not_failed(tmp_path):
    """-20% against a noise of 30% + 30%: beyond the 5% tolerance, within the noise: inconclusive."""
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000, 0.3)})],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(800, 0.3)})],
    )
    assert result.exit_code == 0
    row = row_of(result, "tokens_per_s_per_gpu")
    assert row.noise == pytest.approx(0.6)
    assert row.threshold == pytest.approx(0.6)
    assert not row.outside_noise
    assert row.verdict == "inconclusive"
    assert "REGRESSION" not in result.report
    assert result.report.startswith("PASS")
    assert "0 regressed, 0 accepted, 1 inconclusive, 0 improved, 0 unchanged" in result.report.splitlines()[0]
    # The same noise with a change within the tolerance: unchanged.
    assert classify(0.96, 0.6, "higher", 0.05) == (False, "unchanged")
    assert classify(0.94, 0.6, "higher", 0.05) == (False, "inconclusive")


def test_within_tolerance_tolerated(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000, 0.0)})],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(970, 0.0)})],
        tolerance=0.05,
    )
    assert result.exit_code == 0
    assert row_of(result, "tokens_per_s_per_gpu").verdict == "unchanged"
    # Exactly at the tolerance is not beyond it.
    assert classify(0.95, 0.0, "higher", 0.05) == (False, "unchanged")
    assert classify(1.05, 0.0, "lower", 0.05) == (False, "unchanged")


def test_gate_tolerance_overrides_compare_tolerance(tmp_path):
    base = side(tmp_path, "base", make_doc(metrics={"tokens_per_s_per_gpu": tput(1000, 0.0)}))
    cand = side(tmp_path, "cand", make_doc(metrics={"tokens_per_s_per_gpu": tput(900, 0.0)}))
    comparison = compare(base, cand, tolerance=0.05)
    assert comparison.rows[0].verdict == "regressed"
    assert gate(comparison, 0.05).exit_code == 1
    loose = gate(comparison, 0.15)
    assert loose.exit_code == 0
    assert loose.comparison.tolerance == 0.15
    assert loose.comparison.rows[0].verdict == "unchanged"
    assert gate(comparison).exit_code == 1  # None keeps the comparison's tolerance


@pytest.mark.parametrize(
    "metric_name, unit",
    [("peak_memory_gib", "GiB"), ("step_time_ms", "ms")],
)
def test_lower_is_better_direction(tmp_path, metric_name, unit):
    def doc(value):
        return make_doc(metrics={metric_name: metric(spread(value, 0.01), unit, "lower")})

    rising = run_gate(tmp_path / "up", [doc(10.0)], [doc(12.0)])
    assert rising.exit_code == 1
    assert row_of(rising, metric_name).verdict == "regressed"
    assert f"REGRESSION smoke-e8 {metric_name}: 10 -> 12 (x1.200" in rising.report

    falling = run_gate(tmp_path / "down", [doc(10.0)], [doc(8.0)])
    assert falling.exit_code == 0
    assert row_of(falling, metric_name).verdict == "improved"
    assert f"IMPROVED smoke-e8 {metric_name}: 10 -> 8 (x0.800" in falling.report


def test_higher_is_better_improvement(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)})],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1200)})],
    )
    assert result.exit_code == 0
    assert row_of(result, "tokens_per_s_per_gpu").verdict == "improved"


def test_missing_scenario_in_candidate_fails(tmp_path):
    result = run_gate(
        tmp_path,
        [
            make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}),
            make_doc("smoke-e128", metrics={"tokens_per_s_per_gpu": tput(500)}),
        ],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)})],
    )
    assert result.exit_code == 1
    (issue,) = result.comparison.missing_in_candidate
    assert (issue.scenario, issue.machine) == ("smoke-e128", "1xnvidia-h200")
    assert "MISSING smoke-e128" in result.report
    assert "1 missing in candidate" in result.report.splitlines()[0]


def test_scenario_only_in_candidate_reported_not_failed(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)})],
        [
            make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}),
            make_doc("smoke-new", metrics={"tokens_per_s_per_gpu": tput(1)}),
        ],
    )
    assert result.exit_code == 0
    (issue,) = result.comparison.missing_in_baseline
    assert issue.scenario == "smoke-new"
    assert "NEW smoke-new" in result.report
    assert "1 only in candidate" in result.report.splitlines()[0]


def test_different_machine_is_not_a_match(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, machine="1xnvidia-h100")],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, machine="1xnvidia-h200")],
    )
    assert result.exit_code == 1
    assert [i.machine for i in result.comparison.missing_in_candidate] == ["1xnvidia-h100"]
    assert [i.machine for i in result.comparison.missing_in_baseline] == ["1xnvidia-h200"]


def test_failed_in_candidate_fails(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)})],
        [make_doc(status="oom", error="CUDA out of memory (tried to allocate 2 GiB)")],
    )
    assert result.exit_code == 1
    (issue,) = result.comparison.not_ok
    assert issue.side == "candidate" and issue.cand_status == "oom"
    assert "NOT-OK smoke-e8" in result.report
    assert "candidate oom (CUDA out of memory" in result.report
    assert result.comparison.rows == ()


def test_failed_in_baseline_only_is_reported_not_failed(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(status="failed", error="boom"), make_doc("other", metrics={"tokens_per_s_per_gpu": tput(1000)})],
        [
            make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}),
            make_doc("other", metrics={"tokens_per_s_per_gpu": tput(1000)}),
        ],
    )
    assert result.exit_code == 0
    (issue,) = result.comparison.not_ok
    assert issue.side == "baseline"
    assert "NOTE NOT-OK smoke-e8: baseline failed (boom) [1xnvidia-h200]" in result.report


def test_mismatched_hash_reported(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, spec={"mode": "execute", "experts": 8})],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, spec={"mode": "execute", "experts": 16})],
    )
    assert result.exit_code == 1
    (issue,) = result.comparison.mismatched
    assert issue.base_hash != issue.cand_hash
    assert "MISMATCHED smoke-e8" in result.report
    assert result.comparison.rows == ()


def test_info_metrics_never_gate(tmp_path):
    def doc(v):
        return make_doc(metrics={"loss": metric(spread(v, 0.0), "nats", None), "tokens_per_s_per_gpu": tput(1000)})

    result = run_gate(tmp_path, [doc(2.0)], [doc(20.0)])
    assert result.exit_code == 0
    row = row_of(result, "loss")
    assert row.verdict == "info"
    assert row.outside_noise  # it did change, it just does not gate
    assert row.ratio == pytest.approx(10.0)


def test_metric_on_one_side_is_missing_not_failure(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000), "mfu": metric([0.4], "fraction", "higher")})],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000), "peak_memory_gib": metric([3.0], "GiB", "lower")})],
    )
    assert result.exit_code == 0
    assert row_of(result, "mfu").verdict == "missing"
    assert row_of(result, "mfu").cand is None
    assert row_of(result, "peak_memory_gib").verdict == "missing"
    assert row_of(result, "peak_memory_gib").base is None
    assert "mfu: metric missing in the candidate" in result.report


def test_repeated_runs_pooled_newest_decides(tmp_path):
    base = side(
        tmp_path,
        "base",
        make_doc(metrics={"tokens_per_s_per_gpu": metric([1000, 1010], "tokens/s", "higher")}),
        make_doc(
            metrics={"tokens_per_s_per_gpu": metric([990, 1000], "tokens/s", "higher")},
            timestamp="2025-01-02T00:00:00Z",
        ),
    )
    assert sorted(p.path.name for p in base) == ["smoke-e8.2.json", "smoke-e8.json"]
    (group,) = group_documents(base).values()
    assert len(group.pooled) == 2
    assert group.metrics["tokens_per_s_per_gpu"]["samples"] == [1000, 1010, 990, 1000]
    assert group.metrics["tokens_per_s_per_gpu"]["median"] == 1000

    # A newer failed run makes the scenario not ok, even though an older run succeeded.
    cand = side(
        tmp_path,
        "cand",
        make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}),
        make_doc(status="failed", error="late failure", timestamp="2025-01-03T00:00:00Z"),
    )
    result = gate(compare(base, cand), 0.05)
    assert result.exit_code == 1
    assert result.comparison.not_ok[0].cand_error == "late failure"


def test_same_timestamp_breaks_tie_by_run_suffix(tmp_path):
    docs = side(
        tmp_path,
        "s",
        make_doc(status="failed", error="first"),
        make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}),
    )
    (group,) = group_documents(docs).values()
    assert group.status == "ok"
    assert group.newest.path.name == "smoke-e8.2.json"
    assert len(group.ignored) == 1


def test_pool_excludes_other_hash_and_version(tmp_path):
    docs = side(
        tmp_path,
        "s",
        make_doc(metrics={"tokens_per_s_per_gpu": tput(1)}, spec={"mode": "execute", "experts": 4}),
        make_doc(metrics={"tokens_per_s_per_gpu": tput(2)}, version="0.0.9", timestamp="2025-01-01T00:00:01Z"),
        make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, timestamp="2025-01-02T00:00:00Z"),
    )
    (group,) = group_documents(docs).values()
    assert len(group.pooled) == 1 and len(group.ignored) == 2
    assert group.metrics["tokens_per_s_per_gpu"]["median"] == 1000


def test_compare_paths_accepts_file_and_folder(tmp_path):
    b = write_result(make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}), tmp_path / "b")
    write_result(make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}), tmp_path / "c")
    comparison = compare_paths(b, tmp_path / "c")
    assert comparison.compared == (("smoke-e8", "1xnvidia-h200"),)
    assert gate(comparison, 0.05).exit_code == 0


def test_empty_sides(tmp_path):
    result = gate(compare([], []), 0.05)
    assert result.exit_code == EXIT_NOT_COMPARED  # nothing checked is no pass
    assert render_table(result.comparison) == "(no metrics compared)\n"


def test_zero_baseline():
    assert classify(1.0, 0.0, "lower", 0.05) == (False, "unchanged")
    assert classify(float("inf"), 0.0, "lower", 0.05) == (True, "regressed")


def test_render_table_and_json(tmp_path):
    base = side(
        tmp_path,
        "base",
        make_doc(metrics={"tokens_per_s_per_gpu": tput(1000, 0.02), "peak_memory_gib": metric([10.0], "GiB", "lower")}),
    )
    cand = side(
        tmp_path,
        "cand",
        make_doc(metrics={"tokens_per_s_per_gpu": tput(800, 0.011), "peak_memory_gib": metric([10.1], "GiB", "lower")}),
    )
    comparison = compare(base, cand)
    text = render_table(comparison)
    lines = text.splitlines()
    assert lines[0].split() == ["scenario", "metric", "unit", "base", "cand", "ratio", "noise", "verdict"]
    assert len(lines) == 4
    assert any(
        line.split() == ["smoke-e8", "tokens_per_s_per_gpu", "tokens/s", "1000", "800", "0.800", "3.1%", "regressed"]
        for line in lines
    )
    assert any(line.split()[-1] == "unchanged" and "peak_memory_gib" in line for line in lines)
    assert "noise 3.1%" in gate(comparison).report

    table = render_rich_table(comparison)
    assert isinstance(table, Table)
    assert table.row_count == 2

    data = json.loads(to_json(comparison))
    assert data["counts"]["regressed"] == 1
    assert {r["metric"] for r in data["rows"]} == {"tokens_per_s_per_gpu", "peak_memory_gib"}


@pytest.mark.parametrize(
    "text, expected",
    [("5%", 0.05), ("0.05", 0.05), (" 2.5 % ", 0.025), ("0", 0.0), ("0%", 0.0), ("10%", 0.1), (0.05, 0.05)],
)
def test_parse_tolerance(text, expected):
    assert parse_tolerance(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "%", "abc", "5", "1", "-5%", "-0.1", "100%", "nan", "inf%", "5%%", None])
def test_parse_tolerance_rejects(text):
    with pytest.raises(ValueError, match="tolerance"):
        parse_tolerance(text)


def test_skipped_on_both_sides_does_not_fail(tmp_path):
    result = run_gate(
        tmp_path,
        [
            make_doc(status="skipped", error="needs CUDA"),
            make_doc("other", metrics={"tokens_per_s_per_gpu": tput(1000)}),
        ],
        [
            make_doc(status="skipped", error="needs CUDA"),
            make_doc("other", metrics={"tokens_per_s_per_gpu": tput(1000)}),
        ],
    )
    assert result.exit_code == 0
    assert result.comparison.not_ok[0].side == "both"
    assert "NOTE NOT-OK smoke-e8" in result.report


def test_skipped_in_candidate_only_fails(tmp_path):
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)})],
        [make_doc(status="skipped", error="needs CUDA")],
    )
    assert result.exit_code == 1
    assert "NOT-OK smoke-e8: candidate skipped (needs CUDA)" in result.report


# ---------------------------------------------------------------------------------------------
# Single-sample metrics: exact values, no noise allowance (module docstring, "Exact values")
# ---------------------------------------------------------------------------------------------

# metric, better, baseline value, candidate value, ratio, verdict at tolerance 5% (noise 0: exact)
EXACT_CASES = [
    ("up_6_percent", "lower", 100.0, 106.0, 1.06, "regressed"),
    ("up_5_percent", "lower", 100.0, 105.0, 1.05, "unchanged"),  # not beyond the tolerance
    ("equal", "lower", 100.0, 100.0, 1.0, "unchanged"),
    ("down_6_percent", "lower", 100.0, 94.0, 0.94, "improved"),
    ("ratio_down_6_percent", "higher", 0.5, 0.47, 0.94, "regressed"),
]


def test_single_sample_metrics_are_compared_as_exact_values(tmp_path):
    base = make_doc(metrics={name: metric([b], "bytes", better) for name, better, b, _, _, _ in EXACT_CASES})
    cand = make_doc(metrics={name: metric([c], "bytes", better) for name, better, _, c, _, _ in EXACT_CASES})
    result = run_gate(tmp_path, [base], [cand], tolerance=0.05)
    for name, _, _, _, ratio, verdict in EXACT_CASES:
        row = row_of(result, name)
        assert row.ratio == pytest.approx(ratio) and row.verdict == verdict, name
        assert (row.exact, row.noise, row.threshold) == (True, 0.0, 0.05)
        assert (row.base_rel_iqr, row.cand_rel_iqr) == (None, None)
    assert result.exit_code == 1
    assert (
        "REGRESSION smoke-e8 up_6_percent: 100 -> 106 (x1.060, tolerance 5%, exact value) bytes [1xnvidia-h200]"
        in result.report
    )
    exact_zero = gate(result.comparison, 0.0)
    assert row_of(exact_zero, "equal").verdict == "unchanged"  # equal is unchanged even at tolerance 0
    assert row_of(exact_zero, "up_5_percent").verdict == "regressed"
    table = render_table(result.comparison)
    assert any(
        line.split() == ["smoke-e8", "up_6_percent", "bytes", "100", "106", "1.060", "exact", "regressed"]
        for line in table.splitlines()
    )


def test_rss_has_a_noise_floor_in_the_result_gate(tmp_path):
    """``moe-bench gate`` on one-sample RSS: +6% at tolerance 5% is inside the 10% floor (inconclusive, not
    failed), +12% is not."""

    def runs(value):
        return [make_doc(metrics={"rss_peak_bytes": metric([value], "bytes", "lower")})]

    within = row_of(run_gate(tmp_path / "a", runs(100.0), runs(106.0), tolerance=0.05), "rss_peak_bytes")
    assert within.verdict == "inconclusive" and within.noise == pytest.approx(0.10)
    leak = run_gate(tmp_path / "b", runs(100.0), runs(112.0), tolerance=0.05)
    assert row_of(leak, "rss_peak_bytes").verdict == "regressed" and leak.exit_code == 1


def test_pooled_single_sample_runs_stay_exact(tmp_path):
    """Peak memory +6% at tolerance 5% regresses, though the noise of a timing would have hidden it.

    Baseline runs 96 and 104, candidate runs 100 and 112 (one sample each): pooled to medians 100 and
    106, ratio 1.06, noise 0 -> regressed. The same values as the samples of a timing: rel_iqr
    4/100 (quartiles 98, 102) + 6/106 (quartiles 103, 109) = 9.7% noise > 6% -> inconclusive.
    """

    def runs(*values):
        return [
            make_doc(
                metrics={"peak_tensor_bytes": metric([v], "bytes", "lower")}, timestamp=f"2025-01-0{i + 1}T00:00:00Z"
            )
            for i, v in enumerate(values)
        ]

    result = run_gate(tmp_path / "exact", runs(96.0, 104.0), runs(100.0, 112.0), tolerance=0.05)
    row = row_of(result, "peak_tensor_bytes")
    assert (row.base, row.cand, row.base_n, row.cand_n) == (100.0, 106.0, 2, 2)
    assert row.ratio == pytest.approx(1.06) and row.verdict == "regressed" and result.exit_code == 1
    assert row.exact and row.noise == 0.0
    pooled = result.comparison.base_groups[("smoke-e8", "1xnvidia-h200")].metrics["peak_tensor_bytes"]
    assert pooled["samples"] == [96.0, 104.0] and pooled["spread"] is None

    timing = run_gate(
        tmp_path / "timing",
        [make_doc(metrics={"step_time_s": metric([96.0, 104.0], "s", "lower")})],
        [make_doc(metrics={"step_time_s": metric([100.0, 112.0], "s", "lower")})],
        tolerance=0.05,
    )
    row = row_of(timing, "step_time_s")
    assert not row.exact and row.noise == pytest.approx(0.04 + 6 / 106) and row.ratio == pytest.approx(1.06)
    assert row.verdict == "inconclusive" and timing.exit_code == 0


def test_versions_table_compares_single_sample_metrics_exactly(tmp_path):
    """bench.ab.images' table takes compare's verdicts: the pooled case above, image against image."""
    from bench.ab.images import compare_versions

    def runs(label, version, *values):
        return side(
            tmp_path,
            label,
            *(
                make_doc(
                    metrics={"peak_tensor_bytes": metric([v], "bytes", "lower")},
                    version=version,
                    timestamp=f"2025-01-0{i + 1}T00:00:00Z",
                )
                for i, v in enumerate(values)
            ),
        )

    table = compare_versions(
        {"moe-engine:0.1.0": runs("a", "0.1.0", 96.0, 104.0), "moe-engine:0.2.0": runs("b", "0.2.0", 100.0, 112.0)}
    )
    assert "| smoke-e8 | peak_tensor_bytes | bytes | 100 | 106 (x1.060, regressed) |" in table.splitlines()


# ---- work counters ---------------------------------------------------------------------------------

MiB = 1 << 20


def work_doc(flops=1_000_000_000, ops=800, collectives=None, ranks=1, timestamp="2025-01-01T00:00:00Z", **extra):
    """A document with work counters and their census: ``ranks`` ranks alike, ``collectives`` per rank."""
    collectives = collectives if collectives is not None else {("all_reduce", "dp"): (2, 4 * MiB)}
    census = [
        {
            "rank": r,
            "matmul_flops": flops,
            "flops_by_op": {"aten.mm": flops},
            "aten_ops": ops,
            "ops_by_name": {"aten.mm.default": ops},
            "allocated_bytes": 0,
            "allocated_by_op": {},
            "host_syncs": 0,
            "syncs_by_site": {},
            "collectives": [
                {"op": op, "group": group, "calls": calls, "bytes": nbytes}
                for (op, group), (calls, nbytes) in sorted(collectives.items())
            ],
        }
        for r in range(ranks)
    ]
    totals = {
        "work_matmul_flops": flops * ranks,
        "work_aten_ops": ops * ranks,
        "work_collective_calls": ranks * sum(c for c, _ in collectives.values()),
        "work_collective_bytes": ranks * sum(b for _, b in collectives.values()),
        **extra,
    }
    metrics = {name: metric([value], "count", "lower") for name, value in totals.items()}
    metrics["work_flops_ratio"] = metric([flops / 1e9], "ratio", None)
    doc = make_doc(metrics=metrics, timestamp=timestamp)
    doc["details"] = {"work": {"ranks": census}}
    return doc


def test_any_work_increase_regresses_whatever_the_tolerance(tmp_path):
    result = run_gate(tmp_path, [work_doc(ops=800)], [work_doc(ops=801)], tolerance=0.5)
    row = row_of(result, "work_aten_ops")
    assert (row.verdict, row.exact, row.threshold, row.outside_noise) == ("regressed", True, 0.0, True)
    assert result.exit_code == 1
    assert (
        "REGRESSION smoke-e8 work_aten_ops: work increased: +1 op per step (+0.1%, 800 -> 801): "
        "aten.mm.default +1 [1xnvidia-h200]"
    ) in result.failures
    # Not also as the generic exact-value regression line.
    assert not any(line.startswith("REGRESSION smoke-e8 work_aten_ops: 800") for line in result.report.splitlines())
    assert row_of(run_gate(tmp_path / "same", [work_doc()], [work_doc()]), "work_aten_ops").verdict == "unchanged"


def test_work_decrease_is_reported_not_failed(tmp_path):
    result = run_gate(tmp_path, [work_doc(flops=1_000_000_000)], [work_doc(flops=969_000_000)])
    assert result.exit_code == 0 and row_of(result, "work_matmul_flops").verdict == "improved"
    assert (
        "NOTE smoke-e8 work_matmul_flops: work decreased: -3.1% matmul FLOPs per step (1e+09 -> 9.69e+08): "
        "aten.mm -3.1e+07 [1xnvidia-h200]"
    ) in result.report
    assert row_of(result, "work_flops_ratio").verdict == "info"  # reported, never gated


def test_work_increase_passes_when_accepted_and_says_so(tmp_path):
    base = side(tmp_path, "base", work_doc(flops=1_000_000_000, ops=800))
    cand = side(tmp_path, "cand", work_doc(flops=1_031_000_000, ops=801))
    accepted = gate(compare(base, cand), accept_work=True)
    assert accepted.exit_code == 0
    assert "NOTE smoke-e8 work_matmul_flops: work increased (accepted): +3.1% matmul FLOPs per step" in accepted.report
    assert "0 regressed, 2 accepted (2 accepted work increases)" in accepted.report.splitlines()[0]
    assert [r.accepted for r in accepted.comparison.rows_with("accepted")] == ["--accept-work"] * 2
    partly = gate(compare(base, cand), accept_work={"work_aten_ops"})
    assert partly.exit_code == 1
    assert [f.split(":")[0] for f in partly.failures] == ["REGRESSION smoke-e8 work_matmul_flops"]


def test_collective_verdicts_name_the_op_group_and_ranks():
    base = work_doc(ranks=2)
    extra = work_doc(ranks=2, collectives={("all_reduce", "dp"): (3, 8 * MiB)})
    lines = work_verdicts("s", base, extra)
    assert lines == [
        "REGRESSION s work_collective_calls: work increased: +1 all_reduce of 4 MiB per step (dp) on each of 2 ranks",
        (
            "REGRESSION s work_collective_bytes: work increased: +8 MiB of collectives per step (8 MiB -> 16 MiB): "
            "+1 all_reduce of 4 MiB per step (dp) on each of 2 ranks"
        ),
    ]
    single = work_verdicts("s", work_doc(), work_doc(collectives={("all_reduce", "dp"): (3, 8 * MiB)}), machine="m")
    assert single[0] == "REGRESSION s work_collective_calls: work increased: +1 all_reduce of 4 MiB per step (dp) [m]"
    # Bigger messages in the same calls; a new kind on one rank only.
    bigger = work_doc(collectives={("all_reduce", "dp"): (2, 6 * MiB)})
    assert work_verdicts("s", work_doc(), bigger) == [
        (
            "REGRESSION s work_collective_bytes: work increased: +2 MiB of collectives per step (4 MiB -> 6 MiB): "
            "all_reduce (dp) +2 MiB per step over the same 2 calls"
        ),
    ]
    one_rank = work_doc(ranks=2)
    one_rank["details"]["work"]["ranks"][1]["collectives"].append(
        {"op": "broadcast", "group": "ep", "calls": 1, "bytes": MiB}
    )
    one_rank["metrics"]["work_collective_calls"] = metric([5], "count", "lower")
    (calls,) = [line for line in work_verdicts("s", base, one_rank) if "work_collective_calls" in line]
    assert calls.endswith(": +1 broadcast of 1 MiB per step (ep) on rank 1")


def test_work_verdicts_take_documents_or_metrics_and_details(tmp_path):
    base, cand = work_doc(ops=800), work_doc(ops=802)
    as_pairs = work_verdicts("s", (base["metrics"], base["details"]), (cand["metrics"], cand["details"]))
    (loaded_base,), (loaded_cand,) = side(tmp_path, "b", base), side(tmp_path, "c", cand)
    assert as_pairs == work_verdicts("s", base, cand) == work_verdicts("s", loaded_base, loaded_cand)
    assert as_pairs == [
        ("REGRESSION s work_aten_ops: work increased: +2 ops per step (+0.2%, 800 -> 802): aten.mm.default +2")
    ]
    # Without a census the totals still say what changed.
    assert work_verdicts("s", (base["metrics"], None), (cand["metrics"], {})) == [
        "REGRESSION s work_aten_ops: work increased: +2 ops per step (+0.2%, 800 -> 802)"
    ]


def test_no_work_counters_on_one_side_gives_no_work_verdict(tmp_path):
    old = make_doc(metrics={"peak_tensor_bytes": metric([100.0], "bytes", "lower")})
    new = work_doc()
    new["metrics"]["peak_tensor_bytes"] = metric([100.0], "bytes", "lower")
    result = run_gate(tmp_path, [old], [new])
    assert result.exit_code == 0
    assert result.work == (
        "NOTE smoke-e8: no work counters on one side (the baseline); work not compared [1xnvidia-h200]",
    )
    assert "work_aten_ops: metric missing" not in result.report  # said once for the scenario
    assert work_verdicts("s", old, old) == []


def test_pooled_runs_take_the_newest_census(tmp_path):
    base = [work_doc(ops=800)]
    cand = [work_doc(ops=801, timestamp="2025-01-01T00:00:00Z"), work_doc(ops=801, timestamp="2025-01-02T00:00:00Z")]
    cand[1]["details"]["work"]["ranks"][0]["ops_by_name"] = {"aten.mm.default": 800, "aten.clone.default": 1}
    result = run_gate(tmp_path, base, cand)
    assert result.failures[0].endswith("(+0.1%, 800 -> 801): aten.clone.default +1 [1xnvidia-h200]")


def _spec_without(spec: dict, *paths: str) -> dict:
    """``spec`` as an older release wrote it: without the fields added since (``section.field``)."""
    old = json.loads(json.dumps(spec))
    for path in paths:
        section, key = path.split(".")
        del old[section][key]
    return old


def test_fields_added_since_the_baseline_at_their_defaults_still_compare(tmp_path):
    from bench.scenario import load_scenario

    spec = load_scenario("scenarios/smoke/e8-random-bf16.yaml").spec
    old = _spec_without(spec, "parallel.grad_dtype", "run.compile")
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, spec=old)],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(800)}, spec=spec)],
    )
    assert result.comparison.mismatched == ()
    assert [r.verdict for r in result.comparison.rows] == ["regressed"]


def test_fields_added_after_both_versions_still_compare(tmp_path):
    """0.1.0 lacks grad_dtype and compile, 0.2.0 has them; neither has a field added later still
    (model.fused_kernels): both sides at today's defaults are the same scenario."""
    from bench.scenario import load_scenario

    spec = load_scenario("scenarios/smoke/e8-random-bf16.yaml").spec
    assert "fused_kernels" in spec["model"]
    older = _spec_without(spec, "parallel.grad_dtype", "run.compile", "model.fused_kernels")
    newer = _spec_without(spec, "model.fused_kernels")
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, spec=older)],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(800)}, spec=newer)],
    )
    assert result.comparison.mismatched == ()
    assert [r.verdict for r in result.comparison.rows] == ["regressed"]


@pytest.mark.parametrize("change", ["a field both versions have", "a new field away from its default"])
def test_a_changed_scenario_is_still_mismatched(tmp_path, change):
    from bench.scenario import load_scenario

    spec = load_scenario("scenarios/smoke/e8-random-bf16.yaml").spec
    old = _spec_without(spec, "parallel.grad_dtype", "run.compile")
    new = json.loads(json.dumps(spec))
    if change == "a field both versions have":
        new["run"]["steps"] += 1
    else:
        new["parallel"]["grad_dtype"] = "bf16" if spec["parallel"]["grad_dtype"] != "bf16" else "fp32"
    result = run_gate(
        tmp_path,
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, spec=old)],
        [make_doc(metrics={"tokens_per_s_per_gpu": tput(1000)}, spec=new)],
    )
    assert len(result.comparison.mismatched) == 1
    assert result.comparison.rows == ()
