"""Speed-up of regional compilation (``run.compile``): compiled against eager, side by side, per scenario.

    python -m bench.validate.compile_speedup [--suite ci | SCENARIO ...] [--pairs 10] [--block-s 1.0]
        [--timeout-s 900] [--device cpu] [--out docs/measurements/compile-speedup-2core-cpu.json]

For each execute scenario, two resident workers (``bench.gate.resident``: one process, or one per
rank on gloo, each built by ``bench.run.execute.build_trainer``): the scenario with ``run.compile``
false and true, started one after the other. A worker is ready after its warm-up steps, which on the
compiled side include the compilation; then one step per side sizes the blocks (``--block-s``), one
unrecorded block per side settles the allocators, and ``--pairs`` pairs of blocks alternate between
the sides (eager first, then compiled first, and so on), every block replaying the same batches and
routes. A pair's speed-up is eager seconds / compiled seconds: the compiled throughput over the
eager one. Reported: the median speed-up, its range and quartiles, and the Hodges-Lehmann estimate
with its 95% interval (``bench.gate.paired``); apart from them, the compile time: how much longer
the compiled worker took to be ready (the same start-up and warm-up steps, plus compiling), each
scenario with an empty inductor cache, so a cold compile. Both sides train the same steps, and
their losses on the probe step (the first after the warm-up) and on the last block are reported as
a check. They drift apart, fp32 included: the first step's losses agree, but Adam (eps 1e-8) turns
the rounding differences of near-zero gradients into full-size updates (measured on e8-skewed-fp32:
0, then 1.7e-5 after one update, 2e-4 on the probe step); ``tests/test_compile.py`` is the
correctness check.

Plan scenarios have no execution: they are listed as skipped. Every worker answers within
``--timeout-s`` or is killed with its ranks, and the scenario is recorded as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import yaml

from bench.gate import paired
from bench.gate.resident import ResidentSide, WorkerDied
from bench.machine import machine_info
from bench.release.version import engine_info
from bench.results import REPO_ROOT, utc_now
from bench.run.runner import load_all, suite_files
from bench.scenario import Scenario, scenario_from_dict

VARIANTS = (("eager", False), ("compiled", True))


def variant(scenario: Scenario, compiled: bool) -> Scenario:
    """The scenario as its file says it, with ``run.compile`` set; no file, so the workers take this spec."""
    spec = yaml.safe_load(Path(scenario.file).read_text()) if scenario.file else dict(scenario.spec)
    spec["name"] = scenario.name
    spec["run"] = {**spec.get("run", {}), "compile": compiled}
    return scenario_from_dict(spec)


def speedup_summary(eager_s: list[float], compiled_s: list[float]) -> dict[str, Any]:
    """Per-pair speed-ups (eager / compiled seconds), their median, range and quartiles, and the
    Hodges-Lehmann estimate of the speed-up with its 95% interval."""
    ratios = [e / c for e, c in zip(eager_s, compiled_s)]
    summary: dict[str, Any] = {"per_pair": ratios, "median": statistics.median(ratios), "min": min(ratios),
                               "max": max(ratios)}
    if len(ratios) >= 2:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        estimate = paired.hodges_lehmann(paired.log_ratios(compiled_s, eager_s))
        summary.update(quartiles=[q1, q3], hodges_lehmann=math.exp(estimate.estimate),
                       interval_95=[math.exp(estimate.low), math.exp(estimate.high)])
    return summary


def measure(scenario: Scenario, device: str, pairs: int, block_s: float, timeout_s: float,
            log: Callable[[str], None]) -> dict[str, Any]:
    """One scenario's paired blocks, compiled against eager (see the module docstring)."""
    row: dict[str, Any] = {"scenario": scenario.name, "file": str(scenario.file), "mode": scenario.mode}
    if scenario.mode != "execute":
        log(f"{scenario.name}: skipped, a {scenario.mode} scenario has no execution")
        return {**row, "status": "skipped", "reason": f"a {scenario.mode} scenario has no execution"}
    row["world_size"] = scenario.world_size
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-inductor-cache-"))
        # The workers inherit it: every scenario compiles from an empty cache.
        stack.enter_context(mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache}))
        sides, ready_s = {}, {}
        try:
            for label, compiled in VARIANTS:
                log(f"{scenario.name}: starting the {label} worker ({scenario.world_size} rank(s))")
                started = time.monotonic()
                sides[label] = stack.enter_context(
                    ResidentSide(label, REPO_ROOT, variant(scenario, compiled), device, timeout_s))
                ready_s[label] = time.monotonic() - started
                log(f"{scenario.name}: {label} worker ready in {ready_s[label]:.1f} s")
            probe = {label: side.block(1) for label, side in sides.items()}
            probe_losses = {label: side.last_losses for label, side in sides.items()}
            steps = max(1, round(block_s / min(probe.values())))
            for side in sides.values():
                side.block(steps)
            times: dict[str, list[float]] = {label: [] for label in sides}
            for index in range(pairs):
                order = list(sides) if index % 2 == 0 else list(reversed(sides))
                for label in order:
                    times[label].append(sides[label].block(steps))
                log(f"{scenario.name}: pair {index + 1}/{pairs}: eager {times['eager'][-1]:.3f} s, "
                    f"compiled {times['compiled'][-1]:.3f} s ({steps} steps each)")
        except WorkerDied as err:
            log(f"{scenario.name}: failed: {err}")
            return {**row, "status": "failed", "error": str(err), "ready_s": ready_s}
        last_losses = {label: side.last_losses for label, side in sides.items()}
    tokens = steps * scenario.run["tokens_per_step"]
    speedup = speedup_summary(times["eager"], times["compiled"])
    probe_gap = loss_gap(probe_losses)
    log(f"{scenario.name}: speed-up x{speedup['median']:.3f} (median of {pairs} pairs, "
        f"{speedup['min']:.3f} to {speedup['max']:.3f}); compile {ready_s['compiled'] - ready_s['eager']:.1f} s; "
        f"probe step losses {probe_gap:.1e} apart")
    return {
        **row, "status": "ok", "steps_per_block": steps, "tokens_per_step": scenario.run["tokens_per_step"],
        "eager_block_s": times["eager"], "compiled_block_s": times["compiled"], "speedup": speedup,
        "tokens_per_s_median": {label: tokens / statistics.median(t) for label, t in times.items()},
        "ready_s": ready_s, "compile_s": ready_s["compiled"] - ready_s["eager"],
        "probe_losses": probe_losses, "probe_loss_rel_diff": probe_gap,
        "last_block_losses": last_losses, "last_block_loss_max_rel_diff": loss_gap(last_losses),
    }


