"""The A/B gate's measured power on this machine, per scenario: false alarms of identical code, and
detection of planted slowdowns and planted extra work.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from bench.ab.deadline import SuiteDeadline
from bench.ab.gate import run_ab
from bench.ab.plan import ABPlan
from bench.ab.resident import compare_resident, fresh_pair
from bench.gate.formatting import parse_tolerance
from bench.gate.paired import fails, suite_rate
from bench.logs import console_logging
from bench.results import REPO_ROOT
from bench.run.suites import suite_files
from bench.scenario import load_scenario
from bench.termination import sigterm_as_interrupt

logger = logging.getLogger(__name__)

SLOWDOWNS = (0.05, 0.10)

_SLOW_STEP = """

# --- planted by bench/validate/gate_power.py: a compute slowdown of {fraction} of every step ---
import time as _planted_time

_planted_step = ParallelTrainer.step


def _planted_slow_step(self, *args, **kwargs):
    start = _planted_time.perf_counter()
    out = _planted_step(self, *args, **kwargs)
    end = _planted_time.perf_counter() + {fraction} * (_planted_time.perf_counter() - start)
    while _planted_time.perf_counter() < end:  # spin: compute time, not a sleep
        continue
    return out


ParallelTrainer.step = _planted_slow_step
"""

_LAYER_FORWARD = "        route = self.router(x_TD)\n"
"""The line of ``MoELayer.forward`` after which the planted work goes."""
WORK_PLANTS = {
    "extra all_reduce": (
        "        if torch.distributed.is_initialized():\n"
        "            torch.distributed.all_reduce(x_TD.detach().clone())  # planted\n"
    ),
    "extra copy": "        x_TD = x_TD.clone()  # planted\n",
    "extra host sync": "        route.counts_E.sum().item()  # planted\n",
}
EXPECTED_COUNTER = {
    "extra all_reduce": "work_collective_calls",
    "extra copy": "work_allocated_bytes",
    "extra host sync": "work_host_syncs",
}
"""The counter each planted change must move (others may move too: a copy is also an op)."""


@contextlib.contextmanager
def candidate_copy(patch: Mapping[str, tuple[str | None, str]] | None) -> Iterator[Path]:
    """A clone of HEAD with ``patch`` applied: {path: (anchor, text inserted after it; appended for None)}."""
    with tempfile.TemporaryDirectory(prefix="moe-power-") as tmp:
        clone = Path(tmp) / "candidate"
        subprocess.run(
            ["git", "clone", "--quiet", "--no-hardlinks", str(REPO_ROOT), str(clone)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        for relative, (anchor, text) in (patch or {}).items():
            path = clone / relative
            source = path.read_text()
            if anchor is None:
                source += text
            else:
                if source.count(anchor) != 1:
                    raise RuntimeError(f"{relative}: the plant's anchor is not unique: {anchor.strip()!r}")
                source = source.replace(anchor, anchor + text)
            path.write_text(source)
        yield clone


def slowdown_patch(fraction: float) -> dict[str, tuple[str | None, str]]:
    return {"moe_engine/parallel/trainer.py": (None, _SLOW_STEP.format(fraction=fraction))}


def timing_run(
    scenario, roots: tuple[Path, Path], fraction: float, tolerance: float, budget_s: float, device: str
) -> dict:
    """One independent gate decision on ``scenario``: baseline and candidate trees (``roots``), the
    candidate slowed by ``fraction`` (0: identical code)."""
    timeout = scenario.run.timeout_s + 120
    started = time.monotonic()
    result = compare_resident(
        functools.partial(fresh_pair, roots[0], roots[1], scenario, device, timeout),
        tolerance,
        budget_s,
        extension_s=budget_s,
        confirm=True,
    )
    assert result.estimate is not None  # compare_resident runs paired.MIN_WORKER_PAIRS pairs at least
    return {
        "scenario": scenario.name,
        "planted": fraction,
        "verdict": result.verdict,
        "fails": fails(result.estimate, tolerance),
        "estimate": result.estimate.slowdown,
        "interval": list(result.estimate.interval),
        "worker_pairs": len(result.pairs),
        "block_pairs": result.block_pairs,
        "pair_sd": result.estimate.between_sd,
        "block_sd": result.estimate.within_sd,
        "steps_per_block": result.steps_per_block,
        "seconds": time.monotonic() - started,
        "stopped_by": result.stopped_by,
        "unconfirmed_estimate": None if result.unconfirmed is None else result.unconfirmed.slowdown,
        "unconfirmed_worker_pairs": None if result.unconfirmed is None else result.unconfirmed.worker_pairs,
        "tolerance": tolerance,
        "budget_s": budget_s,
        "machine": machine(),
    }


def suite_run(
    scenarios: list,
    trees: dict[float, Path],
    planted: tuple[str, float] | None,
    tolerance: float,
    warn_above: float | None,
    budget_s: float,
    device: str,
    deadline_s: float | None = None,
) -> dict:
    """One whole gate of ``scenarios`` as CI runs it, against HEAD: the candidate of scenario ``planted[0]``
    is the clone slowed by ``planted[1]`` (``trees[fraction]``), of every other the identical clone
    (``trees[0.0]``). The suite fails when any scenario's gate does."""

    commit = head_commit(trees[0.0])
    started = time.monotonic()
    # As one run_ab over the suite runs it: plan-mode scenarios first, one time limit shared by all.
    ordered = sorted(scenarios, key=lambda s: s.mode == "execute")
    deadline = (
        SuiteDeadline(deadline_s, [s.name for s in ordered if s.mode == "execute"]) if deadline_s is not None else None
    )
    rows = []
    for scenario in ordered:
        fraction = planted[1] if planted is not None and planted[0] == scenario.name else 0.0
        plan = ABPlan("HEAD", commit, [scenario], tolerance, budget_s, warn_above=warn_above, deadline_s=deadline_s)
        scenario_started = time.monotonic()
        report = run_ab(plan, device=device, root=trees[fraction], deadline=deadline)
        r = report.resident[0] if report.resident else None
        estimate = r.estimate if r is not None else None
        rows.append(
            {
                "scenario": scenario.name,
                "planted": fraction,
                "fails": report.exit_code != 0,
                "failures": [line for line in report.render().splitlines() if line.startswith(_FAILING)],
                "warned": r is not None and report.warned(r),
                "verdict": r.verdict if r is not None else None,
                "estimate": estimate.slowdown if estimate is not None else None,
                "se": estimate.se if estimate is not None else None,
                "worker_pairs": len(r.pairs) if r is not None else 0,
                "stopped_by": r.stopped_by if r is not None else None,
                "unconfirmed_estimate": None if r is None or r.unconfirmed is None else r.unconfirmed.slowdown,
                "unconfirmed_worker_pairs": None if r is None or r.unconfirmed is None else r.unconfirmed.worker_pairs,
                "extension_refused": r is not None and r.extension_refused,
                "seconds": time.monotonic() - scenario_started,
            }
        )
    return {
        "kind": "suite",
        "planted": planted[1] if planted is not None else 0.0,
        "planted_scenario": planted[0] if planted is not None else None,
        "fails": any(row["fails"] for row in rows),
        "warned": any(row["warned"] for row in rows),
        "scenarios": rows,
        "seconds": time.monotonic() - started,
        "tolerance": tolerance,
        "warn_above": warn_above,
        "budget_s": budget_s,
        "deadline_s": deadline_s,
        "commit": commit,
        "machine": machine(),
    }


