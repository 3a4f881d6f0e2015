"""The report's data: version choice, problems, the release comparison (the gate's), trends, experiments."""

from __future__ import annotations

import re
import statistics

import pytest
from report_results import (
    BASE,
    DEVICE_PROJECTION,
    EXPECTED_VERDICTS,
    FAILED,
    MACHINE,
    MIB,
    NEW,
    PROJECTION,
    TOKENS,
    write_comparisons,
    write_two_versions,
)
from result_docs import make_doc

from bench.cli import main
from bench.report.collect import ReportError, choose_versions, load_result_set, problems
from bench.report.comparisons import load_comparisons
from bench.report.experiments import (
    EXPERTS,
    RECOMPUTE,
    memory_stack,
    pair_charts,
    plan_memory,
    projection_stacks,
    recompute_mode,
    variation_groups,
)
from bench.report.release_table import release_comparison
from bench.report.trends import trends
from bench.results import result_dir, write_result


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_two_versions(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def results(folder):
    return load_result_set(folder, releases=[BASE])


def test_the_latest_release_older_than_the_newest_results_is_the_base(folder):
    pair = choose_versions(load_result_set(folder, releases=[BASE]))
    assert (pair.base, pair.new) == (BASE, NEW)
    assert "latest release (0.1.0)" in pair.why
    # No release among the results: the version before the newest.
    unreleased = choose_versions(load_result_set(folder, releases=["0.0.9"]))
    assert (unreleased.base, unreleased.new) == (BASE, NEW) and "no release" in unreleased.why
    # A newer release than the newest results is no base for them.
    assert choose_versions(load_result_set(folder, releases=["0.3.0"])).base == BASE


def test_versions_asked_for_must_be_in_the_folder(results):
    assert (choose_versions(results, base=NEW, new=BASE).base, choose_versions(results, base=NEW, new=BASE).new) == (
        NEW,
        BASE,
    )
    with pytest.raises(
        ReportError,
        match=r"--base 9\.9\.9: no results of that version in .* \(versions there: "
        r"0\.1\.0, 0\.2\.0\)",
    ):
        choose_versions(results, base="9.9.9")
    with pytest.raises(ReportError, match=r"--new 0\.3\.0: no results"):
        choose_versions(results, new="0.3.0")
    with pytest.raises(ReportError, match=re.escape("both 0.1.0")):
        choose_versions(results, base=BASE, new=BASE)
    with pytest.raises(ReportError, match="the newest version"):
        choose_versions(results, base=NEW)


def test_the_base_is_the_release_not_the_version_just_before(tmp_path):
    for version in ("0.1.0", "0.1.0+3.gabc1234", "0.2.0+1.gdef5678", "0.10.0+2.g0000000"):
        write_result(make_doc("a", version=version), result_dir(tmp_path, version, "m"))
    results = load_result_set(tmp_path, releases=["0.1.0", "0.2.0"])
    pair = choose_versions(results)
    assert (pair.base, pair.new) == ("0.1.0", "0.10.0+2.g0000000")  # 0.2.0 itself has no results here
    assert choose_versions(results, new="0.1.0+3.gabc1234").base == "0.1.0"


def test_one_version_has_nothing_to_compare(tmp_path):
    write_result(make_doc("a", version="0.1.0"), result_dir(tmp_path, "0.1.0", "m"))
    assert choose_versions(load_result_set(tmp_path)) is None


def test_problems_are_the_newest_runs_not_ok_with_their_errors(results, tmp_path):
    found = {(p.scenario, p.version): (p.status, p.error) for p in problems(results)}
    assert found == {(name, version): failure for (name, version), failure in FAILED.items()}
    # A later ok run of the same scenario and version is no problem; a later failure is one.
    folder = result_dir(tmp_path, "0.1.0", "m")
    write_result(make_doc("x", status="failed", error="first", timestamp="2026-01-01T00:00:00Z"), folder)
    write_result(make_doc("x", timestamp="2026-01-02T00:00:00Z"), folder)
    write_result(make_doc("y", timestamp="2026-01-01T00:00:00Z"), folder)
    write_result(make_doc("y", status="timeout", error="600 s", timestamp="2026-01-02T00:00:00Z"), folder)
    assert [(p.scenario, p.status, p.error) for p in problems(load_result_set(tmp_path))] == [("y", "timeout", "600 s")]


def test_release_comparison_verdicts_are_the_hand_worked_ones_and_the_gates(results, folder, capsys):
    comparison = release_comparison(results, choose_versions(results))
    shown = {(t.scenario, r.metric): r.verdict for t in comparison.tables for r in t.rows}
    assert {key: shown.get(key) for key in EXPECTED_VERDICTS} == EXPECTED_VERDICTS
    assert all(r.better is not None for t in comparison.tables for r in t.rows)  # info metrics not listed
    assert {t.scenario: t.info_metrics for t in comparison.tables}["e8-random-bf16"] == 1  # the loss
    rows = {(t.scenario, r.metric): r for t in comparison.tables for r in t.rows}
    row = rows[("e8-random-bf16", "tokens_per_s_per_gpu")]
    assert row.ratio == pytest.approx(0.8) and row.noise == pytest.approx(0.02)
    assert not comparison.gate.passed
    # moe-bench gate on the two version folders: the same failures, line for line.
    code = main(["gate", "--baseline", str(folder / BASE), "--candidate", str(folder / NEW)])
    report = capsys.readouterr().out
    assert code == 1
    assert [line for line in report.splitlines() if line.startswith(("REGRESSION", "NOT-OK"))] == list(
        comparison.gate.failures
    )
    assert report.splitlines()[0] == comparison.header


def test_trends_are_the_pooled_medians_and_quartiles_per_version(results):
    found = {t.scenario: t for t in trends(results)}
    assert sorted(found) == ["e64-random-bf16", "e8-ep2-nosync-bf16", "e8-random-bf16", "moe-128e-47b"]
    tokens = found["e8-random-bf16"].series[0]
    assert tokens.metric == "tokens_per_s_per_gpu"
    assert [p.version for p in tokens.points] == [BASE, NEW]
    for point in tokens.points:
        median = TOKENS[("e8-random-bf16", point.version)]
        samples = sorted(median * f for f in (1.0, 1.01, 0.99, 1.005, 0.995))
        # Inclusive quartiles of five sorted samples: the 2nd and the 4th.
        assert (point.median, point.q1, point.q3) == pytest.approx((median, samples[1], samples[3]))
        assert (point.low, point.high) == pytest.approx((samples[0], samples[-1]))
    memory = found["e8-random-bf16"].series[1]
    assert memory.metric == "peak_tensor_bytes" and all(p.q1 is None for p in memory.points)
    assert [s.metric for s in found["moe-128e-47b"].series] == ["memory_total_bytes"]


def test_pooled_runs_of_one_version_make_one_trend_point(tmp_path):
    from bench.results import metric

    for version, runs in (("0.1.0", [[10.0, 12.0], [14.0, 16.0]]), ("0.2.0", [[20.0, 22.0]])):
        for i, samples in enumerate(runs):
            write_result(
                make_doc(
                    "s",
                    {"tokens_per_s_per_gpu": metric(samples, "tokens/s", "higher")},
                    version=version,
                    timestamp=f"2026-01-0{i + 1}T00:00:00Z",
                ),
                result_dir(tmp_path, version, "m"),
            )
    (trend,) = trends(load_result_set(tmp_path))
    first = trend.series[0].points[0]
    assert first.samples == 4 and first.median == statistics.median([10, 12, 14, 16])


def test_expert_sweep_and_recompute_groups_differ_in_that_field_only(results):
    sweeps = {g.mode: g for g in variation_groups(results, EXPERTS)}
    assert sorted(sweeps) == ["execute", "plan"]
    runs = sweeps["execute"]
    assert [(v.value, v.scenario) for v in runs.members] == [(8, "e8-random-bf16"), (64, "e64-random-bf16")]
    assert (runs.version, runs.machine, runs.throughput_metric, runs.memory_metric) == (
        NEW,
        MACHINE,
        "tokens_per_s_per_gpu",
        "peak_tensor_bytes",
    )
    assert [v.metrics["tokens_per_s_per_gpu"]["median"] for v in runs.members] == pytest.approx([800, 600])
    plans = sweeps["plan"]
    assert [v.value for v in plans.members] == [8, 128] and plans.memory_metric == "memory_total_bytes"
    assert plans.throughput_metric is None
    (recompute,) = variation_groups(results, RECOMPUTE)
    assert [(v.value, v.scenario) for v in recompute.members] == [
        ("none", "e8-ep2-nosync-bf16"),
        ("full", "e8-ep2-nosync-bf16-recompute-full"),
    ]
    assert (
        recompute_mode({"recompute": {"mode": "selective", "parts": ["attention", "norms"]}})
        == "selective (attention, norms)"
    )
    assert recompute_mode({}) == "none"


def test_pairs_take_the_ratio_of_the_newest_version_and_say_why_not(results, tmp_path):
    comparisons = load_comparisons(write_comparisons(tmp_path / "c.yaml"))
    charts = {c.comparison.name: c for c in pair_charts(results, comparisons)}
    assert sorted(charts) == ["ddp-ep-over-fsdp", "mxfp8-over-bf16", "mxfp8-over-bf16-memory", "sync-over-no-sync"]
    (sync,) = charts["sync-over-no-sync"].bars
    assert (sync.version, sync.numerator_value, sync.denominator_value) == (NEW, pytest.approx(350), pytest.approx(707))
    assert sync.ratio == pytest.approx(350 / 707)
    (memory,) = charts["mxfp8-over-bf16-memory"].bars
    assert (memory.metric, memory.ratio, memory.unit) == ("peak_tensor_bytes", pytest.approx(0.9), "bytes")
    assert memory.numerator_value == 90 * MIB
    # The FSDP side failed in the newest version: no ratio, the reason, and not the older version's ratio.
    fsdp = charts["ddp-ep-over-fsdp"]
    assert fsdp.bars == () and [(b.version, b.note) for b in fsdp.unmeasured] == [(NEW, "e8-dp2-fsdp-bf16 failed")]


def test_plan_memory_stacks_add_up_to_the_plans_total(results):
    ((machine, stacks),) = plan_memory(results).items()
    assert machine == MACHINE and [s.scenario for s in stacks] == ["moe-128e-47b", "moe-8e-4.6b"]
    for stack in stacks:
        group = results.groups(NEW)[(stack.scenario, MACHINE)]
        m = {k: v["median"] for k, v in group.metrics.items()}
        parts = dict(stack.segments)
        assert sum(parts.values()) == pytest.approx(m["memory_total_bytes"], rel=1e-12)
        assert "not broken down" not in parts
        assert stack.capacity == pytest.approx(m["memory_total_bytes"] / m["memory_fraction_of_gpu"])
        # The larger transient peak is the one stacked.
        backward = m["memory_activations_bytes"] + m["memory_comm_buffers_bytes"] + m["memory_backward_workspace_bytes"]
        expected = "activations" if backward >= m["memory_optimizer_step_bytes"] else "optimizer step temporaries"
        assert expected in parts


def test_a_plan_whose_parts_fall_short_of_its_total_shows_the_rest(results):
    group = results.groups(NEW)[("moe-128e-47b", MACHINE)]
    metrics = dict(group.metrics)
    del metrics["memory_backward_workspace_bytes"]
    from dataclasses import replace

    stack = memory_stack(replace(group, metrics=metrics), NEW)
    assert dict(stack.segments)["not broken down"] == pytest.approx(
        group.metrics["memory_backward_workspace_bytes"]["median"]
    )


def test_projection_stacks_are_the_step_parts_of_each_target(results):
    stacks = projection_stacks(results)
    assert [s.target for s in stacks] == ["b300-1node, cpu-box's compute", "b300 (op-level)"]
    cluster, device = stacks
    assert dict(cluster.segments) == {
        "compute": 3.0,
        "expert communication": 0.5,
        "gradient sync (exposed)": 0.25,
        "optimizer": 0.25,
    }
    assert cluster.step_s == sum(PROJECTION.values()) == sum(dict(cluster.segments).values())
    assert device.step_s == pytest.approx(sum(DEVICE_PROJECTION.values()))
    assert cluster.version == NEW and cluster.machine == MACHINE
