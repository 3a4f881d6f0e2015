"""The A/B gate's measured power on this machine: false alarms of identical code, and detection of
planted slowdowns and planted extra work.

    python -m bench.validate.gate_power [--scenario FILE] [--aa-runs 20] [--runs 10] [--budget S]
        [--tolerance 5%] [--work-scenario FILE] [--work-runs 3] [--json PATH]

Every planted change is applied to a candidate copy of this checkout's HEAD (a ``git clone`` in a
temporary folder, then a text patch), never by a flag in the engine; the baseline is the same HEAD.

- Timing: per run, fresh resident workers for both sides and the gate's paired blocks
  (``bench.gate.resident.compare_resident``), exactly as ``moe-bench ab`` times a scenario. A/A
  runs (no plant) give the false-positive rate; planted compute slowdowns of 5%, 10% and 20% (a
  busy loop after every training step for that fraction of the step's own time) give the detection
  rates.
- Work: per run, the whole ``moe-bench ab`` gate (one full run per side: the work counters) on a
  candidate with an extra all_reduce, an extra copy or an extra host sync in each MoE layer's
  forward, which the work counters must report every time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from bench.gate.formatting import parse_tolerance
from bench.gate.resident import ResidentSide, compare_resident
from bench.results import REPO_ROOT
from bench.scenario import load_scenario

SLOWDOWNS = (0.05, 0.10, 0.20)

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


def timing_run(scenario, fraction: float, tolerance: float, budget_s: float, device: str) -> dict:
    """One independent gate decision on a candidate slowed by ``fraction`` (0: identical code)."""
    with contextlib.ExitStack() as stack:
        base_root = stack.enter_context(candidate_copy(None))
        cand_root = stack.enter_context(candidate_copy(slowdown_patch(fraction) if fraction else None))
        timeout = scenario.run.timeout_s + 120
        base = stack.enter_context(ResidentSide("baseline", base_root, scenario, device, timeout))
        cand = stack.enter_context(ResidentSide("candidate", cand_root, scenario, device, timeout))
        started = time.monotonic()
        result = compare_resident(base, cand, tolerance, budget_s, log=lambda line: None)
    assert result.estimate is not None  # compare_resident runs paired.MIN_PAIRS pairs at least
    return {
        "planted": fraction,
        "verdict": result.verdict,
        "estimate": result.estimate.slowdown,
        "interval": list(result.estimate.interval),
        "pairs": len(result.baseline_s),
        "steps_per_block": result.steps_per_block,
        "seconds": time.monotonic() - started,
        "stopped_by": result.stopped_by,
    }


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
    import os

    return dict(os.environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validate.gate_power", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default=str(REPO_ROOT / "scenarios/smoke/e8-random-bf16.yaml"))
    parser.add_argument("--work-scenario", default=str(REPO_ROOT / "scenarios/smoke/e8-ep2-nosync-bf16.yaml"))
    parser.add_argument("--aa-runs", type=int, default=20)
    parser.add_argument("--runs", type=int, default=10, help="runs per planted slowdown")
    parser.add_argument("--work-runs", type=int, default=3, help="runs per planted work change")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds of resident blocks per run, at most")
    parser.add_argument("--tolerance", default="5%")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write every run's record here")
    args = parser.parse_args(argv)
    tolerance = parse_tolerance(args.tolerance)
    scenario = load_scenario(args.scenario)
    records: dict[str, list[dict]] = {"timing": [], "work": []}
    plan = [0.0] * args.aa_runs + [f for f in SLOWDOWNS for _ in range(args.runs)]
    for index, fraction in enumerate(plan, 1):
        record = timing_run(scenario, fraction, tolerance, args.budget, args.device)
        records["timing"].append(record)
        print(
            f"[{index}/{len(plan)}] planted +{fraction:.0%}: {record['verdict']} x{1 + record['estimate']:.3f} "
            f"({record['pairs']} pairs, {record['seconds']:.0f} s)",
            flush=True,
        )
    for plant in WORK_PLANTS:
        for run in range(args.work_runs):
            record = work_run(Path(args.work_scenario), plant, args.tolerance, args.budget, args.device)
            records["work"].append(record)
            print(
                f"work {plant} [{run + 1}/{args.work_runs}]: detected={record['detected']} "
                f"({record['seconds']:.0f} s) {record['findings'][:1]}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "records": records}, indent=1) + "\n")
    print(render(records, args))
    return 0


def render(records: dict[str, list[dict]], args) -> str:
    rows = ["| check | runs | result | gate wall time per run (median) |", "| --- | --- | --- | --- |"]
    timing = records["timing"]
    for fraction in (0.0, *SLOWDOWNS):
        runs = [r for r in timing if r["planted"] == fraction]
        if not runs:
            continue
        wall = statistics.median(r["seconds"] for r in runs)
        regressed = sum(r["verdict"] == "regressed" for r in runs)
        inconclusive = sum(r["verdict"] == "inconclusive" for r in runs)
        label = "A/A (same code): false positives" if fraction == 0 else f"planted +{fraction:.0%} step time: detected"
        rows.append(
            f"| {label} | {len(runs)} | {regressed} of {len(runs)} ({regressed / len(runs):.0%}); "
            f"{inconclusive} inconclusive | {wall:.0f} s |"
        )
    for plant in WORK_PLANTS:
        runs = [r for r in records["work"] if r["plant"] == plant]
        if runs:
            found = sum(r["detected"] for r in runs)
            wall = statistics.median(r["seconds"] for r in runs)
            rows.append(
                f"| planted {plant}: detected by the work counters | {len(runs)} | {found} of {len(runs)} | "
                f"{wall:.0f} s |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