def head_commit(tree: Path) -> str:
    """The commit a clone's HEAD is at: the baseline of every suite run."""
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


_FAILING = ("REGRESSION", "INCONCLUSIVE", "NOT-OK")
"""The report lines that fail a gate (``bench.ab.gate.ABReport.render``)."""


def machine() -> str:
    """The CPU model and core count the record was measured on."""

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores"


def work_run(scenario_file: Path, plant: str, tolerance: str, budget_s: float, device: str) -> dict:
    """The whole ``moe-bench ab`` gate, HEAD against a candidate with ``plant``."""
    patch = {"moe_engine/moe/layer.py": (_LAYER_FORWARD, WORK_PLANTS[plant])}
    with candidate_copy(patch) as clone:
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.cli",
                "ab",
                str(Path(scenario_file).resolve()),
                "--baseline-ref",
                "HEAD",
                "--tolerance",
                tolerance,
                "--budget",
                str(budget_s),
                "--device",
                device,
            ],
            cwd=clone,
            env={**_env(), "PYTHONPATH": str(clone)},
            capture_output=True,
            text=True,
            timeout=1800,
        )
    work = [line for line in done.stdout.splitlines() if "work increased" in line or "work decreased" in line]
    expected = [line for line in work if line.startswith("REGRESSION") and f" {EXPECTED_COUNTER[plant]}:" in line]
    return {
        "plant": plant,
        "exit_code": done.returncode,
        "detected": done.returncode == 1 and bool(expected),
        "findings": expected + [line for line in work if line not in expected],
        "seconds": time.monotonic() - started,
    }


