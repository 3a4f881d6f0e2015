"""Accepted changes: the spec, what an acceptance covers (and never more), the versions it applies to,
``moe-bench gate``/``compare``/``ab``/``release --accept`` and their bad input."""

from __future__ import annotations

import json

import pytest
from result_docs import make_doc

from bench.ab.gate import ABReport, paired_gate
from bench.ab.resident import ResidentComparison, WorkerPairBlocks
from bench.ab.sides import SideRun
from bench.cli import main
from bench.gate import paired
from bench.gate.accept import Acceptance, parse_acceptance
from bench.gate.compare import compare
from bench.gate.verdict import gate
from bench.gate.work import work_verdicts
from bench.release import record
from bench.results import REPO_ROOT, load_results, metric, write_result

REASON = "fp32 gradient buffers"


def flat(value: float, unit: str = "tokens/s", better: str = "higher") -> dict:
    """Five equal samples: no spread, so the threshold is the tolerance alone."""
    return metric([value] * 5, unit, better)


def docs(tmp_path, label: str, version: str = "0.1.0", scenario: str = "smoke-e8", **metrics) -> list:
    folder = tmp_path / label
    write_result(make_doc(scenario, metrics, version=version), folder)
    return load_results(folder)


def accept(text: str, release: str | None = None) -> Acceptance:
    return parse_acceptance(text, release=release)


def verdicts(result) -> dict[str, str]:
    return {r.metric: r.verdict for r in result.comparison.rows}


# ---- the spec -------------------------------------------------------------------------------------


def test_the_spec_names_metrics_scenarios_size_and_reason():
    a = accept("tokens_per_s_per_gpu,step_time_s@e8-skewed-fp32, moe-1.2t-512gpu-proxy <= 6.5%: fp32: on purpose")
    assert a == Acceptance(
        ("tokens_per_s_per_gpu", "step_time_s"), ("e8-skewed-fp32", "moe-1.2t-512gpu-proxy"), 0.065, "fp32: on purpose"
    )
    assert a.spec == "tokens_per_s_per_gpu,step_time_s@e8-skewed-fp32,moe-1.2t-512gpu-proxy<=6.5%: fp32: on purpose"
    assert parse_acceptance(a.spec) == a


@pytest.mark.parametrize(
    "text, message",
    [
        ("tokens_per_s_per_gpu: no scenario", "no '@' between the metric and the scenarios"),
        ("tokens_per_s_per_gpu@e8-skewed-fp32: no size", "no accepted size (such as <=6%)"),
        ("tokens_per_s_per_gpu@e8-skewed-fp32<=6%", "no reason after ':'"),
        ("tokens_per_s_per_gpu@e8-skewed-fp32<=6%:   ", "no reason after ':'"),
        ("tokens per s@e8-skewed-fp32<=6%: r", "'tokens per s' is not a metric name"),
        ("tokens_per_s_per_gpu@<=6%: r", "'' is not a scenario name"),
        ("tokens_per_s_per_gpu@a,,b<=6%: r", "'' is not a scenario name"),
        ("tokens_per_s_per_gpu@a<=6: r", "the accepted size '6' is not a percentage above 0"),
        ("tokens_per_s_per_gpu@a<=0%: r", "the accepted size '0%' is not a percentage above 0"),
        ("tokens_per_s_per_gpu@a<=lots%: r", "the accepted size 'lots%' is not a percentage above 0"),
        ("tokens_per_s_per_gpu@a<=5%: two\nlines", "not one line of text"),
    ],
)
def test_a_malformed_spec_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=r"expected METRIC|not a percentage") as err:
        parse_acceptance(text)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- what an acceptance covers -----------------------------------------------------------------------


