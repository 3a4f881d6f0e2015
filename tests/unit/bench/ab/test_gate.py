"""moe-bench ab: the paired gate's arithmetic, bad input, and the gate over scenarios on faked sides."""

from __future__ import annotations

import contextlib
import re
import subprocess
from pathlib import Path

import pytest
from ab_checkout import TINY_AB, needs_checkout, worktrees, write_tiny_ab

from bench.ab.gate import _estimate, paired_gate, paired_metric
from bench.ab.plan import ABError, ABPlan, plan_ab
from bench.ab.resident import ResidentComparison, WorkerPairBlocks
from bench.ab.sides import SideRun
from bench.cli import main
from bench.gate import paired
from bench.results import REPO_ROOT, metric


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_ab(tmp_path)


# --------------------------------------------------------------------------------------------
# The paired gate
# --------------------------------------------------------------------------------------------


def entry(value: float, better: str | None = "lower") -> dict:
    return metric([value * 0.99, value, value * 1.01], "s", better)


def pairs_of(base: list[float], cand: list[float], better: str | None = "lower") -> list[tuple[dict, dict]]:
    return [(entry(b, better), entry(c, better)) for b, c in zip(base, cand)]


def test_drift_cancels_in_the_pairs():
    """The machine slows down 2x during the job, equally for both sides of each pair: no change."""
    m = paired_metric("s", "step_time_s", pairs_of([1.0, 1.5, 2.0], [1.0, 1.5, 2.0]), tolerance=0.05)
    assert m.ratios == (1.0, 1.0, 1.0) and m.ratio == 1.0 and m.noise == 0.0 and m.verdict == "unchanged"


def test_constructed_regression_is_detected():
    """The candidate is 50% slower in every pair, on a drifting machine: a regression beyond 30% and the noise."""
    m = paired_metric("s", "step_time_s", pairs_of([1.0, 1.4, 1.1], [1.5, 2.0, 1.7]), tolerance=0.30)
    assert m.ratio == pytest.approx(1.5) and m.noise < 0.1 and m.verdict == "regressed"
    tput_pairs = pairs_of([100, 70, 90], [66, 47, 60], "higher")
    throughput = paired_metric("s", "tokens_per_s_per_gpu", tput_pairs, tolerance=0.30)
    assert throughput.ratio < 0.7 and throughput.verdict == "regressed"


def test_regression_inside_the_noise_does_not_fail():
    """Median 1.4 but the pairs disagree wildly: the noise (IQR of the ratios) exceeds the change, which is
    beyond the tolerance: inconclusive, and the gate passes."""
    m = paired_metric("s", "step_time_s", pairs_of([1.0, 1.0, 1.0], [0.6, 1.4, 2.4]), tolerance=0.30)
    assert m.ratio == pytest.approx(1.4) and m.noise == pytest.approx(0.9) and m.verdict == "inconclusive"


def test_below_tolerance_does_not_fail_and_improvements_are_reported():
    small = paired_metric("s", "step_time_s", pairs_of([1.0, 1.0, 1.0], [1.2, 1.2, 1.2]), tolerance=0.30)
    assert small.verdict == "unchanged"
    faster = paired_metric("s", "step_time_s", pairs_of([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]), tolerance=0.30)
    assert faster.verdict == "improved"


def run(status: str = "ok", step: float = 1.0, error: str | None = None) -> SideRun:
    metrics = {"step_time_s": entry(step), "loss": entry(2.0, None)} if status == "ok" else {}
    return SideRun(status, error, metrics, "0.1.0")


def test_gate_report_and_exit_codes():
    ok = paired_gate({"a": [(run(), run()) for _ in range(3)]}, 0.3)
    assert ok.exit_code == 0 and [m.metric for m in ok.metrics] == ["step_time_s"]  # loss is not gated
    assert ok.render().startswith("PASS: A/B baseline -> candidate, 1 scenario(s) compared")

    slow = paired_gate({"a": [(run(step=1.0), run(step=2.0)) for _ in range(3)]}, 0.3)
    assert slow.exit_code == 1 and "REGRESSION a step_time_s: x2.000" in slow.render()

    broken = paired_gate({"a": [(run(), run()), (run(), run("failed", error="boom")), (run(), run())]}, 0.3)
    assert broken.exit_code == 1 and "NOT-OK a: candidate failed (boom)" in broken.render()

    new = paired_gate({"a": [(run("failed", error="unknown field"), run()) for _ in range(3)]}, 0.3)
    assert new.exit_code == 0 and "NOTE a: baseline failed (unknown field); not compared" in new.render()

    skip = run("skipped", error="needs 2 GPUs")
    skipped = paired_gate({"a": [(skip, skip)] * 3}, 0.3)
    assert skipped.exit_code == 0 and "skipped on both sides" in skipped.render()