def _env() -> dict[str, str]:
    return dict(os.environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validate.gate_power", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", default=[], help="a scenario file (repeatable)")
    parser.add_argument("--suite", default="ci", help="the execute scenarios of this suite, without --scenario")
    parser.add_argument("--work-scenario", default=str(REPO_ROOT / "scenarios/smoke/e8-ep2-nosync-bf16.yaml"))
    parser.add_argument("--aa-runs", type=int, default=20)
    parser.add_argument("--runs", type=int, default=10, help="runs per planted slowdown")
    parser.add_argument("--slowdowns", default="5%,10%", help="planted slowdowns (comma-separated)")
    parser.add_argument("--work-runs", type=int, default=0, help="runs per planted work change")
    parser.add_argument("--budget", type=float, default=45.0, help="the gate's seconds per scenario (CI: 45)")
    parser.add_argument("--tolerance", default="4.5%", help="the gate's tolerance (CI: 4.5%%)")
    parser.add_argument(
        "--deadline",
        type=float,
        help="the whole gate's time limit, seconds (CI: 570; with --suite-runs; default: none)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--records", help="append every run's record here (JSON lines); runs already there are skipped")
    parser.add_argument(
        "--suite-runs",
        action="store_true",
        help="each run is the whole suite's gate (A/A, or a planted slowdown in one scenario at a time)",
    )
    parser.add_argument(
        "--replay",
        metavar="RECORDS",
        help="run nothing: draw the recorded runs' worker pairs afresh at --tolerance (the confirmed rule)",
    )
    parser.add_argument("--warn-above", default="3%", help="the gate's warning threshold (CI: 3%%; with --suite-runs)")
    parser.add_argument("--json", help="also write this invocation's records here, as one JSON document")
    args = parser.parse_args(argv)
    if args.deadline is not None and not args.deadline >= args.budget:
        parser.error(f"--deadline {args.deadline:g} s must be at least the --budget ({args.budget:g} s)")
    tolerance = parse_tolerance(args.tolerance)
    slowdowns = [parse_tolerance(x) for x in args.slowdowns.split(",") if x.strip()]
    if args.replay:
        replayed = load_records(Path(args.replay))
        timing = [r for r in replayed if r.get("kind") != "suite"] + suite_scenario_runs(replayed)
        sys.stdout.write(render_replay(replay(timing, tolerance, (0.0, *slowdowns)), tolerance) + "\n")
        return 0
    files = args.scenario or [str(f) for f in suite_files(args.suite, torch_device(args.device))]
    loaded = [load_scenario(f) for f in files]
    scenarios = [s for s in loaded if s.mode == "execute"]
    records = load_records(Path(args.records)) if args.records else []
    if args.suite_runs:
        warn_above = parse_tolerance(args.warn_above) if args.warn_above else None
        return suite_main(args, loaded, records, tolerance, warn_above, slowdowns)
    records = [r for r in records if r.get("kind") != "suite"]
    missing = {
        (scenario.name, fraction): max(
            0,
            (args.aa_runs if fraction == 0 else args.runs)
            - _done(records, scenario.name, fraction, tolerance, args.budget),
        )
        for fraction in (0.0, *slowdowns)
        for scenario in scenarios
    }
    # Round-robin over scenarios and plants: a measurement cut short still has some of each.
    todo = [
        (scenario, fraction)
        for i in range(max(missing.values(), default=0))
        for fraction in (0.0, *slowdowns)
        for scenario in scenarios
        if i < missing[scenario.name, fraction]
    ]
    with contextlib.ExitStack() as stack:
        trees = {
            fraction: stack.enter_context(candidate_copy(slowdown_patch(fraction) if fraction else None))
            for fraction in {0.0, *slowdowns}
        }
        for index, (scenario, fraction) in enumerate(todo, 1):
            record = timing_run(scenario, (trees[0.0], trees[fraction]), fraction, tolerance, args.budget, args.device)
            records.append(record)
            if args.records:
                with Path(args.records).open("a") as out:
                    out.write(json.dumps(record) + "\n")
            logger.info(
                f"[{index}/{len(todo)}] {scenario.name} planted +{fraction:.0%}: {record['verdict']} "
                f"x{1 + record['estimate']:.3f} ({record['worker_pairs']} worker pairs, {record['seconds']:.0f} s)"
            )
    work_records = []
    for plant in WORK_PLANTS:
        for run in range(args.work_runs):
            record = work_run(Path(args.work_scenario), plant, args.tolerance, args.budget, args.device)
            work_records.append(record)
            logger.info(
                f"work {plant} [{run + 1}/{args.work_runs}]: detected={record['detected']} "
                f"({record['seconds']:.0f} s) {record['findings'][:1]}"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"settings": vars(args), "records": records, "work": work_records}, indent=1)
        )
    timing = [r for r in records if r["tolerance"] == tolerance and r["budget_s"] == args.budget]
    sys.stdout.write(render(timing, work_records) + "\n")
    return 0


