"""Throughput cost of each activation-recompute mode, against no recompute, side by side, per scenario.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.logs import console_logging
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
        lambda scenario: variants.measure(
            scenario, BASE, chosen, args.device, args.pairs, args.block_s, args.timeout_s
        ),
    )
    table = variants.render(rows, control=CONTROL.name)
    note = control_note(rows)
    sys.stdout.write(f"{table}\n{note}\n")
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
    console_logging()
    sys.exit(main())
