"""Releases that carry their baseline: where each release's own results are, and a release without
stored results shown as such (listed, and named on the report page) rather than passed over."""

from __future__ import annotations

from git_repo import SHA
from result_docs import make_doc

from bench.cli import main
from bench.release import record
from bench.release.record import Release, load_releases, record_baseline, write_releases
from bench.report.page import build_report
from bench.results import metric, write_result


def test_a_baseline_is_recorded_kept_and_said(tmp_path):
    path = tmp_path / "releases.json"
    write_releases([Release("0.1.0", SHA, "2025-01-01"), Release("0.2.0", SHA[::-1], "2025-02-01")], path)
    record_baseline("0.1.0", "cpu-2c-amd-epyc", "results/0.1.0/cpu-2c-amd-epyc", SHA, path=path)
    first, second = load_releases(path)
    assert first.baseline == {"machine": "cpu-2c-amd-epyc", "results": "results/0.1.0/cpu-2c-amd-epyc", "commit": SHA}
    assert "results of cpu-2c-amd-epyc in results/0.1.0/cpu-2c-amd-epyc at commit " + SHA[:12] in first.baseline_text()
    assert second.baseline is None
    assert second.baseline_text().startswith("no stored results; compare with moe-bench ab --baseline-ref v0.2.0")
    # Rewriting the record (an accepted change added) keeps the baseline.
    write_releases(load_releases(path), path)
    assert load_releases(path)[0].baseline == first.baseline


def test_the_release_list_says_which_release_has_no_stored_results(tmp_path, monkeypatch, capsys):
    path = tmp_path / "releases.json"
    write_releases([Release("0.1.0", SHA, "2025-01-01", baseline={"machine": "m", "results": "results/0.1.0/m"})], path)
    write_releases([*load_releases(path), Release("0.2.0", SHA[::-1], "2025-02-01")], path)
    monkeypatch.setattr(record, "RELEASES_PATH", path)
    assert main(["release"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  results of m in results/0.1.0/m; elsewhere: " + Release("0.1.0", SHA, "").compare_elsewhere()
    assert out[3].startswith("  no stored results; compare with moe-bench ab --baseline-ref v0.2.0")


def _doc(version: str, tokens: float) -> dict:
    metrics = {"tokens_per_s_per_gpu": metric([tokens * f for f in (0.99, 1.0, 1.01)], "tokens/s", "higher")}
    return make_doc("smoke-e8", metrics, version=version)


def test_the_page_names_a_release_without_results_and_how_to_compare_it(tmp_path):
    for version in ("0.1.0", "0.2.0+5.gabcdef0"):
        write_result(_doc(version, 1000.0), tmp_path / "r" / version / "1xnvidia-h200")
    releases = [
        Release("0.1.0", SHA, "2025-01-01", baseline={"machine": "1xnvidia-h200", "results": "results/0.1.0/x"}),
        Release("0.2.0", SHA[::-1], "2025-02-01"),  # cut elsewhere: no results in this folder
    ]
    report = build_report(tmp_path / "r", tmp_path / "page", releases=releases)
    versions = report.comparison.versions
    assert (versions.base, versions.new, versions.unmeasured) == ("0.1.0", "0.2.0+5.gabcdef0", ("0.2.0",))
    assert "release 0.1.0 (the newest release with results here; release 0.2.0: none here)" in versions.why
    page = report.path.read_text()
    assert "<b>Release 0.2.0: not compared, it has no results in this folder.</b>" in page
    assert "moe-bench ab --baseline-ref v0.2.0" in page
