"""How much resident workers of identical code differ for their whole life (the A/B gate's pair bias),
against how much their blocks vary: the variance components behind ``bench.gate.paired``.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

from bench.ab.resident import TARGET_BLOCK_S, ResidentSide
from bench.logs import console_logging
from bench.results import REPO_ROOT
from bench.scenario import load_scenario
from bench.validate.gate_power import machine

logger = logging.getLogger(__name__)


def variance_components(times_s: list[list[float]]) -> dict[str, float | list[float]]:
    """Block noise and worker bias (log space) of ``times_s[worker][round]``: see docs/validation-tools.md."""
    workers, rounds = len(times_s), len(times_s[0])
    if workers < 2 or rounds < 2 or any(len(t) != rounds for t in times_s):
        raise ValueError("need at least 2 workers with the same number (at least 2) of rounds each")
    logs = [[math.log(t) for t in worker] for worker in times_s]
    round_means = [statistics.fmean(logs[w][r] for w in range(workers)) for r in range(rounds)]
    centred = [[logs[w][r] - round_means[r] for r in range(rounds)] for w in range(workers)]
    means = [statistics.fmean(c) for c in centred]
    within = statistics.fmean(statistics.variance(c) for c in centred)
    between_ms = rounds * statistics.variance(means)
    return {
        "block_noise": math.sqrt(within),
        "worker_bias": math.sqrt(max(0.0, (between_ms - within) / rounds)),
        "worker_means": means,
    }


def measure(scenario_file: str, workers: int, rounds: int, env: dict[str, str], no_aslr: bool) -> dict:
    scenario = load_scenario(scenario_file)
    prefix = ("setarch", "-R") if no_aslr else ()
    timeout = scenario.run.timeout_s + 120
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        sides = [
            stack.enter_context(ResidentSide(f"w{i}", REPO_ROOT, scenario, "cpu", timeout, env=env, prefix=prefix))
            for i in range(workers)
        ]
        steps = max(1, round(TARGET_BLOCK_S / max(min(side.block(1) for side in sides), 1e-6)))
        for side in sides:
            side.block(steps)
        times_s: list[list[float]] = [[] for _ in sides]
        for r in range(rounds):
            order = range(workers) if r % 2 == 0 else reversed(range(workers))
            for w in order:
                times_s[w].append(sides[w].block(steps))
    found = variance_components(times_s)
    return {
        "scenario": scenario.name,
        "workers": workers,
        "rounds": rounds,
        "steps_per_block": steps,
        "env": env,
        "no_aslr": no_aslr,
        **found,
        "seconds": time.monotonic() - started,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validate.worker_bias", description=__doc__.split("\n")[0])
    parser.add_argument("scenario")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-aslr", action="store_true", help="start each worker under setarch -R")
    parser.add_argument("--records", help="append the result here (JSON lines)")
    args = parser.parse_args(argv)
    bad = [e for e in args.env if "=" not in e]
    if bad or args.workers < 2 or args.rounds < 2:
        logger.error(
            f"worker_bias: {'--env takes KEY=VALUE, got ' + bad[0] if bad else '--workers and --rounds must be 2 or more'}"
        )
        return 2
    env = dict(e.split("=", 1) for e in args.env)
    record = measure(str(Path(args.scenario)), args.workers, args.rounds, env, args.no_aslr)
    if args.records:
        with Path(args.records).open("a") as out:
            out.write(json.dumps(record) + "\n")
    means = ", ".join(f"{m:+.2%}" for m in record["worker_means"])
    sys.stdout.write(
        f"{record['scenario']} ({', '.join(args.env) or 'default'}{', no ASLR' if args.no_aslr else ''}): "
        f"worker bias {record['worker_bias']:.2%}, block noise {record['block_noise']:.2%} "
        f"({args.workers} workers x {args.rounds} rounds of {record['steps_per_block']} steps, "
        f"{record['seconds']:.0f} s); worker means {means}\n"
    )
    return 0


if __name__ == "__main__":
    console_logging()
    sys.exit(main())
