"""One scenario under several variants, side by side in one run, as ratios to a base variant.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import yaml

from bench.ab.resident import ResidentSide, WorkerDied
from bench.gate import paired
from bench.machine import machine_info
from bench.release.version import engine_info
from bench.results import REPO_ROOT, utc_now
from bench.run.process import session_processes
from bench.run.suites import load_all, suite_files
from bench.scenario import Scenario, scenario_from_dict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """A name and a patch of the scenario as its file says it."""

    name: str
    patch: Mapping[str, Any] = field(default_factory=dict)


def merge(spec: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with ``patch`` applied (neither changed): mappings merge key by key, anything else
    (a value, a list) replaces what the spec has there."""
    merged = copy.deepcopy(dict(spec))
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def spec_as_written(scenario: Scenario) -> dict[str, Any]:
    """The scenario as its file says it (the defaults left to the loader), named as loaded."""
    spec = yaml.safe_load(Path(scenario.file).read_text()) if scenario.file else copy.deepcopy(scenario.spec)
    spec["name"] = scenario.name
    return spec


def patched(scenario: Scenario, patch: Mapping[str, Any]) -> Scenario:
    """The scenario with ``patch`` applied, validated; it has no file, so a worker takes this spec
    (``ResidentSide`` reads a scenario's file when it has one)."""
    return scenario_from_dict(merge(spec_as_written(scenario), patch))


def rotation(names: list[str], round_index: int, base: str) -> list[tuple[str, str]]:
    """Round ``round_index``'s block pairs, in order, as (first, second): every name of ``names``
    once, with ``base``; the base first in even rounds, second in odd ones; the pairs' order shifted
    by one place every round."""
    shift = round_index % len(names) if names else 0
    order = names[shift:] + names[:shift]
    return [(base, name) if round_index % 2 == 0 else (name, base) for name in order]


def ratio_summary(base_s: list[float], variant_s: list[float]) -> dict[str, Any]:
    """Per-pair ratios (base / variant seconds: the variant's relative throughput), their median,
    range and quartiles, and the Hodges-Lehmann estimate of the ratio with its 95% interval (2 pairs
    or more)."""
    if len(base_s) != len(variant_s) or not base_s:
        raise ValueError("paired block times need as many base as variant blocks, at least one")
    ratios = [b / v for b, v in zip(base_s, variant_s)]
    summary: dict[str, Any] = {
        "per_pair": ratios,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }
    if len(ratios) >= 2:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        # log_ratios(baseline, candidate) is logger.info(candidate / baseline): here logger.info(base / variant).
        estimate = paired.hodges_lehmann(paired.log_ratios(variant_s, base_s))
        summary.update(
            quartiles=[q1, q3],
            hodges_lehmann=math.exp(estimate.estimate),
            interval_95=[math.exp(estimate.low), math.exp(estimate.high)],
        )
    return summary


def loss_gap(base: list[float], other: list[float]) -> float:
    """The largest relative difference between a worker's losses of a block and the base's."""
    return max((abs(o - b) / abs(b) for b, o in zip(base, other)), default=0.0)


def _worker_pids(side: Any) -> list[int]:
    process = getattr(side, "process", None)
    return session_processes(process.pid) if process is not None and Path("/proc").is_dir() else []


def reset_peak_memory(side: Any) -> bool:
    """Set each of a worker's processes' peak resident memory back to its current one (Linux
    ``clear_refs`` 5); whether every one was."""
    pids = _worker_pids(side)
    done = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            done += 1
    return bool(pids) and done == len(pids)


def peak_memory_mib(side: Any) -> float | None:
    """The largest peak resident memory (``VmHWM``) among a worker's processes, MiB; None where it
    cannot be read."""
    peaks = []
    for pid in _worker_pids(side):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
    return max(peaks) if peaks else None


