"""A/B gate: a baseline git ref against this checkout, run alternately in one job, gated on paired ratios.

The baseline is checked out into a temporary ``git worktree`` and runs with ``PYTHONPATH`` pointing
at it (same virtual environment, no reinstall); the candidate is this checkout, uncommitted changes
included. Both sides run the candidate's scenario files, so the workload is the same and only the
engine (and the runner) differ. For each scenario the sides take turns, A B A B ..., one
``moe-bench run`` each, so that drift of a shared machine (other jobs, clocks, thermals) hits both
sides of a pair alike.

Paired gate
-----------
Per pair i and metric: ``r_i = cand_median_i / base_median_i`` (``bench.gate.compare`` conventions for
zero and negative baselines). The gate reads ``ratio = median_i r_i`` and the noise
``= IQR of the r_i`` (inclusive quartiles), and classifies like ``bench.gate.compare``: a metric with a
direction regressed when ``|ratio - 1|`` exceeds both the tolerance and the noise in the worse
direction. A metric with no spread in any run (one sample per run: peak memory, optimizer state
bytes; ``"spread": null``) is an exact value, as in ``bench.gate.compare``: its noise is 0, not the
IQR of its pair ratios, so a median ratio beyond the tolerance in the worse direction regresses and
equal values are unchanged. A scenario that is not ok in any candidate run fails the gate; one that
fails only in the baseline (e.g. a scenario newer than the baseline's code) is reported and not
compared. A side whose result file cannot be read back counts as a failed run, naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from bench.gate.compare import classify, format_noise, format_number, format_percent, format_ratio, paired_ratio
from bench.release.git import try_git
from bench.release.record import RELEASES_PATH, ReleaseError, latest_release
from bench.results import REPO_ROOT, ResultFileError, load_results
from bench.scenario import Scenario

SIDES = ("baseline", "candidate")
MIN_PAIRS = 3
_MARGIN_S = 120.0  # start-up of a side (imports, CPU peak measurement) on top of the scenario's timeout


class ABError(ValueError):
    """Bad input for the A/B gate (one line; nothing was run)."""


# --------------------------------------------------------------------------------------------
# The paired gate (pure arithmetic)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SideRun:
    """One ``moe-bench run`` of one scenario on one side."""

    status: str
    error: str | None
    metrics: dict[str, dict[str, Any]]
    version: str | None = None
    mode: str = "execute"
    """The scenario's mode: a plan's figures are arithmetic, so they are compared but never gated."""


@dataclass(frozen=True)
class PairedMetric:
    scenario: str
    metric: str
    unit: str
    better: str | None
    base: float
    """Median of the baseline runs' medians."""
    cand: float
    ratios: tuple[float, ...]
    """cand / base of each pair, in run order."""
    ratio: float
    """Median of ``ratios``."""
    noise: float
    """Interquartile range of ``ratios``; 0 when ``exact``."""
    verdict: str
    """regressed, improved, unchanged or info (``bench.gate.compare.classify``)."""
    exact: bool = False
    """No run has a spread for this metric (one sample each): compared as an exact value."""


@dataclass
class ABReport:
    baseline: str
    candidate: str
    tolerance: float
    pairs: int
    metrics: list[PairedMetric] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.failures or any(m.verdict == "regressed" for m in self.metrics) else 0

    def render(self) -> str:
        counts = {v: sum(m.verdict == v for m in self.metrics) for v in ("regressed", "improved", "unchanged")}
        scenarios = len({m.scenario for m in self.metrics})
        header = (
            f"{'FAIL' if self.exit_code else 'PASS'}: A/B {self.baseline} -> {self.candidate}, {self.pairs} pairs, "
            f"{scenarios} scenario(s) compared: {counts['regressed']} regressed, {counts['improved']} improved, "
            f"{counts['unchanged']} unchanged; {len(self.failures)} not ok (tolerance {format_percent(self.tolerance)})"
        )
        columns = ("scenario", "metric", "unit", "base", "cand", "ratio", "pair ratios", "noise", "verdict")
        rows = [
            (m.scenario, m.metric, m.unit, format_number(m.base), format_number(m.cand), format_ratio(m.ratio),
             " ".join(format_ratio(r) for r in m.ratios), "exact" if m.exact else format_percent(m.noise, 1),
             m.verdict)
            for m in self.metrics
        ]
        widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *rows]]
        findings = [
            f"REGRESSION {m.scenario} {m.metric}: x{format_ratio(m.ratio)} "
            f"(pairs {', '.join(format_ratio(r) for r in m.ratios)}; "
            f"tolerance {format_percent(self.tolerance)}, {format_noise(m.noise, m.exact)})"
            for m in self.metrics if m.verdict == "regressed"
        ]
        table = lines if rows else ["(no metrics compared)"]
        return "\n".join([header, *table, *findings, *self.failures, *self.notes]) + "\n"


