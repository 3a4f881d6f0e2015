"""The report page's verdict: accepted changes with their reasons, the banner's outcome, and which release it
calls the latest."""

from __future__ import annotations

import re

import pytest
from report_results import BASE, NEW, write_two_versions
from result_docs import make_doc

from bench.gate.accept import parse_acceptance
from bench.release.record import Release
from bench.report.collect import VersionPair, choose_versions, load_result_set
from bench.report.page import build_report
from bench.report.release_table import release_comparison
from bench.results import metric, result_dir, write_result

SHA = "0123456789abcdef0123456789abcdef01234567"
REASON = "a router that balances exactly"
# report_results: e8-random-bf16's tokens/s 1000 -> 800 (-20%) and its step time x1.25, both regressed.
TOKENS_ACCEPTED = parse_acceptance(f"tokens_per_s_per_gpu@e8-random-bf16<=21%: {REASON}", release=NEW)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    folder = write_two_versions(tmp_path_factory.mktemp("results"))
    releases = [Release(BASE, SHA, "2026-01-01"), Release(NEW, SHA[::-1], "2026-06-01", (TOKENS_ACCEPTED,))]
    report = build_report(folder, tmp_path_factory.mktemp("page"), releases=releases, comparisons=[])
    return report.path.read_text()


def verdict_cell(text: str, scenario: str, name: str) -> str:
    table = re.search(rf"<table class='comparison' data-scenario='{scenario}'.*?</table>", text).group(0)
    return re.search(rf"<tr><td>{name}</td>.*?<td>(<span class='verdict.*?)</td></tr>", table).group(1)


def test_the_page_shows_an_accepted_change_with_its_reason_and_no_more(page):
    assert verdict_cell(page, "e8-random-bf16", "tokens_per_s_per_gpu") == (
        f"<span class='verdict verdict-accepted'>accepted</span><span class='reason'>: {REASON} "
        f"(release {NEW}, up to 21%)</span>"
    )
    # The step time of the same scenario is another metric: still regressed, and the page still fails.
    assert verdict_cell(page, "e8-random-bf16", "step_time_s") == (
        "<span class='verdict verdict-regressed'>regressed</span>"
    )
    assert re.search(
        r"<ul class='accepted'><li>ACCEPTED e8-random-bf16 tokens_per_s_per_gpu: 1000 -&gt; 800 "
        rf"\(x0\.800, [^<]*; accepted: {REASON} \(release {NEW}, up to 21%\)</li></ul>",
        page,
    )
    assert "data-gate='regressed'><b>Regressed</b>: " in page
    assert "<span class='count' data-count='regressed'>2 regressed</span>" in page  # step time, host syncs
    assert "<span class='count' data-count='accepted'>1 accepted</span>" in page


def test_the_page_calls_only_the_latest_release_the_latest(page):
    """0.2.0 is a release: the comparison is release 0.1.0 against it, and 0.1.0 is not "the latest"."""
    assert f"release {BASE}, the last release before {NEW}, against release {NEW}, the newest results" in page
    named = re.findall(r"latest release\W+(\d[\w.+]*)", page)
    assert all(version == NEW for version in named), named


def test_the_wording_of_each_choice_of_versions(tmp_path):
    for version in (BASE, NEW):
        write_result(make_doc("a", version=version), result_dir(tmp_path, version, "m"))
    both = choose_versions(load_result_set(tmp_path, releases=[BASE, NEW]))
    assert both.why == f"release {BASE}, the last release before {NEW}, against release {NEW}, the newest results"
    older = choose_versions(load_result_set(tmp_path, releases=[BASE]))
    assert older.why == f"the latest release ({BASE}) against {NEW}, the newest results"
    asked = choose_versions(load_result_set(tmp_path, releases=[BASE, NEW]), new=NEW)
    assert asked.why == f"release {BASE}, the last release before {NEW}, against release {NEW} (--new)"


# ---- the banner's outcome ---------------------------------------------------------------------------------


def flat(value: float) -> dict:
    return metric([value] * 5, "tokens/s", "higher")


def noisy(value: float) -> dict:
    """Five samples around ``value`` with an interquartile range of 20% of it."""
    return metric([value * f for f in (0.8, 0.9, 1.0, 1.1, 1.2)], "tokens/s", "higher")


# The new version's tokens/s of scenario "a" against a baseline of 1000 (flat unless noisy), what the new
# version holds besides, and the outcome: "a" -6% is within an acceptance of 7% and beyond the 5% tolerance.
OUTCOMES = {
    "pass": (flat(1000), [], "pass"),
    "accepted": (flat(940), [], "accepted"),
    "beyond the acceptance": (flat(920), [], "regressed"),
    "inconclusive": (noisy(940), [], "inconclusive"),
    "missing": (flat(1000), ["b missing"], "missing"),
    "failed in the new version": (flat(1000), ["b failed"], "not-ok"),
    "regressed and missing": (flat(900), ["b missing"], "regressed"),
}


@pytest.mark.parametrize("case", OUTCOMES)
def test_the_banner_tells_regressed_missing_not_ok_inconclusive_accepted_and_pass_apart(tmp_path, case):
    tokens, extra, outcome = OUTCOMES[case]
    base_tokens = noisy(1000) if case == "inconclusive" else flat(1000)
    base, new = result_dir(tmp_path, BASE, "m"), result_dir(tmp_path, NEW, "m")
    write_result(make_doc("a", {"tokens_per_s_per_gpu": base_tokens}, version=BASE), base)
    write_result(make_doc("b", {"tokens_per_s_per_gpu": flat(1000)}, version=BASE), base)
    write_result(make_doc("a", {"tokens_per_s_per_gpu": tokens}, version=NEW), new)
    if "b failed" in extra:
        write_result(make_doc("b", status="failed", version=NEW), new)
    elif "b missing" not in extra:
        write_result(make_doc("b", {"tokens_per_s_per_gpu": flat(1000)}, version=NEW), new)
    accepted = parse_acceptance(f"tokens_per_s_per_gpu@a<=7%: {REASON}", release=NEW)
    comparison = release_comparison(
        load_result_set(tmp_path, releases=[BASE, NEW]), VersionPair(BASE, NEW, ""), acceptances=[accepted]
    )
    assert comparison.outcome == outcome
    assert comparison.gate.passed == (outcome in ("pass", "accepted", "inconclusive"))
