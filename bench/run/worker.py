"""Worker process: execute one scenario and write its metrics as JSON.

    python -m bench.run.worker SCENARIO_JSON OUT_JSON --device cpu [--peak-tflops X] [--peak-tflops-fp8 Y]
        [--peak-tflops-source TEXT]

Under torchrun (``WORLD_SIZE`` > 1) every rank runs this module: the ranks join one process group
(gloo on CPU, NCCL on CUDA), execute their share of the layout, and rank 0 writes the outcome.
A rank that fails writes ``OUT_JSON.rank<r>.error`` and exits non-zero so torchrun stops the others.

SCENARIO_JSON is ``{"spec", "file", "checkpoint"}``; ``checkpoint`` (optional) is where the results
root is, which checkpoint to resume from and the attempt's number (``bench.run.checkpointing``).
Progress lines go to stdout (the runner relays them); the outcome goes to OUT_JSON as
``{"status", "error", "metrics", "details"}``. Exit code 0 whenever the scenario ran to an outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench.run.checkpointing import policy_for
from bench.run.execute import CheckpointRun, NonFiniteLoss, execute
from bench.run.launch import detect_launch, join_launch
from bench.scenario import Scenario, scenario_from_dict
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout


def execute_outcome(
    scenario: Scenario,
    device: torch.device,
    peak: float | None,
    groups,
    peak_fp8: float | None = None,
    checkpointing: CheckpointRun | None = None,
    project_devices: list[str] = (),
    peak_source: str | None = None,
) -> dict:
    outcome = {"status": "ok", "error": None, "metrics": {}, "details": {}}
    progress = lambda line: print(line, flush=True)
    try:
        if scenario.mode == "proxy":
            from bench.run.proxy import run_proxy

            result = run_proxy(scenario, device, progress, project_devices)
        else:
            result = execute(
                scenario,
                device,
                peak,
                progress=progress,
                groups=groups,
                peak_tflops_fp8=peak_fp8,
                checkpointing=checkpointing,
                peak_tflops_source=peak_source,
            )
        if result is not None:
            outcome["metrics"], outcome["details"] = result.metrics, result.details
    except NonFiniteLoss as err:
        outcome.update(status="failed", error=str(err))
    except (torch.OutOfMemoryError, MemoryError) as err:
        outcome.update(
            status="oom", error=f"out of memory: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        )
    except Exception as err:  # recorded in the result; the suite goes on
        outcome.update(status="failed", error=f"{type(err).__name__}: {err}")
        traceback.print_exc(file=sys.stdout)
    return outcome


def checkpoint_run(request: dict | None, scenario: Scenario) -> CheckpointRun | None:
    """The runner's checkpoint request (``{"out_root", "resume", "attempt"}``) for this scenario."""
    if not request:
        return None
    resume = Path(request["resume"]) if request.get("resume") else None
    return CheckpointRun(policy_for(scenario.spec, Path(request["out_root"])), resume, request.get("attempt", 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run.worker")
    parser.add_argument("scenario_json")
    parser.add_argument("out_json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak (mfu)")
    parser.add_argument("--peak-tflops-fp8", type=float, default=None, help="dense FP8 peak (mfu_fp8 of MXFP8 runs)")
    parser.add_argument("--peak-tflops-source", default=None, help="where the peaks come from (recorded as given)")
    args = parser.parse_args(argv)

    with open(args.scenario_json) as handle:
        payload = json.load(handle)
    scenario = scenario_from_dict(payload["spec"], file=payload.get("file"))
    device, groups = torch.device(args.device), None
    launch = detect_launch() if scenario.mode == "execute" else None
    distributed = launch is not None
    if distributed:
        device = join_launch(launch, device, scenario.run["timeout_s"])
        groups = build_process_groups(Layout(scenario.parallel_config))
    rank = groups.coords.rank if groups else 0
    outcome = execute_outcome(
        scenario,
        device,
        args.peak_tflops,
        groups,
        args.peak_tflops_fp8,
        checkpoint_run(payload.get("checkpoint"), scenario),
        payload.get("project_devices", []),
        peak_source=args.peak_tflops_source,
    )
    if rank == 0:
        with open(args.out_json, "w") as handle:
            json.dump(outcome, handle)
    elif outcome["status"] != "ok":
        Path(f"{args.out_json}.rank{rank}.error").write_text(f"rank {rank}: {outcome['error']}")
    if distributed:
        if outcome["status"] != "ok":
            # Peers may be blocked in a collective with this rank: let torchrun stop them.
            sys.stdout.flush()
            os._exit(1)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