def test_an_accepted_increase_of_an_exact_metric_passes_and_is_reported():
    def peak(value: float, step: float = 1.0) -> SideRun:
        metrics = {"peak_tensor_bytes": metric([value], "bytes", "lower"), "step_time_s": entry(step)}
        return SideRun("ok", None, metrics, "0.1.0")

    grown = [(peak(100.0), peak(105.0))]
    failed = paired_gate({"a": grown}, 0.03, exact_only=True)
    assert failed.exit_code == 1 and "REGRESSION a peak_tensor_bytes: x1.050" in failed.render()
    accepted = paired_gate({"a": grown}, 0.03, exact_only=True, accept_increase=frozenset({"peak_tensor_bytes"}))
    assert accepted.exit_code == 0 and [m.verdict for m in accepted.metrics] == ["accepted"]
    assert "NOTE a peak_tensor_bytes: x1.050, beyond the tolerance (accepted)" in accepted.render()
    assert "1 accepted" in accepted.render().splitlines()[0]
    # Only the named metric, and never a timed one (the timed metric is left to the resident blocks).
    slow = paired_gate(
        {"a": [(peak(100.0, 1.0), peak(100.0, 2.0)) for _ in range(3)]},
        0.03,
        accept_increase=frozenset({"peak_tensor_bytes"}),
    )
    assert slow.exit_code == 1


def test_a_changed_plan_estimate_is_reported_not_gated():
    def plan(total: float) -> SideRun:
        metrics = {"memory_total_bytes": metric([total], "bytes", "lower")}
        return SideRun("ok", None, metrics, "0.1.0", mode="plan")

    grown = paired_gate({"p": [(plan(100.0), plan(150.0)) for _ in range(3)]}, 0.3)
    assert grown.exit_code == 0 and [m.verdict for m in grown.metrics] == ["info"]
    assert "NOTE p memory_total_bytes: plan estimate changed x1.500 (not gated)" in grown.render()
    same = paired_gate({"p": [(plan(100.0), plan(100.0)) for _ in range(3)]}, 0.3)
    assert same.exit_code == 0 and "plan estimate changed" not in same.render()


def test_single_sample_metric_is_gated_as_an_exact_value():
    """Peak memory, one sample per run; pair ratios 1.06, 1.00, 1.15 (median 1.06) at tolerance 5%.

    Exact value: noise 0, 1.06 > 1.05 -> regressed. The same medians as timings (three samples each)
    have the IQR of the ratios as noise, inclusive quartiles 1.03 and 1.105: 7.5% > 6% -> inconclusive.
    """

    def single(value: float) -> dict:
        return metric([value], "bytes", "lower")

    cands = (106.0, 100.0, 115.0)
    exact = paired_metric("s", "peak_tensor_bytes", [(single(100.0), single(c)) for c in cands], tolerance=0.05)
    assert exact.ratio == pytest.approx(1.06) and exact.verdict == "regressed"
    assert exact.exact and exact.noise == 0.0
    timing = paired_metric("s", "step_time_s", pairs_of([100.0] * 3, list(cands)), tolerance=0.05)
    assert not timing.exact and timing.noise == pytest.approx(0.075) and timing.verdict == "inconclusive"
    equal = paired_metric("s", "peak_tensor_bytes", [(single(100.0), single(100.0))] * 3, tolerance=0.0)
    assert equal.exact and equal.verdict == "unchanged"

    def side(value: float) -> SideRun:
        return SideRun("ok", None, {"peak_tensor_bytes": single(value)}, "0.1.0")

    report = paired_gate({"s": [(side(100.0), side(c)) for c in cands]}, 0.05)
    assert report.exit_code == 1
    text = report.render()
    assert "REGRESSION s peak_tensor_bytes: x1.060 (tolerance 5%, exact value)" in text
    assert any(line.split()[-4:] == ["exact", "3", "run(s)", "regressed"] for line in text.splitlines())