def suite_main(args, scenarios: list, records: list[dict], tolerance: float, warn_above, slowdowns) -> int:
    """``--suite-runs``: the missing whole-suite runs, A/A and each (execute scenario, slowdown), round-robin;
    ``scenarios``: every scenario of the suite (a plan scenario's gate is its two full runs)."""
    settings = dict(tolerance=tolerance, warn_above=warn_above, budget_s=args.budget, deadline_s=args.deadline)
    records = [r for r in records if r.get("kind") == "suite" and all(r.get(k) == v for k, v in settings.items())]
    cells: list[tuple[str, float] | None] = [None] + [
        (s.name, f) for f in slowdowns for s in scenarios if s.mode == "execute"
    ]

    def wanted(cell) -> int:
        done = sum(
            r["planted_scenario"] == (cell[0] if cell else None) and r["planted"] == (cell[1] if cell else 0.0)
            for r in records
        )
        return max(0, (args.aa_runs if cell is None else args.runs) - done)

    missing = {cell: wanted(cell) for cell in cells}
    # Round-robin, A/A first in each round: a measurement cut short has the false-alarm rate first.
    todo = [cell for i in range(max(missing.values(), default=0)) for cell in cells if i < missing[cell]]
    with contextlib.ExitStack() as stack:
        trees = {
            fraction: stack.enter_context(candidate_copy(slowdown_patch(fraction) if fraction else None))
            for fraction in {0.0, *slowdowns}
        }
        for index, cell in enumerate(todo, 1):
            record = suite_run(scenarios, trees, cell, tolerance, warn_above, args.budget, args.device, args.deadline)
            records.append(record)
            if args.records:
                with Path(args.records).open("a") as out:
                    out.write(json.dumps(record) + "\n")
            label = "A/A" if cell is None else f"{cell[0]} +{cell[1]:.0%}"
            failed_in = [row["scenario"] for row in record["scenarios"] if row["fails"]]
            logger.info(
                f"[{index}/{len(todo)}] suite, {label}: {'FAIL (' + ', '.join(failed_in) + ')' if failed_in else 'PASS'}"
                f"{', warned' if record['warned'] else ''} ({record['seconds']:.0f} s)"
            )
    sys.stdout.write(render_suite(records) + "\n")
    return 0


def replay(
    records: list[dict],
    tolerance: float,
    slowdowns: tuple[float, ...] = (0.0, 0.05, 0.10),
    draws: int = 200,
    seed: int = 0,
) -> dict[tuple[str, float], float]:
    """How often the confirmed rule at ``tolerance`` would fail each scenario at each slowdown, by drawing
    each recorded run's worker pairs afresh: as many pair centres as it ran, normal about the slowdown
    with the run's own pair spread (``pair_sd``), then as many again where the first mean exceeds the
    tolerance (the confirmation). Offline arithmetic over the records' variance components: what an
    operating point would have done on the machine states the records saw (the stopping rule's pair
    counts as they were)."""

    rng, bound = random.Random(seed), math.log1p(tolerance)

    def fails_once(delta: float, pairs: int, sd: float) -> bool:
        centres = [rng.gauss(delta, sd) for _ in range(pairs)]
        if statistics.fmean(centres) <= bound:
            return False
        centres += [rng.gauss(delta, sd) for _ in range(pairs)]
        return statistics.fmean(centres) > bound

    rates = {}
    for scenario in sorted({r["scenario"] for r in records}):
        runs = [r for r in records if r["scenario"] == scenario and r.get("pair_sd")]
        for slowdown in slowdowns:
            delta = math.log1p(slowdown)
            hits = sum(fails_once(delta, r["worker_pairs"], r["pair_sd"]) for r in runs for _ in range(draws))
            rates[scenario, slowdown] = hits / (draws * len(runs))
    return rates


