"""The metric registry (``bench.metrics``) against the documents the runs wrote before it existed.

The committed result documents (``results/<version>/``) were written by code that spelt out each
metric's unit and direction where it made the metric: they are the independent record the registry
must agree with, so that the gate reads new and old documents alike.
"""

from __future__ import annotations

import pytest
from result_docs import make_doc

from bench.gate.compare import compare
from bench.metrics import (
    METRICS,
    UnknownMetric,
    entry,
    headline_memory,
    names,
    noise_floor,
    spec_of,
    title,
)
from bench.results import REPO_ROOT, ResultDocument, load_results


def _committed_metrics() -> dict[str, set[tuple[str, str | None]]]:
    seen: dict[str, set[tuple[str, str | None]]] = {}
    for version_dir in sorted((REPO_ROOT / "results").glob("[0-9]*.[0-9]*.[0-9]*")):
        for doc in load_results(version_dir):
            for name, value in doc.metrics.items():
                seen.setdefault(name, set()).add((value["unit"], value["better"]))
    return seen


def test_the_registry_agrees_with_every_committed_result_document():
    seen = _committed_metrics()
    assert len(seen) > 30, "the repository's release results are missing"
    for name, described in sorted(seen.items()):
        spec = spec_of(name)
        assert described == {(spec.unit, spec.better)}, name


def test_a_gated_metric_has_a_direction_and_acceptable_increases_are_gated_memory():
    for spec in METRICS.values():
        assert not spec.gated or spec.better in ("higher", "lower"), spec.name
        assert not spec.acceptable_increase or (spec.gated and spec.kind == "memory"), spec.name
    assert "step_time_s" not in names(acceptable_increase=True)  # timings are gated by the blocks, never accepted


def test_entry_takes_unit_and_direction_from_the_registry():
    made = entry("tokens_per_s_per_gpu", [3.0, 1.0, 2.0])
    assert (made["unit"], made["better"], made["median"]) == ("tokens/s", "higher", 2.0)
    assert entry("work_aten_ops", [7])["spread"] is None  # one sample: an exact value


def test_run_made_names_resolve_by_family_and_unknown_names_are_refused():
    assert (spec_of("moe_layer_e64_k8_time_s").unit, spec_of("moe_layer_e64_k8_time_s").better) == ("s", "lower")
    assert spec_of("fused_over_eager_swiglu").unit == "ratio"
    assert spec_of("experts_128_vs_8_tokens").better == "higher"
    assert spec_of("step_time_s").title == "step time"  # an exact name wins over the *_time_s family
    with pytest.raises(UnknownMetric, match=r"bench/metrics\.py"):
        entry("tokens_per_s_per_gpus", [1.0])
    assert title("no_such_metric") == "no_such_metric"


def test_headline_memory_prefers_measured_over_planned():
    assert headline_memory(["memory_total_bytes", "peak_tensor_bytes"]) == "peak_tensor_bytes"
    assert headline_memory(["memory_total_bytes", "cuda_peak_active_bytes", "peak_tensor_bytes"]) == (
        "cuda_peak_active_bytes"
    )
    assert headline_memory(["memory_total_bytes"]) == "memory_total_bytes"
    assert headline_memory(["loss"]) is None


@pytest.mark.parametrize(
    ("metric_name", "verdict"), [("rss_peak_bytes", "inconclusive"), ("peak_tensor_bytes", "regressed")]
)
def test_the_gate_reads_noise_floors_from_the_registry(metric_name, verdict):
    # An 8% growth of a one-sample metric at a 5% tolerance: beyond the tolerance, within RSS's 10% floor.
    assert noise_floor("rss_peak_bytes") == 0.10 and noise_floor("peak_tensor_bytes") == 0.0
    base = ResultDocument(make_doc(metrics={metric_name: entry(metric_name, [1.0e9])}))
    cand = ResultDocument(make_doc(metrics={metric_name: entry(metric_name, [1.08e9])}))
    rows = [r for r in compare([base], [cand], 0.05).rows if r.metric == metric_name]
    assert [r.verdict for r in rows] == [verdict]