def test_a_regression_within_the_accepted_size_passes_as_accepted_and_beyond_it_fails(tmp_path):
    """tokens/s 1000 -> 940 is 6% worse: beyond the 5% tolerance, within the accepted 7%. 1000 -> 920 is 8%."""
    allowed = [accept(f"tokens_per_s_per_gpu@smoke-e8<=7%: {REASON}")]
    base = docs(tmp_path, "base", tokens_per_s_per_gpu=flat(1000))

    within = gate(compare(base, docs(tmp_path, "within", tokens_per_s_per_gpu=flat(940))), 0.05, None, allowed)
    assert within.exit_code == 0 and verdicts(within) == {"tokens_per_s_per_gpu": "accepted"}
    (row,) = within.comparison.rows
    assert row.accepted == f"{REASON} (--accept, up to 7%)"
    assert (
        "ACCEPTED smoke-e8 tokens_per_s_per_gpu: 1000 -> 940 (x0.940, tolerance 5%, noise 0.0%) tokens/s "
        f"[1xnvidia-h200]; accepted: {REASON} (--accept, up to 7%)"
    ) in within.report.splitlines()
    assert within.report.startswith("PASS: 1 scenario(s) compared, 1 metric(s): 0 regressed, 1 accepted, ")

    beyond = gate(compare(base, docs(tmp_path, "beyond", tokens_per_s_per_gpu=flat(920))), 0.05, None, allowed)
    assert beyond.exit_code == 1 and verdicts(beyond) == {"tokens_per_s_per_gpu": "regressed"}
    assert beyond.failures == (
        (
            "REGRESSION smoke-e8 tokens_per_s_per_gpu: 1000 -> 920 (x0.920, tolerance 5%, noise 0.0%) tokens/s "
            f"[1xnvidia-h200]; beyond the accepted change: {REASON} (--accept, up to 7%)"
        ),
    )
    # Without the acceptance the 6% drop regresses: it was the acceptance that passed it.
    assert gate(compare(base, docs(tmp_path, "plain", tokens_per_s_per_gpu=flat(940))), 0.05).exit_code == 1


def test_an_acceptance_on_another_scenario_hides_nothing(tmp_path):
    allowed = [accept(f"tokens_per_s_per_gpu@e8-skewed-fp32,smoke-e8-other<=50%: {REASON}")]
    base = docs(tmp_path, "base", tokens_per_s_per_gpu=flat(1000))
    result = gate(compare(base, docs(tmp_path, "cand", tokens_per_s_per_gpu=flat(900))), 0.05, None, allowed)
    assert result.exit_code == 1 and verdicts(result) == {"tokens_per_s_per_gpu": "regressed"}
    assert "beyond the accepted change" not in result.report  # it does not name this scenario at all


def test_accepting_metric_x_does_not_hide_a_regression_of_metric_y_on_the_same_scenario(tmp_path):
    """tokens/s -10% is accepted (up to 12%); step time +11% on the same scenario is not named: it fails."""
    allowed = [accept(f"tokens_per_s_per_gpu@smoke-e8<=12%: {REASON}")]
    base = docs(tmp_path, "base", tokens_per_s_per_gpu=flat(1000), step_time_s=flat(1.0, "s", "lower"))
    cand = docs(tmp_path, "cand", tokens_per_s_per_gpu=flat(900), step_time_s=flat(1.11, "s", "lower"))
    result = gate(compare(base, cand), 0.05, None, allowed)
    assert verdicts(result) == {"tokens_per_s_per_gpu": "accepted", "step_time_s": "regressed"}
    assert result.exit_code == 1
    assert [f.split(":")[0] for f in result.failures] == ["REGRESSION smoke-e8 step_time_s"]


def test_acceptances_of_one_metric_compound():
    """Two releases accepting 5% each accept 1.05 x 1.05 = 1.1025 of peak memory, not more."""
    from bench.gate.accept import acceptance_of

    both = [accept("peak_tensor_bytes@s<=5%: a", "0.2.0"), accept("peak_tensor_bytes@s<=5%: b", "0.3.0")]
    assert acceptance_of(both, "peak_tensor_bytes", "s", 1.1025, "lower") == (tuple(both), True)
    assert acceptance_of(both, "peak_tensor_bytes", "s", 1.105, "lower")[1] is False
    assert acceptance_of(both, "tokens_per_s_per_gpu", "s", 1.0, "higher") == ((), False)
    # Higher is better: 0.95 x 0.95 = 0.9025.
    drops = [accept("tokens_per_s_per_gpu@s<=5%: a"), accept("tokens_per_s_per_gpu@s<=5%: b")]
    assert acceptance_of(drops, "tokens_per_s_per_gpu", "s", 0.9025, "higher")[1] is True
    assert acceptance_of(drops, "tokens_per_s_per_gpu", "s", 0.90, "higher")[1] is False


