"""Worker process: execute one scenario and write its metrics as JSON.

    python -m bench.worker SCENARIO_JSON OUT_JSON --device cpu [--peak-tflops X]

Progress lines go to stdout (the runner relays them); the outcome goes to OUT_JSON as
``{"status", "error", "metrics", "details"}``. Exit code 0 whenever OUT_JSON was written.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

from bench.execute import NonFiniteLoss, execute
from bench.scenario import scenario_from_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker")
    parser.add_argument("scenario_json")
    parser.add_argument("out_json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args(argv)

    with open(args.scenario_json) as handle:
        payload = json.load(handle)
    scenario = scenario_from_dict(payload["spec"], file=payload.get("file"))
    outcome = {"status": "ok", "error": None, "metrics": {}, "details": {}}
    try:
        result = execute(
            scenario,
            torch.device(args.device),
            args.peak_tflops,
            progress=lambda line: print(line, flush=True),
        )
        outcome["metrics"], outcome["details"] = result.metrics, result.details
    except NonFiniteLoss as err:
        outcome.update(status="failed", error=str(err))
    except (torch.OutOfMemoryError, MemoryError) as err:
        outcome.update(status="oom", error=f"out of memory: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    except Exception as err:  # recorded in the result; the suite goes on
        outcome.update(status="failed", error=f"{type(err).__name__}: {err}")
        traceback.print_exc(file=sys.stdout)
    with open(args.out_json, "w") as handle:
        json.dump(outcome, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