def loss_gap(losses: dict[str, list[float]]) -> float:
    """The largest relative difference between the compiled and the eager side's losses of a block."""
    return max(abs(c - e) / abs(e) for e, c in zip(losses["eager"], losses["compiled"]))


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | ranks | speed-up (median) | range | quartiles | HL 95% interval | compile s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['scenario']} | {row.get('world_size', '-')} | {row['status']}: "
                         f"{row.get('reason') or row.get('error')} | | | | |")
            continue
        s = row["speedup"]
        quartiles = f"{s['quartiles'][0]:.3f} to {s['quartiles'][1]:.3f}" if "quartiles" in s else "-"
        interval = f"{s['interval_95'][0]:.3f} to {s['interval_95'][1]:.3f}" if "interval_95" in s else "-"
        lines.append(f"| {row['scenario']} | {row['world_size']} | x{s['median']:.3f} | {s['min']:.3f} to "
                     f"{s['max']:.3f} | {quartiles} | {interval} | {row['compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.validate.compile_speedup", description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="*", help="scenario files (default: the --suite)")
    parser.add_argument("--suite", default="ci")
    parser.add_argument("--pairs", type=int, default=10, help="timed block pairs per scenario")
    parser.add_argument("--block-s", type=float, default=1.0, help="seconds a block aims at")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="seconds a worker may take to answer (its start, with the compilation, included)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="write the measurement here (JSON)")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.block_s <= 0:
        parser.error("--pairs must be >= 1 and --block-s > 0")
    files = [Path(f) for f in args.scenarios] or suite_files(args.suite, torch.device(args.device))
    scenarios = load_all(files)
    log = lambda line: print(line, flush=True)
    rows = []
    for index, scenario in enumerate(scenarios, 1):
        log(f"[{index}/{len(scenarios)}] {scenario.name}")
        rows.append(measure(scenario, args.device, args.pairs, args.block_s, args.timeout_s, log))
    table = render(rows)
    print(table)
    if args.out:
        document = {
            "command": " ".join(["python -m bench.validate.compile_speedup", *argv]),
            "measured_at": utc_now(), "machine": machine_info(), "engine": engine_info(),
            "settings": {"suite": None if args.scenarios else args.suite, "pairs": args.pairs,
                         "block_s": args.block_s, "timeout_s": args.timeout_s, "device": args.device},
            "scenarios": rows, "table": table,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
        log(f"wrote {args.out}")
    return 0 if all(row["status"] in ("ok", "skipped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