def paired_metric(scenario: str, name: str, pairs: list[tuple[dict, dict]], tolerance: float) -> PairedMetric:
    """Gate one metric over its (baseline entry, candidate entry) pairs (``bench.results.metric`` entries)."""
    ratios = tuple(paired_ratio(b["median"], c["median"]) for b, c in pairs)
    ratio = statistics.median(ratios)
    exact = all(b["spread"] is None and c["spread"] is None for b, c in pairs)
    noise = 0.0
    if not exact and len(set(ratios)) > 1:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        noise = q3 - q1
        if math.isnan(noise):  # inf - inf: unbounded
            noise = math.inf
    better = pairs[-1][1]["better"]
    _, verdict = classify(ratio, noise, better, tolerance)
    return PairedMetric(
        scenario=scenario, metric=name, unit=pairs[-1][1]["unit"], better=better,
        base=statistics.median(b["median"] for b, _ in pairs), cand=statistics.median(c["median"] for _, c in pairs),
        ratios=ratios, ratio=ratio, noise=noise, verdict=verdict, exact=exact,
    )


def paired_gate(runs: dict[str, list[tuple[SideRun, SideRun]]], tolerance: float, baseline: str = "baseline",
                candidate: str = "candidate") -> ABReport:
    """The report over every scenario's (baseline, candidate) runs, pair by pair."""
    pairs_count = max((len(p) for p in runs.values()), default=0)
    report = ABReport(baseline, candidate, tolerance, pairs_count)
    for scenario, pairs in runs.items():
        if all(b.status == c.status == "skipped" for b, c in pairs):
            report.notes.append(f"NOTE {scenario}: skipped on both sides ({pairs[-1][1].error})")
            continue
        bad_cand = next((c for _, c in pairs if c.status != "ok"), None)
        if bad_cand is not None:
            report.failures.append(f"NOT-OK {scenario}: candidate {bad_cand.status} ({bad_cand.error})")
            continue
        bad_base = next((b for b, _ in pairs if b.status != "ok"), None)
        if bad_base is not None:
            report.notes.append(f"NOTE {scenario}: baseline {bad_base.status} ({bad_base.error}); not compared")
            continue
        shared = set.intersection(*(set(b.metrics) & set(c.metrics) for b, c in pairs))
        estimate = pairs[-1][1].mode == "plan"
        for name in sorted(shared):
            entries = [(b.metrics[name], c.metrics[name]) for b, c in pairs]
            if entries[-1][1]["better"] is None:
                continue  # reported by moe-bench run, never gated
            paired = paired_metric(scenario, name, entries, tolerance)
            if estimate:
                # A plan measures nothing: a changed figure is a changed estimate (see the plan's
                # docstring), reported for review, not a regression of the engine.
                if paired.ratio != 1:
                    report.notes.append(
                        f"NOTE {scenario} {name}: plan estimate changed x{format_ratio(paired.ratio)} (not gated)"
                    )
                paired = dataclasses.replace(paired, verdict="info")
            report.metrics.append(paired)
        only = set().union(*(set(b.metrics) ^ set(c.metrics) for b, c in pairs))
        for name in sorted(only):
            report.notes.append(f"NOTE {scenario} {name}: metric on one side only")
    return report


# --------------------------------------------------------------------------------------------
# Running the two sides
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ABPlan:
    """A checked A/B job: nothing has run yet."""

    label: str
    """How the baseline is named in the report (``release 0.1.0``, or the ref as given)."""
    commit: str
    scenarios: list[Scenario]
    pairs: int
    tolerance: float


