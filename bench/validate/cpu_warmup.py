"""Why a CPU run's first steps are slow: GEMM kernels built per shape, and routes that keep making new ones.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.logs import console_logging
from bench.machine import machine_info
from bench.run.trace import rank_trainer
from bench.scenario import load_scenario

logger = logging.getLogger(__name__)

DEFAULT_SCENARIO = "scenarios/smoke/e8-dp2-bf16.yaml"
DEFAULT_OUT = "docs/measurements/cpu-warmup-2core-cpu.json"


def fresh_shape_us(dtype: torch.dtype, shapes: int = 16, first_rows: int = 1009) -> dict[str, float]:
    """First call of a GEMM at a row count not run before against its repeat, medians in microseconds."""
    w_KN = torch.randn(256, 256, dtype=dtype)
    first, repeat = [], []
    for i in range(shapes):
        # Odd, spaced row counts well away from the sizes anything else in the process ran.
        a_MK = torch.randn(first_rows + 7 * i, 256, dtype=dtype)
        start = time.perf_counter()
        torch.mm(a_MK, w_KN)
        middle = time.perf_counter()
        torch.mm(a_MK, w_KN)
        first.append(middle - start)
        repeat.append(time.perf_counter() - middle)
    return {"first_call_us": statistics.median(first) * 1e6, "repeat_us": statistics.median(repeat) * 1e6}


class _GroupShapes(TorchDispatchMode):
    """Collects the (operand shapes and strides, rows) of every expert GEMM a step runs."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The weight gradients added into the gradient buffer are the GEMM _grouped_mm(a^T, b) too.
        accumulated = str(func) == "moe_engine.grouped_wgrad_accumulate.default"
        if func is torch.ops.aten._grouped_mm.default or accumulated:
            a, b = (args[0].t(), args[1]) if accumulated else (args[0], args[1])
            offsets = args[2] if len(args) > 2 else kwargs["offsets_E" if accumulated else "offs"]
            ends = offsets.tolist()
            form = (tuple(a.shape[1:]), tuple(a.stride()), tuple(b.shape[1:]), tuple(b.stride()))
            self.shapes.update((form, end - begin) for begin, end in zip([0, *ends[:-1]], ends))
        return func(*args, **kwargs)


def step_decay(scenario_path: str, steps: int, block: int) -> list[dict[str, Any]]:
    """Median step time and new expert GEMM shapes per step, per block of steps (docs/validation-tools.md);
    each block logged as it ends."""

    scenario = load_scenario(scenario_path)
    times: list[float] = []
    new_shapes: list[int] = []
    seen: set[tuple] = set()
    with rank_trainer(scenario) as (trainer, tokens, labels):
        for step in range(steps):
            mode = _GroupShapes()
            start = time.perf_counter()
            with mode:
                trainer.step(tokens, labels)
            times.append(time.perf_counter() - start)
            new_shapes.append(len(mode.shapes - seen))
            seen |= mode.shapes
            if (step + 1) % block == 0:
                logger.info(
                    f"  steps {step + 2 - block}-{step + 1}: {statistics.median(times[-block:]) * 1e3:.1f} ms, "
                    f"{statistics.fmean(new_shapes[-block:]):.1f} new expert GEMM shapes a step"
                )
    return [
        {
            "steps": [i + 1, min(i + block, steps)],
            "median_step_ms": statistics.median(times[i : i + block]) * 1e3,
            "new_expert_gemm_shapes_per_step": statistics.fmean(new_shapes[i : i + block]),
        }
        for i in range(0, steps, block)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validate.cpu_warmup", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", default=DEFAULT_SCENARIO)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.block < 1:
        logger.error("cpu_warmup: --steps and --block must be positive")
        return 2
    torch.set_num_threads(1)
    fresh = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        fresh[name] = fresh_shape_us(dtype)
        logger.info(
            f"{name} GEMM (M, 256) @ (256, 256) at a new M: first call {fresh[name]['first_call_us']:.0f} us, "
            f"repeat {fresh[name]['repeat_us']:.0f} us"
        )
    logger.info(f"{args.scenario}: rank 0, {args.steps} steps")
    blocks = step_decay(args.scenario, args.steps, args.block)
    report = {
        "command": "python -m bench.validate.cpu_warmup " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": machine_info(),
        "threads": 1,
        "fresh_shape_us": fresh,
        "scenario": args.scenario,
        "blocks": blocks,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    console_logging()
    sys.exit(main())