def suite_scenario_runs(records: list[dict]) -> list[dict]:
    """Each whole-suite run's scenario gates as the runs ``replay`` draws afresh: its worker pairs, and
    their spread from the estimate's standard error (``se`` = the pair centres' spread over the square
    root of the pairs, ``bench.gate.paired.PooledEstimate.se``); a gate with fewer than two pairs (a
    plan scenario's) has none."""
    return [
        {
            "scenario": row["scenario"],
            "planted": row["planted"],
            "worker_pairs": row["worker_pairs"],
            "pair_sd": row["se"] * math.sqrt(row["worker_pairs"]),
        }
        for record in records
        if record.get("kind") == "suite"
        for row in record["scenarios"]
        if row.get("se") and row.get("worker_pairs", 0) >= 2
    ]


def render_replay(rates: dict[tuple[str, float], float], tolerance: float) -> str:
    """The replayed rates per scenario, and the suite's false-alarm rate over the scenarios."""

    slowdowns = sorted({s for _, s in rates})
    rows = [
        f"| scenario (tolerance {tolerance:.1%}) | "
        + " | ".join("A/A failed" if s == 0 else f"+{s:.0%} caught" for s in slowdowns)
        + " |",
        "| --- |" + " --- |" * len(slowdowns),
    ]
    for scenario in sorted({name for name, _ in rates}):
        rows.append(f"| {scenario} | " + " | ".join(f"{rates[scenario, s]:.1%}" for s in slowdowns) + " |")
    aa = [rate for (_, s), rate in rates.items() if s == 0]
    return "\n".join(rows) + (f"\n\nsuite false alarms: {suite_rate(aa):.1%}" if aa else "")


GATE_LIMIT_S = 600.0
"""The whole gate's target time on the slowest CI machine (docs/gates-and-releases.md#the-operating-point)."""


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a binomial proportion.

    Its ends are the ``p`` at which ``P(X >= successes) = alpha / 2`` and ``P(X <= successes) = alpha / 2``
    (0 and 1 at the edges), found by bisection on the binomial tail, summed exactly with ``math.comb``:
    the same numbers as the beta quantiles ``scipy.stats.beta.ppf`` would give, without a dependency
    the project does not otherwise need, for the few dozen runs a measurement holds. Exact rather than
    Wilson's, because with counts of 0 or 1 in 20 the normal-based intervals undercover.
    """
    if not 0 <= successes <= trials or trials < 1:
        raise ValueError(f"{successes} of {trials}: not a binomial count")
    alpha = 1 - confidence

    def at_most(k: int, p: float) -> float:
        return sum(math.comb(trials, i) * p**i * (1 - p) ** (trials - i) for i in range(k + 1))

    def solve(tail, target: float) -> float:
        """The p where the increasing function ``tail(p)`` reaches ``target``."""
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if tail(middle) < target else (low, middle)
        return (low + high) / 2

    lower = 0.0 if successes == 0 else solve(lambda p: 1 - at_most(successes - 1, p), alpha / 2)
    upper = 1.0 if successes == trials else solve(lambda p: 1 - at_most(successes, p), 1 - alpha / 2)
    return lower, upper


def _rate(count: int, runs: int) -> str:
    low, high = clopper_pearson(count, runs)
    return f"{count} of {runs} ({count / runs:.0%}; 95% interval {low:.1%} to {high:.1%})"


def render_suite(records: list[dict]) -> str:
    """The suite-level table: the false-alarm rate of identical code first, then each planted slowdown
    per scenario; how often each scenario failed or warned, and the whole gate's time."""
    rows = [
        "| planted | runs | suite failed (95% interval) | warned, passed | failed in "
        "| gate seconds: median, max (runs over 10 min) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    cells = sorted(
        {(r["planted_scenario"], r["planted"]) for r in records}, key=lambda c: (c[0] is not None, c[1], c[0] or "")
    )
    for scenario, fraction in cells:
        runs = [r for r in records if r["planted_scenario"] == scenario and r["planted"] == fraction]
        failed = sum(r["fails"] for r in runs)
        warned = sum(r["warned"] and not r["fails"] for r in runs)
        culprits: dict[str, int] = {}
        for r in runs:
            for row in r["scenarios"]:
                if row["fails"]:
                    culprits[row["scenario"]] = culprits.get(row["scenario"], 0) + 1
        label = "none (A/A)" if scenario is None else f"+{fraction:.0%} in {scenario}"
        seconds = [r["seconds"] for r in runs]
        rows.append(
            f"| {label} | {len(runs)} | {_rate(failed, len(runs))} | {warned} | "
            f"{', '.join(f'{name} {n}' for name, n in sorted(culprits.items())) or '-'} | "
            f"{statistics.median(seconds):.0f}, {max(seconds):.0f} ({sum(t > GATE_LIMIT_S for t in seconds)}) |"
        )
    machines = sorted({r["machine"] for r in records if "machine" in r})
    return "\n".join(rows) + ("\n\nmeasured on: " + "; ".join(machines) if machines else "")


