"""bench.gate.groups: one side's documents grouped by (scenario, machine), repeated runs pooled."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from result_docs import make_doc

from bench.gate.groups import group_documents, same_scenario
from bench.results import REPO_ROOT, ResultDocument, metric
from bench.scenario import scenario_from_dict


def doc(*, samples=(1.0,), unit="s", better="lower", stamp="2025-01-01T00:00:00Z", path=None, **fields):
    data = make_doc(metrics={"step_time_s": metric(samples, unit, better)}, timestamp=stamp, **fields)
    return ResultDocument(data, Path(path) if path else None)


def test_two_runs_of_one_scenario_pool_their_samples_oldest_first():
    older = doc(samples=[1.0, 2.0, 3.0], stamp="2025-01-01T00:00:00Z", path="r/a.json")
    newer = doc(samples=[4.0, 5.0], stamp="2025-01-02T00:00:00Z", path="r/a.2.json")
    (group,) = group_documents([newer, older]).values()
    entry = group.metrics["step_time_s"]
    assert entry["samples"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    # Five samples 1..5: median 3, inclusive quartiles 2 and 4, so IQR 2 and relative IQR 2/3.
    assert entry["median"] == 3.0
    assert entry["spread"]["min"] == 1.0 and entry["spread"]["max"] == 5.0
    assert entry["spread"]["iqr"] == pytest.approx(2.0)
    assert entry["spread"]["rel_iqr"] == pytest.approx(2 / 3)
    assert group.newest is newer
    assert group.pooled == (older, newer)
    assert group.ignored == ()
    assert group.paths == ("r/a.json", "r/a.2.json")


def test_the_newest_documents_unit_and_direction_win():
    older = doc(samples=[1.0, 2.0], unit="ms", better="higher", stamp="2025-01-01T00:00:00Z")
    newer = doc(samples=[3.0, 4.0], unit="s", better="lower", stamp="2025-01-03T00:00:00Z")
    (group,) = group_documents([older, newer]).values()
    assert (group.metrics["step_time_s"]["unit"], group.metrics["step_time_s"]["better"]) == ("s", "lower")


def test_pooled_single_samples_stay_exact_but_one_spread_side_gives_a_spread():
    one = doc(samples=[2.0], stamp="2025-01-01T00:00:00Z")
    two = doc(samples=[4.0], stamp="2025-01-02T00:00:00Z")
    (exact,) = group_documents([one, two]).values()
    assert exact.metrics["step_time_s"]["samples"] == [2.0, 4.0]
    assert exact.metrics["step_time_s"]["median"] == 3.0
    assert exact.metrics["step_time_s"]["spread"] is None

    spread = doc(samples=[4.0, 6.0], stamp="2025-01-02T00:00:00Z")
    (mixed,) = group_documents([one, spread]).values()
    # Samples 2, 4, 6: inclusive quartiles 3 and 5, so IQR 2 around a median of 4.
    assert mixed.metrics["step_time_s"]["spread"]["rel_iqr"] == pytest.approx(0.5)


def test_one_document_keeps_its_metrics_as_they_are():
    only = doc(samples=[7.0])
    only.metrics["step_time_s"]["spread"] = {"min": 7.0, "max": 7.0, "iqr": 0.0, "rel_iqr": 0.0}
    (group,) = group_documents([only]).values()
    assert group.metrics == only.metrics
    assert group.metrics["step_time_s"] is not only.metrics["step_time_s"]  # a copy, not the document's own


def test_runs_of_another_hash_or_version_are_ignored_not_pooled():
    other_hash = doc(samples=[100.0], spec={"mode": "execute", "experts": 16}, stamp="2025-01-01T00:00:00Z")
    other_version = doc(samples=[200.0], version="0.0.9", stamp="2025-01-02T00:00:00Z")
    failed = doc(samples=[300.0], status="failed", stamp="2025-01-03T00:00:00Z")
    kept = doc(samples=[1.0], stamp="2025-01-04T00:00:00Z")
    newest = doc(samples=[3.0], stamp="2025-01-05T00:00:00Z")
    (group,) = group_documents([newest, failed, other_hash, kept, other_version]).values()
    assert group.pooled == (kept, newest)
    assert group.ignored == (other_hash, other_version, failed)
    assert group.metrics["step_time_s"]["samples"] == [1.0, 3.0]


def test_a_failed_newest_run_decides_the_group_and_pools_nothing():
    ok = doc(samples=[1.0], stamp="2025-01-01T00:00:00Z", path="r/a.json")
    failed = doc(status="failed", error="CUDA out of memory", stamp="2025-01-02T00:00:00Z", path="r/a.2.json")
    (group,) = group_documents([ok, failed]).values()
    assert group.status == "failed"
    assert group.error == "CUDA out of memory"
    assert group.pooled == ()
    assert group.ignored == (ok,)
    assert group.metrics == {}
    assert group.paths == ("r/a.2.json",)  # the newest run's file when nothing was pooled


def test_groups_are_keyed_by_scenario_and_machine_in_sorted_order():
    docs = [
        doc(name="b", machine="m1"),
        doc(name="a", machine="m2"),
        doc(name="a", machine="m1"),
        doc(name="a", machine="m1", stamp="2025-02-01T00:00:00Z"),
    ]
    groups = group_documents(docs)
    assert list(groups) == [("a", "m1"), ("a", "m2"), ("b", "m1")]
    assert groups[("a", "m1")].key == ("a", "m1")
    assert len(groups[("a", "m1")].pooled) == 2
    assert groups[("a", "m1")].newest is docs[3]


def test_group_properties_come_from_the_newest_document():
    spec = {"mode": "execute", "experts": 4}
    (group,) = group_documents([doc(spec=spec, version="1.2.3")]).values()
    assert group.hash == make_doc(spec=spec)["scenario"]["hash"]
    assert group.version == "1.2.3"
    assert group.status == "ok"
    assert group.error is None
    assert group.paths == ()  # a document that was never a file names none


def test_within_one_timestamp_the_run_suffix_orders_the_runs():
    first = doc(samples=[1.0], path="r/smoke-e8.json")
    third = doc(samples=[3.0], path="r/smoke-e8.3.json")
    second = doc(samples=[2.0], path="r/smoke-e8.2.json")
    (group,) = group_documents([third, first, second]).values()
    assert group.newest is third
    assert group.metrics["step_time_s"]["samples"] == [1.0, 2.0, 3.0]


def _scenario_group(spec, name="s"):
    (group,) = group_documents([doc(name=name, spec=spec)]).values()
    return group


def test_same_scenario_by_hash_or_at_todays_defaults():
    written = yaml.safe_load((REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml").read_text())
    filled = scenario_from_dict(written).spec
    assert filled != written  # defaults were added, so the hashes differ
    base, cand = _scenario_group(written), _scenario_group(filled)
    assert base.hash != cand.hash
    assert same_scenario(base, cand)
    assert same_scenario(base, _scenario_group(written))

    changed = {**written, "run": {**written["run"], "steps": written["run"]["steps"] + 1}}
    assert not same_scenario(base, _scenario_group(changed))
    # Specs that are no scenario at all cannot be brought to today's defaults: only the hash decides.
    assert not same_scenario(_scenario_group({"mode": "execute", "experts": 8}), cand)


def test_a_side_without_a_recorded_spec_compares_by_hash_alone():
    written = yaml.safe_load((REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml").read_text())
    base, cand = _scenario_group(written), _scenario_group(scenario_from_dict(written).spec)
    del cand.newest.data["scenario"]["spec"]
    assert not same_scenario(base, cand)