def measure(
    scenario: Scenario,
    base: Variant,
    variants: list[Variant],
    device: str,
    pairs: int,
    block_s: float,
    timeout_s: float,
    side_factory: Callable[..., Any] = ResidentSide,
    root: Path = REPO_ROOT,
) -> dict[str, Any]:
    """One scenario's rounds of paired blocks, every variant against the base (see docs/validation-tools.md).

    ``side_factory(label, root, scenario, device, timeout_s)``: a context manager with ``block(steps)
    -> seconds`` and ``last_losses`` (``ResidentSide``; a fake in tests).
    """
    names = [v.name for v in variants]
    if not names:
        raise ValueError("at least one variant is measured against the base")
    if len(set(names + [base.name])) != len(names) + 1:
        raise ValueError(f"variant names must be distinct: {[base.name, *names]}")
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "file": str(scenario.file),
        "mode": scenario.mode,
        "base": base.name,
        "variants": names,
    }
    if scenario.mode != "execute":
        logger.info(f"{scenario.name}: skipped, a {scenario.mode} scenario has no execution")
        return {**row, "status": "skipped", "reason": f"a {scenario.mode} scenario has no execution"}
    row["world_size"] = scenario.world_size
    specs = {v.name: patched(scenario, v.patch) for v in (base, *variants)}
    ready_s: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-inductor-cache-"))
        # The workers inherit it: every scenario compiles from an empty cache.
        stack.enter_context(mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache}))
        sides: dict[str, Any] = {}
        try:
            for name, spec in specs.items():
                logger.info(f"{scenario.name}: starting the {name} worker ({scenario.world_size} rank(s))")
                started = time.monotonic()
                sides[name] = stack.enter_context(side_factory(name, root, spec, device, timeout_s))
                ready_s[name] = time.monotonic() - started
                logger.info(f"{scenario.name}: {name} worker ready in {ready_s[name]:.1f} s")
            resets = [reset_peak_memory(side) for side in sides.values()]  # every one, not up to a failure
            peak_reset = all(resets)
            probe = {name: side.block(1) for name, side in sides.items()}
            probe_losses = {name: side.last_losses for name, side in sides.items()}
            steps = max(1, round(block_s / max(min(probe.values()), 1e-9)))
            for side in sides.values():
                side.block(steps)
            times: dict[str, list[float]] = {name: [] for name in sides}
            base_s: dict[str, list[float]] = {name: [] for name in names}  # the base's block of each pair
            order = []
            for index in range(pairs):
                pairs_now = rotation(names, index, base.name)
                order.append([list(pair) for pair in pairs_now])
                for first, second in pairs_now:
                    seconds = {first: sides[first].block(steps)}
                    seconds[second] = sides[second].block(steps)
                    variant = second if first == base.name else first
                    times[variant].append(seconds[variant])
                    times[base.name].append(seconds[base.name])
                    base_s[variant].append(seconds[base.name])
                    if len(times[base.name]) == pairs:  # the base has trained as many steps as a variant at its end
                        base_matched = sides[base.name].last_losses
                logger.info(
                    f"{scenario.name}: round {index + 1}/{pairs} ({steps} steps a block): "
                    + ", ".join(f"{n} x{base_s[n][-1] / times[n][-1]:.3f}" for n in names)
                )
            last_losses = {name: side.last_losses for name, side in sides.items()}
            last_losses[base.name] = base_matched
            peak_mib = {name: peak_memory_mib(side) for name, side in sides.items()}
        except WorkerDied as err:
            logger.info(f"{scenario.name}: failed: {err}")
            return {**row, "status": "failed", "error": str(err), "ready_s": ready_s}
    tokens_per_step = scenario.run.tokens_per_step
    ratios = {name: ratio_summary(base_s[name], times[name]) for name in names}
    result = {
        **row,
        "status": "ok",
        "patches": {v.name: dict(v.patch) for v in (base, *variants)},
        "steps_per_block": steps,
        "tokens_per_step": tokens_per_step,
        "order": order,
        "block_s": times,
        "base_block_s": base_s,
        "ratios": ratios,
        "tokens_per_s_median": {name: steps * tokens_per_step / statistics.median(t) for name, t in times.items()},
        "ready_s": ready_s,
        "peak_rss_mib": peak_mib if any(v is not None for v in peak_mib.values()) else None,
        "peak_rss_since": "probe" if peak_reset else "start",
        "probe_losses": probe_losses,
        "probe_loss_rel_diff": {n: loss_gap(probe_losses[base.name], probe_losses[n]) for n in names},
        "last_block_losses": last_losses,
        "last_block_loss_max_rel_diff": {n: loss_gap(last_losses[base.name], last_losses[n]) for n in names},
    }
    logger.info(
        f"{scenario.name}: "
        + "; ".join(f"{n} x{ratios[n]['median']:.3f} ({ratios[n]['min']:.3f} to {ratios[n]['max']:.3f})" for n in names)
        + f" (median of {pairs} pairs, throughput over {base.name})"
    )
    return result


