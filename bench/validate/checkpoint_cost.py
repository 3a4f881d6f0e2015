"""What checkpoints cost: save time, training stall (sync against async), load time, bytes per rank.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.logs import console_logging
from bench.machine import machine_info
from bench.predict.plan import plan_scenario
from bench.release.version import engine_info
from bench.results import load_results
from bench.run.checkpointing import checkpoints_before_run
from bench.run.runner import Runner
from bench.run.suites import expand_paths, load_all, resolve_device, suite_files
from bench.validate.variants import merge, spec_as_written

_METRICS = (
    "checkpoint_save_s",
    "checkpoint_stall_s",
    "checkpoint_load_s",
    "checkpoint_bytes_per_rank",
    "checkpoint_bytes_total",
)


def _run(spec: dict[str, Any], folder: Path, device: str, resume: bool = False) -> dict[str, Any]:
    """One ``moe-bench run`` of the scenario through the runner; ``resume``: from its latest checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = folder / "results"
    before = {d.path for d in load_results(out)} if out.exists() else set()
    scenarios = load_all([path])
    try:
        resumes = checkpoints_before_run(scenarios, True if resume else None, out)
    except ValueError:  # as ``moe-bench run`` answers bad input: exit code 2, nothing run
        return {"status": "failed", "exit_code": 2}
    outcomes = Runner(resolve_device(device), out, resume=resumes).run(scenarios)
    docs = [d for d in load_results(out) if d.path not in before]
    if any(o.status not in ("ok", "skipped") for o in outcomes) or not docs:
        return {"status": "failed", "exit_code": 1}
    metrics = docs[0].data["metrics"]
    return {"status": docs[0].data["status"], **{k: metrics[k]["samples"] for k in _METRICS if k in metrics}}


def measure(scenario, every_steps: int, device: str, scratch: Path) -> dict[str, Any]:
    spec = spec_as_written(scenario)
    planned, _ = plan_scenario(scenario)
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "layout": scenario.parallel_config.to_dict(),
        "planned_bytes_per_rank": planned["checkpoint_bytes_per_rank"]["median"],
        "planned_bytes_total": planned["checkpoint_bytes_total"]["median"],
    }
    for label, asynchronous in (("sync", False), ("async", True)):
        patched = merge(spec, {"checkpoint": {"every_steps": every_steps, "async": asynchronous}})
        row[label] = _run(patched, scratch / scenario.name / label, device)
    sync_spec = merge(spec, {"checkpoint": {"every_steps": every_steps, "async": False}})
    row["resume"] = _run(sync_spec, scratch / scenario.name / "sync", device, resume=True)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m bench.validate.checkpoint_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("files", nargs="*", help="scenario files (default: the --suite)")
    parser.add_argument("--suite", default="ci")
    parser.add_argument("--every-steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write the measurement document here")
    args = parser.parse_args(argv)
    files = expand_paths(args.files) if args.files else suite_files(args.suite, torch.device(args.device))
    scenarios = [s for s in load_all(files) if s.mode == "execute"]
    with tempfile.TemporaryDirectory(prefix="moe-ckpt-cost-") as scratch:
        rows = [measure(s, args.every_steps, args.device, Path(scratch)) for s in scenarios]
    for row in rows:
        sync, asy, res = row["sync"], row["async"], row["resume"]
        sys.stdout.write(
            f"{row['scenario']}: bytes/rank {sync.get('checkpoint_bytes_per_rank')} (plan "
            f"{row['planned_bytes_per_rank']:.0f}), total {sync.get('checkpoint_bytes_total')} (plan "
            f"{row['planned_bytes_total']:.0f}); sync save {sync.get('checkpoint_save_s')} stall "
            f"{sync.get('checkpoint_stall_s')}; async save {asy.get('checkpoint_save_s')} stall "
            f"{asy.get('checkpoint_stall_s')}; load {res.get('checkpoint_load_s')}\n"
        )
    if args.out:
        document = {
            "what": __doc__.split("\n")[0],
            "command": " ".join(["python -m bench.validate.checkpoint_cost", *argv]),
            "machine": machine_info(),
            "engine": engine_info(),
            "every_steps": args.every_steps,
            "scenarios": rows,
        }
        Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    return 0 if all(r[k]["status"] == "ok" for r in rows for k in ("sync", "async", "resume")) else 1


if __name__ == "__main__":
    console_logging()
    sys.exit(main())