def plan_ab(ref: str | None, scenarios: list[Scenario], pairs: int, tolerance: float, root: Path = REPO_ROOT,
            releases_path: Path = RELEASES_PATH) -> ABPlan:
    """Check everything before any work; raises ABError with a one-line reason."""
    if pairs < MIN_PAIRS:
        raise ABError(f"--pairs {pairs}: at least {MIN_PAIRS} pairs are needed to measure the noise")
    if not scenarios:
        raise ABError("no scenarios to run")
    if try_git(root, "rev-parse", "--is-inside-work-tree") is None:
        raise ABError(f"{root} is not a git checkout: the A/B gate checks the baseline out of the repository history")
    if ref is None:
        try:
            release = latest_release(releases_path)
        except ReleaseError as err:
            raise ABError(str(err)) from None
        if release is None:
            raise ABError(f"no release recorded in {releases_path.name}: pass --baseline-ref REF")
        commit = try_git(root, "rev-parse", "--verify", "--quiet", f"{release.commit}^{{commit}}")
        if commit is None:
            raise ABError(f"release {release.version} ({release.commit[:12]}) is not in this clone: fetch its history "
                          "(git fetch --unshallow)")
        return ABPlan(f"release {release.version}", commit, scenarios, pairs, tolerance)
    commit = try_git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}") if not ref.startswith("-") else None
    if commit is None:
        raise ABError(f"--baseline-ref {ref}: no such commit, branch or tag in this repository")
    return ABPlan(ref, commit, scenarios, pairs, tolerance)


def run_ab(plan: ABPlan, device: str = "auto", keep: Path | None = None, root: Path = REPO_ROOT,
           log: Callable[[str], None] = print) -> ABReport:
    """Run the plan: per scenario, ``plan.pairs`` times baseline then candidate; return the gate's report."""
    runs: dict[str, list[tuple[SideRun, SideRun]]] = {}
    versions: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        work = keep if keep is not None else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-ab-")))
        base_root = stack.enter_context(worktree(root, plan.commit))
        sides = {"baseline": base_root, "candidate": Path(root)}
        total, done = len(plan.scenarios) * plan.pairs * 2, 0
        for scenario in plan.scenarios:
            runs[scenario.name] = []
            for pair in range(plan.pairs):
                results = {}
                for side in SIDES:
                    out = Path(work) / side / scenario.name / f"pair-{pair + 1}"
                    started = time.perf_counter()
                    results[side] = run_side(sides[side], scenario, out, device)
                    done += 1
                    if results[side].version:
                        versions[side] = results[side].version
                    log(f"ab [{done}/{total}] {scenario.name} pair {pair + 1}/{plan.pairs} {side}: "
                        f"{_summary(results[side])} ({time.perf_counter() - started:.1f} s)")
                runs[scenario.name].append((results["baseline"], results["candidate"]))
    baseline = f"{plan.label} ({plan.commit[:12]}{', ' + versions['baseline'] if 'baseline' in versions else ''})"
    return paired_gate(runs, plan.tolerance, baseline, versions.get("candidate", "this checkout"))


def run_side(root: Path, scenario: Scenario, out: Path, device: str) -> SideRun:
    """One ``moe-bench run`` of ``scenario`` with the code at ``root``; its result document, or why none."""
    command = [sys.executable, "-m", "bench.cli", "run", str(Path(scenario.file).resolve()), "--out", str(out),
               "--no-plots", "--device", device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    returncode, output = _run(command, root, env, scenario.run["timeout_s"] + _MARGIN_S)
    try:
        docs = load_results(out) if out.is_dir() else []
    except ResultFileError as err:  # the side wrote a file that cannot be read back
        return SideRun("failed", str(err), {})
    if len(docs) == 1:
        doc = docs[0]
        return SideRun(doc.status, doc.data.get("error"), doc.metrics, doc.version, doc.data.get("mode", "execute"))
    last = output.strip().splitlines()[-1:] or ["no output"]
    reason = "timed out" if returncode is None else f"moe-bench exited with code {returncode}: {last[0]}"
    return SideRun("failed", reason, {})


def _summary(run: SideRun) -> str:
    if run.status != "ok":
        return f"{run.status} ({run.error})"
    tput = run.metrics.get("tokens_per_s_per_gpu")
    return f"ok, {tput['median']:,.0f} tokens/s/GPU" if tput else "ok"


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run in a new session; on timeout or interrupt kill the whole session. (exit code or None, output)."""
    from bench.run.runner import kill_process_group

    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        kill_process_group(process)
        return None, process.stdout.read() if process.stdout else ""
    except BaseException:
        kill_process_group(process)
        raise


@contextlib.contextmanager
def worktree(root: Path, commit: str) -> Iterator[Path]:
    """A detached temporary worktree of ``commit``, removed afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="moe-ab-baseline-"))
    path = parent / "baseline"
    try:
        made = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit], cwd=root,
                              capture_output=True, text=True, timeout=300)
        if made.returncode != 0:
            raise ABError(f"git worktree add failed: {made.stderr.strip().splitlines()[-1:]}")
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=root, capture_output=True, timeout=120)
        shutil.rmtree(parent, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True, timeout=120)