def _interval(summary: Mapping[str, Any], key: str) -> str:
    return f"{summary[key][0]:.3f} to {summary[key][1]:.3f}" if key in summary else "-"


def render(rows: list[dict[str, Any]], control: str | None = None) -> str:
    """A markdown table: a line per scenario and variant, its throughput ratio to the base; peak
    memory as MiB and the difference from the base's; ``control`` (an A/A variant) marked."""
    lines = [
        (
            "| scenario | ranks | variant | throughput vs base (median) | range | quartiles | HL 95% interval "
            "| peak RSS MiB (vs base) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(
                f"| {row['scenario']} | {row.get('world_size', '-')} | - | {row['status']}: "
                f"{row.get('reason') or row.get('error')} | | | | |"
            )
            continue
        peaks = row.get("peak_rss_mib") or {}
        base_peak = peaks.get(row["base"])
        for name in row["variants"]:
            s = row["ratios"][name]
            label = f"{name} (A/A control)" if name == control else name
            peak = peaks.get(name)
            memory = (
                "-" if peak is None else (f"{peak:.0f}" + ("" if base_peak is None else f" ({peak - base_peak:+.0f})"))
            )
            lines.append(
                f"| {row['scenario']} | {row['world_size']} | {label} vs {row['base']} | x{s['median']:.3f} "
                f"| {s['min']:.3f} to {s['max']:.3f} | {_interval(s, 'quartiles')} "
                f"| {_interval(s, 'interval_95')} | {memory} |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The command line both entry points share
# --------------------------------------------------------------------------------------------


def add_run_arguments(parser, timeout_help: str) -> None:
    """Scenarios or a suite, pairs, block length, timeout, device and output file."""
    parser.add_argument("scenarios", nargs="*", help="scenario files (default: the --suite)")
    parser.add_argument("--suite", default="ci")
    parser.add_argument("--pairs", type=int, default=10, help="rounds: timed block pairs per variant and scenario")
    parser.add_argument("--block-s", type=float, default=1.0, help="seconds a block aims at")
    parser.add_argument("--timeout-s", type=float, default=900.0, help=timeout_help)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="write the measurement here (JSON)")


def run_suite(parser, args, measure_one: Callable[[Scenario], dict[str, Any]]) -> list[dict]:
    """Check the shared arguments, then measure every scenario in order; one row each."""

    if args.pairs < 1 or args.block_s <= 0:
        parser.error("--pairs must be >= 1 and --block-s > 0")
    files = [Path(f) for f in args.scenarios] or suite_files(args.suite, torch.device(args.device))
    scenarios = load_all(files)
    rows = []
    for index, scenario in enumerate(scenarios, 1):
        logger.info(f"[{index}/{len(scenarios)}] {scenario.name}")
        rows.append(measure_one(scenario))
    return rows


def write_measurement(args, command: str, rows: list[dict], settings: Mapping[str, Any], **extra: Any) -> int:
    """Write the measurement document (when ``--out`` was given); the exit code of the rows."""

    if args.out:
        document = {
            "command": command,
            "measured_at": utc_now(),
            "machine": machine_info(),
            "engine": engine_info(),
            "settings": {
                "suite": None if args.scenarios else args.suite,
                "pairs": args.pairs,
                "block_s": args.block_s,
                "timeout_s": args.timeout_s,
                "device": args.device,
                **settings,
            },
            **extra,
            "scenarios": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
        logger.info(f"wrote {args.out}")
    return 0 if all(row["status"] in ("ok", "skipped") for row in rows) else 1