def test_rss_is_gated_above_its_measured_noise_floor():
    """One RSS sample per run, at tolerance 3%: +5.4% (an A/A spread seen on a 2-core CPU machine) is
    within the 10% floor (inconclusive, not failed), +15% regresses; peak_tensor_bytes at +5.4% still regresses."""

    def side(name: str, value: float) -> SideRun:
        return SideRun("ok", None, {name: metric([value], "bytes", "lower")}, "0.1.0")

    def gate(name: str, cand: float):
        return paired_gate({"s": [(side(name, 100.0), side(name, cand))]}, 0.03, exact_only=True)

    within = gate("rss_peak_bytes", 105.4)
    assert within.exit_code == 0 and within.metrics[0].verdict == "inconclusive"
    assert within.metrics[0].exact and within.metrics[0].noise == pytest.approx(0.10)
    leak = gate("rss_peak_bytes", 115.0)
    assert leak.exit_code == 1
    assert "REGRESSION s rss_peak_bytes: x1.150 (tolerance 3%, noise 10.0%)" in leak.render()
    assert gate("peak_tensor_bytes", 105.4).exit_code == 1


def test_an_unreadable_side_result_is_a_failed_run(tmp_path, tiny, monkeypatch):
    """A side that leaves a truncated result file fails that run, naming the file; nothing raises."""
    from bench.ab import sides as ab_sides
    from bench.scenario import load_scenario

    def fake_run(command, cwd, env, timeout):
        folder = Path(command[command.index("--out") + 1]) / "0.1.0" / "cpu-box"
        folder.mkdir(parents=True)
        (folder / "tiny-ab.json").write_text('{"timestamp": ')
        return 0, ""

    monkeypatch.setattr(ab_sides, "_run", fake_run)
    out = tmp_path / "side"
    result = ab_sides.run_side(REPO_ROOT, load_scenario(tiny), out, "cpu")
    bad = out / "0.1.0" / "cpu-box" / "tiny-ab.json"
    reason = "not valid JSON: Expecting value: line 1 column 15 (char 14)"
    assert (result.status, result.error) == ("failed", f"{bad}: {reason}")


# --------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written, no worktree left
# --------------------------------------------------------------------------------------------


@needs_checkout
def test_nonexistent_ref(tmp_path, tiny, capsys):
    before = worktrees()
    out = tmp_path / "kept"
    assert main(["ab", str(tiny), "--baseline-ref", "no-such-ref-4f1e", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "moe-bench: error: --baseline-ref no-such-ref-4f1e: no such commit, branch or tag in this repository\n"
    )
    assert not out.exists() and worktrees() == before


@needs_checkout
def test_no_release_recorded(tmp_path, tiny):
    from bench.run.suites import load_all

    with pytest.raises(ABError, match=re.escape("no release recorded in none.json: pass --baseline-ref")):
        plan_ab(None, load_all([tiny]), 0.3, releases_path=tmp_path / "none.json")


@needs_checkout
def test_latest_release_is_the_default_baseline(tmp_path, tiny):
    from bench.release.record import Release, write_releases
    from bench.run.suites import load_all

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    path = tmp_path / "releases.json"
    write_releases([Release("0.1.0", head, "2025-01-01")], path)
    plan = plan_ab(None, load_all([tiny]), 0.3, releases_path=path)
    assert plan.commit == head and plan.label == "release 0.1.0"
    write_releases([Release("0.1.0", "f" * 40, "2025-01-01")], path)
    with pytest.raises(ABError, match="is not in this clone"):
        plan_ab(None, load_all([tiny]), 0.3, releases_path=path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "5"], "--budget 5 s is too small: it must hold 3 worker pairs of 2 block pairs"),
        (["--accept-work", "work_nope"], "--accept-work: unknown work metric work_nope"),
        (
            ["--accept-increase", "step_time_s"],
            "--accept-increase: step_time_s is not an exact metric the gate can accept",
        ),
        (["--tolerance", "lots"], "tolerance"),
        (["--suite", "nope"], "no such suite"),
        (["--tolerance", "3%", "--warn-above", "4.5%"], "--warn-above 4.50% must lie between 0 and the tolerance"),
        (["--budget", "45", "--deadline", "30"], "--deadline 30 s must be at least the --budget (45 s)"),
    ],
)
def test_other_bad_input(tmp_path, argv, message, capsys):
    assert main(["ab", "--baseline-ref", "HEAD", *argv]) == 2
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The gate over several scenarios, on faked sides (the end-to-end A/B: tests/integration/workers)
# --------------------------------------------------------------------------------------------