def test_a_release_acceptance_applies_from_an_older_baseline_to_that_release_or_newer(tmp_path):
    released = accept(f"peak_tensor_bytes@smoke-e8<=6%: {REASON}", release="0.2.0")
    assert released.applies("0.1.0", "0.2.0") and released.applies("0.1.0+13.g11819d8", "0.2.0+3.gabc1234.dirty")
    assert released.applies("0.1.0", "0.3.0")
    assert not released.applies("0.2.0", "0.2.0+1.gabc1234")  # the baseline has the change already
    assert not released.applies("0.1.0", "0.1.5")  # the candidate does not
    assert not released.applies(None, "0.2.0")
    assert accept(f"peak_tensor_bytes@smoke-e8<=6%: {REASON}").applies(None, None)  # the command line's: always

    peak = {"peak_tensor_bytes": metric([100.0], "bytes", "lower")}
    grown = {"peak_tensor_bytes": metric([105.5], "bytes", "lower")}

    def result(base_version: str, cand_version: str):
        base = docs(tmp_path, f"b-{base_version}", base_version, **peak)
        cand = docs(tmp_path, f"c-{cand_version}", cand_version, **grown)
        return gate(compare(base, cand), 0.05, None, [released])

    spanning = result("0.1.0", "0.2.0")
    assert spanning.exit_code == 0 and spanning.comparison.rows[0].accepted == f"{REASON} (release 0.2.0, up to 6%)"
    assert result("0.2.0", "0.2.0+1.gabc1234").exit_code == 1


def test_a_work_increase_within_an_acceptance_is_noted_and_beyond_it_fails():
    """work_aten_ops 800 -> 801 is +0.125%, within 1%; 800 -> 820 is +2.5%, beyond."""
    allowed = [accept(f"work_aten_ops@s<=1%: {REASON}")]

    def side(ops: int) -> tuple[dict, dict]:
        return {"work_aten_ops": metric([ops], "ops", "lower")}, {}

    assert work_verdicts("s", side(800), side(801), acceptances=allowed) == [
        (
            f"NOTE s work_aten_ops: work increased (accepted: {REASON} (--accept, up to 1%)): "
            "+1 op per step (+0.1%, 800 -> 801)"
        )
    ]
    assert work_verdicts("s", side(800), side(820), acceptances=allowed) == [
        (
            "REGRESSION s work_aten_ops: work increased: +20 ops per step (+2.5%, 800 -> 820); "
            f"beyond the accepted change: {REASON} (--accept, up to 1%)"
        )
    ]
    assert work_verdicts("s", side(800), side(801), acceptances=[accept(f"work_host_syncs@s<=1%: {REASON}")])[
        0
    ].startswith("REGRESSION s work_aten_ops")


# ---- moe-bench ab ---------------------------------------------------------------------------------


