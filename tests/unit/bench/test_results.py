"""bench.results: the metric entry's shape, the schema's two versions, migration on load, bad files."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess

import pytest
from result_docs import make_doc, refuse_reads

from bench import results
from bench.gate.compare import compare
from bench.gate.verdict import gate
from bench.results import REPO_ROOT, SCHEMA_VERSION, load_result, load_results, metric, validate, write_result

COMMITTED = REPO_ROOT / "results"
RELEASE_BASELINE = COMMITTED / "0.1.0" / "cpu-2c-amd-epyc"


# --------------------------------------------------------------------------------------------
# The metric entry
# --------------------------------------------------------------------------------------------


def test_a_single_sample_metric_has_no_spread():
    """One value (a peak, a byte count, an estimate) measures nothing about its noise: no IQR of 0."""
    assert metric([4096], "bytes", "lower") == {
        "unit": "bytes",
        "better": "lower",
        "samples": [4096.0],
        "median": 4096.0,
        "spread": None,
    }


def test_two_or_more_samples_have_a_spread():
    m = metric([1.0, 3.0], "s", "lower")
    assert m["median"] == 2.0
    assert m["spread"] == {"min": 1.0, "max": 3.0, "iqr": 1.0, "rel_iqr": 0.5}  # quartiles 1.5 and 2.5


def test_documents_with_single_sample_metrics_validate_and_round_trip(tmp_path):
    doc = make_doc(
        metrics={
            "peak_tensor_bytes": metric([4096], "bytes", "lower"),
            "step_time_s": metric([1.0, 1.1, 0.9], "s", "lower"),
        }
    )
    path = write_result(doc, tmp_path)
    stored = json.loads(path.read_text())
    assert stored["schema_version"] == SCHEMA_VERSION == 2
    assert stored["metrics"]["peak_tensor_bytes"]["spread"] is None
    assert stored["metrics"]["peak_tensor_bytes"]["samples"] == [4096.0]
    assert load_result(path).data == stored


@pytest.mark.parametrize(
    "samples, spread, where",
    [
        ([4096.0], {"min": 4096.0, "max": 4096.0, "iqr": 0.0, "rel_iqr": 0.0}, "metrics/m/spread"),  # an IQR of 0
        ([1.0, 2.0], None, "metrics/m/spread"),  # several samples need their spread
    ],
)
def test_version_2_spread_is_null_exactly_for_one_sample(samples, spread, where):
    doc = make_doc(
        metrics={"m": {"unit": "u", "better": "lower", "samples": samples, "median": samples[0], "spread": spread}}
    )
    with pytest.raises(results.ResultValidationError, match=f"invalid at {where}"):
        validate(doc)


def test_writes_use_the_current_version(tmp_path):
    doc = make_doc(metrics={"m": metric([1.0, 2.0], "u", "lower")})
    doc["schema_version"] = 1
    with pytest.raises(results.ResultValidationError, match="writes use version 2, got 1"):
        write_result(doc, tmp_path)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Version 1 documents: valid as stored, migrated on load
# --------------------------------------------------------------------------------------------


def test_version_1_documents_are_migrated_on_load(tmp_path):
    """Version 1 wrote a spread object on every metric, an IQR of 0 for one sample."""
    old = make_doc(
        metrics={
            "peak_tensor_bytes": {
                "unit": "bytes",
                "better": "lower",
                "samples": [4096.0],
                "median": 4096.0,
                "spread": {"min": 4096.0, "max": 4096.0, "iqr": 0.0, "rel_iqr": 0.0},
            },
            "step_time_s": metric([1.0, 2.0, 3.0], "s", "lower"),
        }
    )
    old["schema_version"] = 1
    validate(old)  # results/schema.json still describes version 1
    path = tmp_path / "smoke-e8.json"
    path.write_text(json.dumps(old))
    loaded = load_result(path).data
    assert loaded["schema_version"] == 2
    assert loaded["metrics"]["peak_tensor_bytes"] == {
        "unit": "bytes",
        "better": "lower",
        "samples": [4096.0],
        "median": 4096.0,
        "spread": None,
    }
    assert loaded["metrics"]["step_time_s"] == old["metrics"]["step_time_s"]
    assert {k: v for k, v in loaded.items() if k not in ("schema_version", "metrics")} == {
        k: v for k, v in old.items() if k not in ("schema_version", "metrics")
    }
    assert json.loads(path.read_text()) == old  # the file is left as it is
    broken = json.loads(json.dumps(old))
    broken["metrics"]["step_time_s"]["spread"] = None
    with pytest.raises(results.ResultValidationError, match="invalid at metrics/step_time_s/spread"):
        validate(broken)  # version 1 always had a spread object


needs_committed_results = pytest.mark.skipif(
    not RELEASE_BASELINE.is_dir(), reason="no committed results here (the image leaves results/ out: .dockerignore)"
)


@needs_committed_results
def committed_documents() -> list:
    """The result files git tracks under results/: what a user's own runs wrote there is not the repository's."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "results"], cwd=REPO_ROOT, capture_output=True, check=True
        ).stdout.decode()
        tracked = [REPO_ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # no git (an image): the folder as it is
        tracked = list(COMMITTED.rglob("*.json"))
    return sorted(p for p in tracked if p.suffix == ".json" and p.name != "schema.json" and p.exists())


def test_committed_result_documents_still_load():
    committed = committed_documents()
    assert {p.parent.parent.name for p in committed} >= {"0.1.0", "0.2.0"}  # execute and plan
    assert {json.loads(p.read_text())["schema_version"] for p in committed} <= {1, 2}
    docs = [load_result(p) for p in committed]
    assert len(docs) == len(committed)
    singles = 0
    for doc in docs:
        assert doc.data["schema_version"] == 2
        for name, entry in doc.metrics.items():
            assert (entry["spread"] is None) == (len(entry["samples"]) == 1), (doc.path, name)
            singles += entry["spread"] is None
    assert singles > 0  # peak memory, optimizer bytes, plan estimates


@needs_committed_results
def test_committed_result_documents_still_compare(tmp_path):
    docs = load_results(RELEASE_BASELINE)
    same = gate(compare(docs, docs, 0.05))
    assert same.exit_code == 0 and same.comparison.counts()["regressed"] == 0
    peak = [r for r in same.comparison.rows if r.metric == "peak_tensor_bytes"]
    assert peak and all(r.exact and r.noise == 0.0 and r.verdict == "unchanged" for r in peak)
    timing = [r for r in same.comparison.rows if r.metric == "step_time_s"]
    assert timing and not any(r.exact for r in timing)

    # The same release baseline with one execute scenario's peak memory 6% higher, still a version 1 file.
    cand = tmp_path / "cand"
    shutil.copytree(RELEASE_BASELINE, cand)
    path = cand / "e8-random-bf16.json"
    stored = json.loads(path.read_text())
    assert stored["schema_version"] == 1
    entry = stored["metrics"]["peak_tensor_bytes"]
    entry["samples"] = [entry["samples"][0] * 1.06]
    entry["median"] = entry["samples"][0]
    entry["spread"].update(min=entry["median"], max=entry["median"])
    path.write_text(json.dumps(stored))
    result = gate(compare(docs, load_results(cand), 0.05))
    assert result.exit_code == 1
    assert [(r.scenario, r.metric, r.exact) for r in result.comparison.regressions] == [
        ("e8-random-bf16", "peak_tensor_bytes", True)
    ]


# --------------------------------------------------------------------------------------------
# Bad files: the file and the reason, one line
# --------------------------------------------------------------------------------------------


VALID = json.dumps(make_doc(metrics={"m": metric([1.0, 2.0], "u", "lower")}))


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"timestamp": ', "not valid JSON: Expecting value: line 1 column 15 (char 14)"),
        ("", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ("[1, 2]", "not a result document: the JSON is an array, not an object"),
        (
            VALID.replace('"status": "ok"', '"status": "exploded"'),
            "result document invalid at status: 'exploded' is not one of ['ok', 'failed', 'oom', 'timeout', 'skipped']",
        ),
        (
            VALID.replace('"schema_version": 2', '"schema_version": 3'),
            "schema_version 3 is newer than this moe-bench reads (1, 2): update moe-bench",
        ),
    ],
    ids=["truncated", "empty", "array", "schema", "newer"],
)
def test_a_bad_file_is_named_with_its_reason(tmp_path, text, reason):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(results.ResultFileError) as caught:
        load_result(path)
    assert str(caught.value) == f"{path}: {reason}"
    assert (caught.value.path, caught.value.reason) == (path, reason)


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "locked.json"
    path.write_text(VALID)
    refuse_reads(monkeypatch, path)
    with pytest.raises(results.ResultFileError, match="^" + re.escape(f"{path}: cannot read: Permission denied") + "$"):
        load_result(path)


