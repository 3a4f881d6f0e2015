"""In-process execute runs of a tiny scenario, their work counters, and the gate on result folders of them."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import torch
from result_docs import make_doc
from scenario_files import variant

from bench.cli import main
from bench.machine import Peaks
from bench.results import write_result
from bench.run.execute import execute
from bench.scenario import scenario_from_dict

# fp32, 2 layers, 8 experts top-2, random routing, 128 tokens a step; the reference (unfused) step,
# whose FLOPs tests/unit/bench/run/test_work.py's hand count restates op by op.
TINY_UNFUSED = variant(model__fused_kernels=False)


def execute_once(spec=TINY_UNFUSED, groups=None):
    """``(metrics, details)`` of one execute run of ``spec`` on the CPU, from seed 0."""
    torch.manual_seed(0)
    result = execute(scenario_from_dict(spec), torch.device("cpu"), Peaks(), groups=groups)
    return None if result is None else (result.metrics, result.details)


def work_census(details) -> list[dict]:
    """Each rank's work counters without their timings."""
    return [{k: v for k, v in rank.items() if k != "seconds"} for rank in details["work"]["ranks"]]


def only_work(metrics: dict) -> dict:
    # Timings of two in-process runs differ by noise: the gate on them is on the work counters alone.
    return {name: entry for name, entry in metrics.items() if name.startswith("work_")}


def write_side(tmp_path: Path, label: str, name: str, run, spec=TINY_UNFUSED) -> Path:
    """A results folder ``tmp_path/label`` holding ``run``'s work metrics and details as scenario ``name``."""
    metrics, details = run
    doc = make_doc(name, only_work(metrics), spec=spec)
    doc["details"] = json.loads(json.dumps(details))
    folder = tmp_path / label
    write_result(doc, folder / "v" / "m")
    return folder


def write_sides(tmp_path: Path, base, cand, name: str = "tiny", spec=TINY_UNFUSED) -> tuple[Path, Path]:
    return write_side(tmp_path, "base", name, base, spec), write_side(tmp_path, "cand", name, cand, spec)


def run_gate(*argv: str) -> tuple[int, str]:
    """``moe-bench gate`` with ``argv``: its exit code and what it printed."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["gate", *argv])
    return code, out.getvalue()