def comparison(name: str, slowdown: float, spread: float = 0.0) -> ResidentComparison:
    """Three worker pairs of two block pairs each, the candidate ``slowdown`` slower (each pair off by ``spread``)."""
    pairs = [WorkerPairBlocks([1.0] * 3, [(1.0 + slowdown) * (1 + spread * d)] * 2) for d in (-1, 0, 1)]
    est = paired.pooled([p.log_ratios for p in pairs])
    return ResidentComparison(name, 5, pairs, 12.0, est, paired.verdict(est, 0.03), "decided")


def test_a_regression_in_one_scenario_only_fails_the_gate_naming_it(tmp_path, tiny, monkeypatch):
    """Three scenarios, one of them slower: the gate fails, and its finding names that one alone."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    files = []
    for name in ("tiny-a", "tiny-b", "tiny-c"):
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(TINY_AB)
    ok_doc = SideRun("ok", None, {}, "0.1.0")
    monkeypatch.setattr(ab, "run_side", lambda root, scenario, out, device: ok_doc)
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    slowdowns = {"tiny-a": 0.0, "tiny-b": 0.08, "tiny-c": -0.01}
    monkeypatch.setattr(
        ab, "_resident", lambda sides, scenario, *a, **k: comparison(scenario.name, slowdowns[scenario.name])
    )
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all(files), 0.03, 20.0), device="cpu")
    out = report.render()
    assert report.exit_code == 1 and [r.verdict for r in report.resident] == ["unchanged", "regressed", "unchanged"]
    findings = [line for line in out.splitlines() if line.startswith(("REGRESSION", "INCONCLUSIVE"))]
    assert len(findings) == 1 and findings[0].startswith("REGRESSION tiny-b step time: x1.080")
    assert out.startswith("FAIL: ") and "1 regressed" in out.splitlines()[0]


def test_a_slowdown_between_the_warning_and_the_tolerance_warns_and_passes(tmp_path, monkeypatch):
    """CI's operating point: 3.5% is beyond the 3% warning and within the 4.5% tolerance, so the gate
    passes with a WARNING line naming the scenario; 6% fails it. Without --warn-above, no warnings."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    files = []
    for name in ("tiny-a", "tiny-b", "tiny-c"):
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(TINY_AB)
    monkeypatch.setattr(ab, "run_side", lambda root, scenario, out, device: SideRun("ok", None, {}, "0.1.0"))
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    slowdowns = {"tiny-a": 0.0, "tiny-b": 0.035, "tiny-c": 0.0}

    def resident(sides, scenario, *args, **kwargs):
        c = comparison(scenario.name, slowdowns[scenario.name])
        c.verdict = paired.verdict(_estimate(c), 0.045)  # as compare_resident reads it at the plan's tolerance
        return c

    def run(warn_above):
        monkeypatch.setattr(ab, "_resident", resident)
        plan = ABPlan("HEAD", "0" * 40, load_all(files), 0.045, 20.0, warn_above=warn_above)
        report = ab.run_ab(plan, device="cpu")
        return report, report.render().splitlines()

    report, lines = run(0.03)
    assert report.exit_code == 0 and lines[0].startswith("PASS: ")
    assert lines[0].endswith("(tolerance 4.5%, 1 warned (warning above 3%))")
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert warnings == [
        "WARNING tiny-b step time: x1.035, interval [1.035, 1.035] over 3 worker pairs: beyond the warning "
        "threshold 3%, within the tolerance 4.5% (passed)"
    ]
    assert not [line for line in lines if line.startswith(("REGRESSION", "INCONCLUSIVE"))]
    _, quiet = run(None)
    assert not [line for line in quiet if line.startswith("WARNING")] and quiet[0].endswith("(tolerance 4.5%)")
    slowdowns["tiny-b"] = 0.06
    report, lines = run(0.03)
    assert report.exit_code == 1 and not [line for line in lines if line.startswith("WARNING")]
    regression = next(line for line in lines if line.startswith("REGRESSION"))
    assert regression.startswith("REGRESSION tiny-b step time: x1.060")