def test_the_ab_gate_accepts_an_exact_metric_and_the_step_time_by_name():
    def run(peak: float) -> SideRun:
        return SideRun("ok", None, {"peak_tensor_bytes": metric([peak], "bytes", "lower")}, "0.1.0")

    allowed = [accept(f"peak_tensor_bytes@a<=6%: {REASON}"), accept("step_time_s@a<=8%: slower on purpose")]
    report = paired_gate({"a": [(run(100.0), run(105.0))]}, 0.03, exact_only=True, acceptances=allowed)
    assert report.exit_code == 0 and [m.verdict for m in report.metrics] == ["accepted"]
    assert (
        f"ACCEPTED a peak_tensor_bytes: x1.050 (tolerance 3%, exact value); accepted: {REASON} (--accept, up to 6%)"
    ) in report.render()
    assert paired_gate({"a": [(run(100.0), run(107.0))]}, 0.03, acceptances=allowed).exit_code == 1

    def blocks(slowdown: float) -> ResidentComparison:
        pairs = [WorkerPairBlocks([1.0] * 3, [1.0 + slowdown] * 2) for _ in range(3)]
        est = paired.pooled([p.log_ratios for p in pairs])
        return ResidentComparison("a", 5, pairs, 12.0, est, paired.verdict(est, 0.03), "decided")

    slower = ABReport("base", "cand", 0.03, 1, resident=[blocks(0.07)], acceptances=allowed)
    assert slower.exit_code == 0 and slower.resident_verdict(slower.resident[0]) == "accepted"
    assert "ACCEPTED a step time: x1.070" in slower.render() and "1 accepted" in slower.render().splitlines()[0]
    beyond = ABReport("base", "cand", 0.03, 1, resident=[blocks(0.09)], acceptances=allowed)
    assert beyond.exit_code == 1
    assert "; beyond the accepted change: slower on purpose (--accept, up to 8%)" in beyond.render()
    # The blocks measure step time: accepting another metric of the scenario leaves them regressed.
    other = ABReport("base", "cand", 0.03, 1, resident=[blocks(0.07)], acceptances=allowed[:1])
    assert other.exit_code == 1


# ---- the command line ---------------------------------------------------------------------------------


@pytest.fixture
def no_releases(tmp_path, monkeypatch):
    """An empty release record in place of the repository's."""
    monkeypatch.setattr(record, "RELEASES_PATH", tmp_path / "releases.json")
    return tmp_path / "releases.json"


def write_sides(tmp_path, base_version="0.1.0", cand_version="0.2.0"):
    base, cand = tmp_path / "base", tmp_path / "cand"
    write_result(make_doc("s", {"tokens_per_s_per_gpu": flat(1000)}, version=base_version), base)
    write_result(make_doc("s", {"tokens_per_s_per_gpu": flat(940)}, version=cand_version), cand)
    return str(base), str(cand)


def test_gate_and_compare_accept_on_the_command_line(tmp_path, no_releases, capsys):
    base, cand = write_sides(tmp_path)
    assert main(["gate", "--baseline", base, "--candidate", cand]) == 1
    capsys.readouterr()
    spec = f"tokens_per_s_per_gpu@s<=7%: {REASON}"
    assert main(["gate", "--baseline", base, "--candidate", cand, "--accept", spec]) == 0
    out = capsys.readouterr().out
    assert f"; accepted: {REASON} (--accept, up to 7%)" in out and "REGRESSION" not in out
    assert main(["compare", base, cand, "--accept", spec]) == 0
    out = capsys.readouterr().out
    assert " accepted " in out and f"accepted: {REASON}" in out
    # A gated metric of the documents compared is known even where GATED_METRICS does not list it (a
    # micro-benchmark's, say); one they do not have is not.
    write_result(make_doc("m", {"moe_layer_time_s": flat(1.0, "s", "lower")}), tmp_path / "micro")
    micro = str(tmp_path / "micro")
    assert main(["gate", "--baseline", micro, "--candidate", micro, "--accept", "moe_layer_time_s@m<=5%: r"]) == 0
    assert main(["gate", "--baseline", base, "--candidate", cand, "--accept", "moe_layer_time_s@m<=5%: r"]) == 2


