"""Worker process: execute one scenario and write its outcome as JSON.
More: docs/step-measurement.md.

Its stdout is the runner's to relay, a line at a time (``bench.run.process.run_with_timeout``): the
``bench`` log records, as plain lines, and whatever else the process writes there.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench.logs import console_logging
from bench.run.execute import ExecuteResult, NonFiniteLoss, execute
from bench.run.launch import detect_launch, join_launch
from bench.run.proxy.run import run_proxy
from bench.run.worker_protocol import WorkerOutcome, WorkerRequest
from bench.scenario import Scenario, scenario_from_dict
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout


def execute_outcome(scenario: Scenario, request: WorkerRequest, device: torch.device, groups) -> WorkerOutcome:
    """Run ``scenario`` on this rank's ``device`` as ``request`` asks; every failure becomes the outcome."""
    result: ExecuteResult | None
    try:
        if scenario.mode == "proxy":
            result = run_proxy(scenario, device, list(request.project_devices))
        else:
            result = execute(scenario, device, request.peaks, groups=groups, checkpointing=request.checkpoint)
    except NonFiniteLoss as err:
        return WorkerOutcome("failed", str(err))
    except (torch.OutOfMemoryError, MemoryError) as err:
        return WorkerOutcome("oom", f"out of memory: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    except Exception as err:  # recorded in the result; the suite goes on
        traceback.print_exc(file=sys.stdout)
        return WorkerOutcome("failed", f"{type(err).__name__}: {err}")
    if result is None:  # a rank other than 0: rank 0 reports for the layout
        return WorkerOutcome("ok")
    return WorkerOutcome("ok", None, result.metrics, result.details)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run.worker")
    parser.add_argument("request_json")
    parser.add_argument("out_json")
    args = parser.parse_args(argv)

    request = WorkerRequest.from_json(Path(args.request_json).read_text())
    scenario = scenario_from_dict(request.spec, file=request.file)
    device, groups = torch.device(request.device), None
    launch = detect_launch() if scenario.mode == "execute" else None
    distributed = launch is not None
    if launch is not None:
        device = join_launch(launch, device, scenario.run.timeout_s)
        groups = build_process_groups(Layout(scenario.parallel_config))
    rank = groups.coords.rank if groups else 0
    outcome = execute_outcome(scenario, request, device, groups)
    if rank == 0:
        Path(args.out_json).write_text(outcome.to_json())
    elif outcome.status != "ok":
        Path(f"{args.out_json}.rank{rank}.error").write_text(f"rank {rank}: {outcome.error}")
    if distributed:
        if outcome.status != "ok":
            # Peers may be blocked in a collective with this rank: let torchrun stop them.
            sys.stdout.flush()
            os._exit(1)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    console_logging(stream=sys.stdout)
    sys.exit(main())