def test_a_scenario_noisier_than_the_design_is_noted(tmp_path, monkeypatch, tiny):
    """A standard error beyond the operating point's limit (4.3% at a 4.5% tolerance for a suite of one
    scenario, whose level is the suite's 5%) gets a NOTE that the gate's false-alarm rate does not hold
    there; it passes or fails as its estimate says."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    noisy = comparison("tiny-ab", 0.0, spread=0.08)
    assert noisy.estimate is not None and noisy.estimate.se > 0.045
    monkeypatch.setattr(ab, "run_side", lambda root, scenario, out, device: SideRun("ok", None, {}, "0.1.0"))
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    monkeypatch.setattr(ab, "_resident", lambda *a, **k: noisy)
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all([tiny]), 0.045, 20.0), device="cpu")
    notes = [line for line in report.render().splitlines() if "standard error" in line]
    assert report.exit_code == 0 and len(notes) == 1
    assert notes[0].startswith("NOTE tiny-ab step time: standard error 4.6% over 3 worker pairs, beyond the 4.3% up to")


@pytest.mark.parametrize("slowdown, fails", [(0.0, False), (0.04, True)])
def test_an_inconclusive_scenario_fails_the_gate_only_beyond_the_tolerance(
    tmp_path, tiny, monkeypatch, slowdown, fails
):
    """An interval that still admits the tolerance after the budget and its extension is never
    "unchanged": centred on no change it passes with a note that says so; centred beyond the tolerance
    (but not excluding no change) it fails, naming the scenario."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    ok_doc = SideRun("ok", None, {}, "0.1.0")
    monkeypatch.setattr(ab, "run_side", lambda root, scenario, out, device: ok_doc)
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    wide = comparison("tiny-ab", slowdown, spread=0.03)
    assert wide.verdict == "inconclusive"
    monkeypatch.setattr(ab, "_resident", lambda *a, **k: wide)
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all([tiny]), 0.03, 20.0), device="cpu")
    out = report.render()
    assert report.exit_code == int(fails)
    assert out.startswith("FAIL: " if fails else "PASS: ") and "1 inconclusive" in out.splitlines()[0]
    finding = next(line for line in out.splitlines() if line.startswith(("INCONCLUSIVE", "NOTE")))
    if fails:
        assert finding.startswith("INCONCLUSIVE tiny-ab step time: x1.040, interval [0.965, 1.120] still admits")
        assert "beyond the tolerance and a regression cannot be ruled out; raise --budget" in finding
    else:
        assert finding.startswith("NOTE tiny-ab step time: x1.000, interval [0.928, 1.077] still admits")
        assert "inconclusive, passed: the estimate is within the tolerance" in finding


@pytest.mark.parametrize("final_slowdown, fails", [(0.005, False), (0.06, True)])
def test_the_report_says_what_the_confirmation_did(tmp_path, tiny, monkeypatch, final_slowdown, fails):
    """A failing first reading (x1.080 on three worker pairs) that the fresh pairs withdraw passes with
    a note giving both readings; one they confirm fails, its finding giving the first reading too."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    first, final = comparison("tiny-ab", 0.08), comparison("tiny-ab", final_slowdown)
    final.pairs, final.stopped_by, final.unconfirmed = first.pairs + final.pairs, "confirmation", first.estimate
    monkeypatch.setattr(ab, "run_side", lambda root, scenario, out, device: SideRun("ok", None, {}, "0.1.0"))
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    monkeypatch.setattr(ab, "_resident", lambda *a, **k: final)
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all([tiny]), 0.03, 20.0), device="cpu")
    lines = report.render().splitlines()
    assert report.exit_code == int(fails)
    if fails:
        finding = next(line for line in lines if line.startswith("REGRESSION"))
        assert finding.startswith("REGRESSION tiny-ab step time: x1.060")
        assert finding.endswith("; confirmed: x1.080 on the first 3 worker pairs")
    else:
        assert not [line for line in lines if line.startswith(("REGRESSION", "INCONCLUSIVE"))]
        assert "NOTE tiny-ab step time: x1.080 after 3 worker pairs, not confirmed: x1.005 over 6" in "\n".join(lines)


def test_the_gate_confirms_what_would_fail(monkeypatch, tiny):
    """``moe-bench ab`` times each scenario with the extension and the confirmation on."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    seen = {}
    monkeypatch.setattr(ab, "compare_resident", lambda *a, **k: seen.update(k))
    plan = ABPlan("HEAD", "0" * 40, [], 0.03, 20.0)
    ab._resident({"baseline": Path("."), "candidate": Path(".")}, load_all([tiny])[0], plan, "cpu", None)
    assert seen["confirm"] is True and seen["extension_s"] == 20.0


