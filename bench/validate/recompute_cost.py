"""Throughput cost of each activation-recompute mode, against no recompute, side by side, per scenario.

    python -m bench.validate.recompute_cost [--suite ci | SCENARIO ...] [--pairs 10] [--block-s 1.0]
        [--variants NAME ...] [--no-control] [--timeout-s 900] [--device cpu]
        [--out docs/measurements/recompute-cost-2core-cpu.json]

For each execute scenario, one resident worker per variant (``bench.validate.variants``): the
scenario as its file says it with its ``recompute`` section's mode and parts replaced (``every``
and ``first_per_stage`` stay the file's):

- ``none`` (the base): ``{mode: none}``;
- ``full``: ``{mode: full}``;
- ``selective-attention``, ``selective-experts``, ``selective-norms``: ``{mode: selective}`` with
  that one part; ``selective-attention-experts``: with ``[attention, experts]``;
- ``none-again``: the base once more, a second identical worker measured the same way (an A/A
  control): its ratio to ``none`` shows what two identical workers give on this machine, the noise
  floor against which the other ratios are read.

All of a scenario's workers are alive at once (only one runs at a time), started one after the
other; then rounds of block pairs, each variant next to the base in every round, the base first
in even rounds, the pairs' order shifted every round. A pair's ratio is none seconds / variant
seconds: the variant's throughput over none's (below 1: slower). Reported per variant: the median
ratio, its range and quartiles, the Hodges-Lehmann estimate with its 95% interval, each worker's
peak resident memory over the measured blocks (host memory of a whole rank process, read as the
difference from none's), and the largest relative loss difference from none (recompute replays the
same forward, so near 0; Adam amplifies rounding as the steps go on, see
``bench.validate.compile_speedup``). Plan scenarios have no execution: they are listed as skipped.
Every worker answers within ``--timeout-s`` (its start, and its wait while the others start, run
and are started, included: it is also the gloo timeout of a multi-rank worker) or is killed with
its ranks, and the scenario is recorded as failed. Memory: the seven workers of a scenario stay
alive together, 0.4 to 1 GiB of resident memory per rank process for the smoke models (about 7 GiB
for a one-rank scenario, 8 GiB for the 2-rank one); ``--variants`` measures fewer.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.validate import variants
from bench.validate.variants import Variant


def _recompute(mode: str, *parts: str) -> dict[str, Any]:
    return {"recompute": {"mode": mode, "parts": list(parts)}}


BASE = Variant("none", _recompute("none"))
CONTROL = Variant("none-again", _recompute("none"))
MODES = (
    Variant("full", _recompute("full")),
    Variant("selective-attention", _recompute("selective", "attention")),
    Variant("selective-experts", _recompute("selective", "experts")),
    Variant("selective-norms", _recompute("selective", "norms")),
    Variant("selective-attention-experts", _recompute("selective", "attention", "experts")),
)


def control_note(rows: list[dict[str, Any]]) -> str:
    """What the A/A control showed, to read next to the table."""
    seen = [
        f"{row['scenario']} x{row['ratios'][CONTROL.name]['median']:.3f}"
        + (
            f" [{row['ratios'][CONTROL.name]['interval_95'][0]:.3f}, "
            f"{row['ratios'][CONTROL.name]['interval_95'][1]:.3f}]"
            if "interval_95" in row["ratios"][CONTROL.name]
            else ""
        )
        for row in rows
        if row["status"] == "ok" and CONTROL.name in row["ratios"]
    ]
    if not seen:
        return "No A/A control was measured (--no-control)."
    return (
        f"A/A control: {CONTROL.name} is a second worker identical to {BASE.name}, measured the same way; "
        f"its ratio is what two identical workers give here (median, HL 95% interval): {'; '.join(seen)}. "
        "A variant's ratio is a cost only where it lies outside that."
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.validate.recompute_cost", description=__doc__.split("\n")[0])
    variants.add_run_arguments(
        parser, "seconds a worker may take to answer (its start, and its wait while the others run)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[v.name for v in MODES],
        metavar="NAME",
        help=f"recompute variants to measure (default: all of {', '.join(v.name for v in MODES)})",
    )
    parser.add_argument("--no-control", action="store_true", help=f"leave out the A/A control ({CONTROL.name})")
    args = parser.parse_args(argv)
    chosen = [v for v in MODES if args.variants is None or v.name in args.variants]
    if not args.no_control:
        chosen.append(CONTROL)
    rows = variants.run_suite(
        parser,
        args,
        lambda scenario, log: variants.measure(
            scenario, BASE, chosen, args.device, args.pairs, args.block_s, args.timeout_s, log
        ),
    )
    table = variants.render(rows, control=CONTROL.name)
    note = control_note(rows)
    print(table)
    print(note)
    settings = {
        "base": {"name": BASE.name, "patch": BASE.patch},
        "variants": [{"name": v.name, "patch": v.patch} for v in chosen],
        "control": None if args.no_control else CONTROL.name,
    }
    ratio = "base seconds / variant seconds per block pair: the variant's throughput over none's (below 1: slower)"
    return variants.write_measurement(
        args,
        " ".join(["python -m bench.validate.recompute_cost", *argv]),
        rows,
        settings,
        ratio=ratio,
        control_note=note,
        table=table,
    )


if __name__ == "__main__":
    sys.exit(main())