def torch_device(name: str):
    return torch.device(name)


def load_records(path: Path) -> list[dict]:
    """The records of earlier runs (none when the file does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _done(records: list[dict], scenario: str, fraction: float, tolerance: float, budget_s: float) -> int:
    return sum(
        r["scenario"] == scenario
        and r["planted"] == fraction
        and r["tolerance"] == tolerance
        and r["budget_s"] == budget_s
        for r in records
    )


def failed(record: dict) -> bool:
    """Whether the gate failed this run (``bench.gate.paired.fails``; records from before the field: the
    same rule on their estimate)."""
    return record["fails"] if "fails" in record else record["estimate"] > record["tolerance"]


def confirmation(record: dict) -> str | None:
    """What the confirmation did in this run: "confirmed" (the failure stood), "withdrawn" (the fresh pairs
    brought the estimate within the tolerance), or None (no confirmation ran: nothing failed first, or
    the record is from before the gate confirmed, when its first reading was its verdict)."""
    if record.get("unconfirmed_estimate") is None:
        return None
    return "confirmed" if record["fails"] else "withdrawn"


def render(timing: list[dict], work: list[dict]) -> str:
    """Per scenario and planted change: how often the gate failed (regressed, or inconclusive beyond the
    tolerance), how often it passed an inconclusive run, what the confirmation did, and its time."""
    rows = [
        "| scenario | planted | runs | gate failed | of which regressed / inconclusive | inconclusive, passed "
        "| confirmations: failure stood / withdrawn (runs with them) | estimate (min to max) | gate seconds (median) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scenario in sorted({r["scenario"] for r in timing}):
        for fraction in sorted({r["planted"] for r in timing}):
            runs = [r for r in timing if r["scenario"] == scenario and r["planted"] == fraction]
            if not runs:
                continue
            regressed = sum(r["verdict"] == "regressed" for r in runs)
            inconclusive = [r for r in runs if r["verdict"] == "inconclusive"]
            beyond = sum(failed(r) for r in inconclusive)
            fail_count = sum(failed(r) for r in runs)
            label = "none (A/A)" if fraction == 0 else f"+{fraction:.0%}"
            low, high = min(r["estimate"] for r in runs), max(r["estimate"] for r in runs)
            rows.append(
                f"| {scenario} | {label} | {len(runs)} | {fail_count} ({fail_count / len(runs):.0%}) | {regressed} / "
                f"{beyond} | {len(inconclusive) - beyond} | {_confirmations(runs)} | x{1 + low:.3f} to x{1 + high:.3f} | "
                f"{statistics.median(r['seconds'] for r in runs):.0f} |"
            )
    for plant in WORK_PLANTS:
        runs = [r for r in work if r["plant"] == plant]
        if runs:
            found = sum(r["detected"] for r in runs)
            rows.append(
                f"| work counters | {plant} | {len(runs)} | {found} of {len(runs)} detected | | | | | {statistics.median(r['seconds'] for r in runs):.0f} |"
            )
    machines = sorted({r["machine"] for r in timing if "machine" in r})
    return "\n".join(rows) + ("\n\nmeasured on: " + "; ".join(machines) if machines else "")


def _confirmations(runs: list[dict]) -> str:
    done = [confirmation(r) for r in runs]
    with_rule = sum("unconfirmed_estimate" in r for r in runs)
    return f"{done.count('confirmed')} / {done.count('withdrawn')} ({with_rule})"


if __name__ == "__main__":
    console_logging()
    # One line a run is this tool's; the gate's own lines of each run (bench.ab) would bury them.
    logging.getLogger("bench.ab").setLevel(logging.WARNING)
    # Stopped with SIGTERM or Ctrl-C, it still removes its clones and stops its workers; the records
    # written so far stay, and the next invocation resumes from them.
    try:
        with sigterm_as_interrupt():
            sys.exit(main())
    except KeyboardInterrupt:
        logger.error("gate_power: stopped; the runs already recorded are kept")
        sys.exit(130)