def test_the_report_says_where_the_time_limit_cut_the_confirmation(tmp_path, tiny, monkeypatch):
    """A confirmation the gate's time limit held to one of its three fresh pairs, and an extension it
    refused: the findings say so."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    first, final = comparison("tiny-ab", 0.08), comparison("tiny-ab", 0.06)
    final.pairs, final.stopped_by, final.unconfirmed = first.pairs + final.pairs[:1], "confirmation", first.estimate
    final.estimate = paired.pooled([p.log_ratios for p in final.pairs])
    final.verdict = paired.verdict(final.estimate, 0.03)
    monkeypatch.setattr(ab, "run_side", lambda root, scenario, out, device: SideRun("ok", None, {}, "0.1.0"))
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    monkeypatch.setattr(ab, "_resident", lambda *a, **k: final)
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all([tiny]), 0.03, 20.0), device="cpu")
    finding = next(line for line in report.render().splitlines() if line.startswith("REGRESSION"))
    assert finding.endswith(
        "; confirmed: x1.080 on the first 3 worker pairs (1 of 3 fresh pairs: the gate's time limit)"
    )
    final.pairs, final.estimate, final.extension_refused = first.pairs, first.estimate, True
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all([tiny]), 0.03, 20.0), device="cpu")
    finding = next(line for line in report.render().splitlines() if line.startswith("REGRESSION"))
    assert finding.endswith(
        "; not extended: the gate's time limit had no room; not confirmed: the gate's time limit left no room "
        "for fresh pairs"
    )
    wide = comparison("tiny-ab", 0.0, spread=0.04)
    wide.stopped_by = "deadline"
    monkeypatch.setattr(ab, "_resident", lambda *a, **k: wide)
    report = ab.run_ab(ABPlan("HEAD", "0" * 40, load_all([tiny]), 0.03, 20.0), device="cpu")
    note = next(line for line in report.render().splitlines() if line.startswith("NOTE"))
    assert "(12 s, its budget; the gate's time limit left no room to extend it)" in note


def test_the_time_limit_is_shared_out_between_the_scenarios_that_time_blocks(tmp_path, monkeypatch):
    """A plan-mode scenario runs first; each execute scenario is told to the limit as it starts, and gets it."""
    from bench.ab import gate as ab
    from bench.run.suites import load_all

    files = []
    for name, mode in (("tiny-a", "execute"), ("tiny-plan", "plan"), ("tiny-b", "execute")):
        files.append(tmp_path / f"{name}.yaml")
        cluster = "cluster: {name: one-node, gpus: 1, device: b300}\n" if mode == "plan" else ""
        files[-1].write_text(TINY_AB.replace("mode: execute", f"mode: {mode}") + cluster)
    order, limits = [], []

    def resident(sides, scenario, plan, device, deadline):
        limits.append((scenario.name, deadline.scenarios_after, deadline.limit_s))
        return comparison(scenario.name, 0.0)

    def side(root, scenario, out, device):
        order.append(scenario.name)
        return SideRun("ok", None, {}, "0.1.0")

    monkeypatch.setattr(ab, "run_side", side)
    monkeypatch.setattr(ab, "worktree", lambda root, commit: contextlib.nullcontext(tmp_path))
    monkeypatch.setattr(ab, "_resident", resident)
    plan = ABPlan("HEAD", "0" * 40, load_all(files), 0.03, 20.0, deadline_s=570.0)
    ab.run_ab(plan, device="cpu")
    assert order == ["tiny-plan", "tiny-plan", "tiny-a", "tiny-a", "tiny-b", "tiny-b"]
    assert limits == [("tiny-a", 1, 570.0), ("tiny-b", 0, 570.0)]