def test_gate_applies_the_releases_recorded_acceptances(tmp_path, no_releases, capsys):
    sha = "0123456789abcdef0123456789abcdef01234567"
    record.write_releases(
        [
            record.Release("0.1.0", sha, "2026-01-01"),
            record.Release("0.2.0", sha[::-1], "2026-02-01", (accept(f"tokens_per_s_per_gpu@s<=7%: {REASON}"),)),
        ],
        no_releases,
    )
    base, cand = write_sides(tmp_path / "a", "0.1.0", "0.2.0")
    assert main(["gate", "--baseline", base, "--candidate", cand]) == 0
    assert f"accepted: {REASON} (release 0.2.0, up to 7%)" in capsys.readouterr().out
    # From the release itself onwards the change is in the baseline: no acceptance.
    base, cand = write_sides(tmp_path / "b", "0.2.0", "0.3.0")
    assert main(["gate", "--baseline", base, "--candidate", cand]) == 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tokens_per_s_per_gpu@s: no size", "--accept 'tokens_per_s_per_gpu@s: no size': no accepted size"),
        (
            "peak_tensor_byte@s<=5%: typo",
            (
                "--accept 'peak_tensor_byte@s<=5%: typo': unknown metric peak_tensor_byte "
                "(did you mean peak_tensor_bytes?)"
            ),
        ),
        (
            "bogus_metric@s<=5%: r",
            (
                "--accept 'bogus_metric@s<=5%: r': unknown metric bogus_metric (gated metrics: "
                "step_time_s, tokens_per_s_per_gpu, "
            ),
        ),
    ],
)
@pytest.mark.parametrize("command", ["gate", "compare", "ab", "release"])
def test_bad_accept_is_one_line_and_exit_2(tmp_path, no_releases, capsys, command, spec, message):
    base, cand = write_sides(tmp_path)
    argv = {
        "gate": ["gate", "--baseline", base, "--candidate", cand],
        "compare": ["compare", base, cand],
        "ab": ["ab", "--baseline-ref", "HEAD"],
        "release": ["release", "9.9.9"],
    }[command]
    assert main([*argv, "--accept", spec]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"moe-bench: error: {message}") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err and captured.out == ""
    assert not no_releases.exists()


def test_release_records_acceptances_with_a_recorded_release(tmp_path, no_releases, capsys):
    sha = "0123456789abcdef0123456789abcdef01234567"
    record.write_releases([record.Release("0.1.0", sha, "2026-01-01")], no_releases)
    spec = f"peak_tensor_bytes@e8-random-bf16,e8-ep2-nosync-bf16<=6%: {REASON}"
    assert main(["release", "0.1.0", "--accept", spec]) == 0
    assert main(["release", "0.1.0", "--accept", spec]) == 0  # recorded once
    assert json.loads(no_releases.read_text())["releases"][0]["accepted"] == [spec]
    (release,) = record.load_releases(no_releases)
    assert release.accepted == (accept(spec, release="0.1.0"),)
    capsys.readouterr()
    assert main(["release"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"  accepted: {spec}"
    assert main(["release", "--accept", spec]) == 2
    assert "name the release" in capsys.readouterr().err


# ---- the repository's own record ---------------------------------------------------------------------------


def test_release_0_2_0_accepts_its_fp32_gradient_peak_and_nothing_else():
    """0.1.0 -> 0.2.0 on the committed results: e8-ep2-nosync-bf16's peak (+5.4%, the fp32 gradient buffers)
    and e8-skewed-fp32's timings (one 5-step run each, 5.0% apart; the A/B blocks of both releases measured
    x1.007, unchanged) are accepted, each with its reason; nothing else changed."""
    base = REPO_ROOT / "results" / "0.1.0" / "cpu-2c-intel-r-xeon"
    cand = REPO_ROOT / "results" / "0.2.0" / "cpu-2c-intel-r-xeon"
    if not base.is_dir() or not cand.is_dir():
        pytest.skip("no committed results here (the image leaves results/ out: .dockerignore)")
    acceptances = [a for r in record.load_releases() for a in r.accepted]
    result = gate(compare(load_results(base), load_results(cand)), 0.05, None, acceptances)
    changed = {
        (r.scenario, r.metric): r.verdict for r in result.comparison.rows if r.verdict in ("accepted", "regressed")
    }
    assert changed == {
        ("e8-ep2-nosync-bf16", "peak_tensor_bytes"): "accepted",
        ("e8-skewed-fp32", "step_time_s"): "accepted",
        ("e8-skewed-fp32", "tflops_per_gpu"): "accepted",
        ("e8-skewed-fp32", "tokens_per_s_per_gpu"): "accepted",
    }
    reasons = {r.accepted for r in result.comparison.rows if r.verdict == "accepted"}
    assert any("fp32 gradient buffers" in reason for reason in reasons)
    assert any("x1.007" in reason and "unchanged" in reason for reason in reasons)
