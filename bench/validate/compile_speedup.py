"""Speed-up of regional compilation (``run.compile``): compiled against eager, side by side, per scenario.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from bench.ab.resident import ResidentSide
from bench.logs import console_logging
from bench.scenario import Scenario
from bench.validate import variants
from bench.validate.variants import Variant

logger = logging.getLogger(__name__)

EAGER = Variant("eager", {"run": {"compile": False}})
COMPILED = Variant("compiled", {"run": {"compile": True}})


def variant(scenario: Scenario, compiled: bool) -> Scenario:
    """The scenario as its file says it, with ``run.compile`` set; no file, so the workers take this spec."""
    return variants.patched(scenario, (COMPILED if compiled else EAGER).patch)


def speedup_summary(eager_s: list[float], compiled_s: list[float]) -> dict[str, Any]:
    """Per-pair speed-ups (eager / compiled seconds), their median, range and quartiles, and the
    Hodges-Lehmann estimate of the speed-up with its 95% interval."""
    return variants.ratio_summary(eager_s, compiled_s)


def measure(
    scenario: Scenario,
    device: str,
    pairs: int,
    block_s: float,
    timeout_s: float,
    side_factory: Callable[..., Any] = ResidentSide,
) -> dict[str, Any]:
    """One scenario's paired blocks, compiled against eager (see docs/validation-tools.md)."""
    row = variants.measure(scenario, EAGER, [COMPILED], device, pairs, block_s, timeout_s, side_factory)
    common: dict[str, Any] = {
        key: row[key] for key in ("scenario", "file", "mode", "world_size", "status") if key in row
    }
    if row["status"] == "skipped":
        return {**common, "reason": row["reason"]}
    if row["status"] == "failed":
        return {**common, "error": row["error"], "ready_s": row["ready_s"]}
    ready_s = row["ready_s"]
    compile_s = ready_s["compiled"] - ready_s["eager"]
    logger.info(
        f"{scenario.name}: compile {compile_s:.1f} s; probe step losses "
        f"{row['probe_loss_rel_diff']['compiled']:.1e} apart"
    )
    return {
        **common,
        "steps_per_block": row["steps_per_block"],
        "tokens_per_step": row["tokens_per_step"],
        "eager_block_s": row["base_block_s"]["compiled"],
        "compiled_block_s": row["block_s"]["compiled"],
        "speedup": row["ratios"]["compiled"],
        "tokens_per_s_median": row["tokens_per_s_median"],
        "ready_s": ready_s,
        "compile_s": compile_s,
        "probe_losses": row["probe_losses"],
        "probe_loss_rel_diff": row["probe_loss_rel_diff"]["compiled"],
        "last_block_losses": row["last_block_losses"],
        "last_block_loss_max_rel_diff": row["last_block_loss_max_rel_diff"]["compiled"],
        "peak_rss_mib": row["peak_rss_mib"],
        "peak_rss_since": row["peak_rss_since"],
        "order": row["order"],
    }


def loss_gap(losses: dict[str, list[float]]) -> float:
    """The largest relative difference between the compiled and the eager side's losses of a block."""
    return variants.loss_gap(losses["eager"], losses["compiled"])


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | ranks | speed-up (median) | range | quartiles | HL 95% interval | compile s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(
                f"| {row['scenario']} | {row.get('world_size', '-')} | {row['status']}: "
                f"{row.get('reason') or row.get('error')} | | | | |"
            )
            continue
        s = row["speedup"]
        quartiles = f"{s['quartiles'][0]:.3f} to {s['quartiles'][1]:.3f}" if "quartiles" in s else "-"
        interval = f"{s['interval_95'][0]:.3f} to {s['interval_95'][1]:.3f}" if "interval_95" in s else "-"
        lines.append(
            f"| {row['scenario']} | {row['world_size']} | x{s['median']:.3f} | {s['min']:.3f} to "
            f"{s['max']:.3f} | {quartiles} | {interval} | {row['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m bench.validate.compile_speedup", description=__doc__.split("\n")[0]
    )
    variants.add_run_arguments(
        parser, "seconds a worker may take to answer (its start, with the compilation, included)"
    )
    args = parser.parse_args(argv)
    rows = variants.run_suite(
        parser,
        args,
        lambda scenario: measure(scenario, args.device, args.pairs, args.block_s, args.timeout_s),
    )
    table = render(rows)
    sys.stdout.write(table + "\n")
    return variants.write_measurement(
        args, " ".join(["python -m bench.validate.compile_speedup", *argv]), rows, {}, table=table
    )


if __name__ == "__main__":
    console_logging()
    sys.exit(main())