def test_load_results_raises_for_a_bad_file_or_skips_it(tmp_path):
    write_result(make_doc("good", metrics={"m": metric([1.0, 2.0], "u", "lower")}), tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"timestamp": ')
    with pytest.raises(results.ResultFileError, match=re.escape("bad.json: not valid JSON")):
        load_results(tmp_path)
    skipped = []
    docs = load_results(tmp_path, on_bad_file=skipped.append)
    assert [d.name for d in docs] == ["good"]
    assert [e.path for e in skipped] == [bad]
    assert load_results(tmp_path / "good.json")[0].name == "good"
    (tmp_path / "empty").mkdir()
    assert load_results(tmp_path / "empty") == []


def _written(tmp_path, file_name: str, timestamp: str) -> results.ResultDocument:
    path = tmp_path / file_name
    path.write_text(json.dumps(make_doc(timestamp=timestamp)))
    return load_result(path)


def test_age_key_orders_by_the_instant_then_the_run_suffix(tmp_path):
    # 00:30 at +01:00 is 23:30 UTC the day before: older than 00:00Z, although its text sorts after.
    zoned = _written(tmp_path, "smoke-e8.json", "2025-01-01T00:30:00+01:00")
    utc = _written(tmp_path, "smoke-e8.2.json", "2025-01-01T00:00:00Z")
    same_second = _written(tmp_path, "smoke-e8.3.json", "2025-01-01T00:00:00Z")
    unreadable = _written(tmp_path, "smoke-e8.4.json", "yesterday")
    assert sorted([same_second, utc, unreadable, zoned], key=results.age_key) == [unreadable, zoned, utc, same_second]
    assert [results.run_index(d) for d in (zoned, utc, same_second)] == [1, 2, 3]


def test_load_nonempty_names_what_it_skipped(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(results.ResultFileError):
        results.load_nonempty(tmp_path)
    warned = []
    with pytest.raises(results.NoResultDocuments, match=r"no result documents \(1 unreadable file skipped\)"):
        results.load_nonempty(tmp_path, on_bad_file=warned.append)
    assert len(warned) == 1
    good = tmp_path / "smoke-e8.json"
    good.write_text(json.dumps(make_doc()))
    loaded = results.load_nonempty(tmp_path, on_bad_file=warned.append)
    assert [d.path for d in loaded.docs] == [good] and len(loaded.skipped) == 1


@needs_committed_results
def test_committed_results_name_their_scenario_by_its_path_in_the_repository_and_its_digest():
    """Not by where the machine that wrote them kept the checkout; the digest is the file's content at
    the commit the result was measured at."""
    for path in committed_documents():
        data = json.loads(path.read_text())
        scenario = data["scenario"]
        assert scenario["file"].startswith("scenarios/") and not scenario["file"].startswith("/"), path
        shown = subprocess.run(
            ["git", "show", f"{data['engine']['git_commit']}:{scenario['file']}"],
            cwd=REPO_ROOT,
            capture_output=True,
            check=False,
        )
        if shown.returncode == 0:  # a shallow clone may lack the commit
            assert scenario["digest"] == hashlib.sha256(shown.stdout).hexdigest(), path


def test_a_result_names_a_repository_scenario_by_its_relative_path(tmp_path):
    inside = REPO_ROOT / "scenarios" / "smoke" / "e8-skewed-fp32.yaml"
    entry = results.scenario_file_entry(inside)
    assert entry == {
        "file": "scenarios/smoke/e8-skewed-fp32.yaml",
        "digest": hashlib.sha256(inside.read_bytes()).hexdigest(),
    }
    outside = tmp_path / "mine.yaml"
    outside.write_text("x: 1\n")
    assert results.scenario_file_entry(outside)["file"] == "mine.yaml"
    assert results.scenario_file_entry(None) == {"file": None}


def test_the_page_is_replaced_in_one_step(tmp_path):
    target = tmp_path / "index.html"
    target.write_text("old")
    results.write_text_atomic(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["index.html"]
