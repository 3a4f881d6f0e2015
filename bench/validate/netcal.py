"""Measure the alpha-beta constants of the links between this machine's ranks (a torchrun module).
More: docs/validation-tools.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

SMALL, LARGE = 1 << 10, 1 << 24  # bytes
REPEATS = 15


def _time(op, nbytes: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    out = torch.empty_like(x)
    times = []
    for i in range(REPEATS + 3):
        dist.barrier()
        start = time.perf_counter()
        if op == "all_reduce":
            dist.all_reduce(x)
        else:
            dist.all_to_all_single(out, x)
        elapsed = time.perf_counter() - start
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    samples = {op: {size: _time(op, size) for size in (SMALL, LARGE)} for op in ("all_reduce", "all_to_all")}
    if dist.get_rank() == 0:
        ring = (n - 1) / n
        alpha = min(samples["all_reduce"][SMALL] / (2 * (n - 1)), samples["all_to_all"][SMALL] / (n - 1))
        slopes = [
            2 * ring * (LARGE - SMALL) / (samples["all_reduce"][LARGE] - samples["all_reduce"][SMALL]),
            ring * (LARGE - SMALL) / (samples["all_to_all"][LARGE] - samples["all_to_all"][SMALL]),
        ]
        result = {
            "latency_us": alpha * 1e6,
            "gbps": statistics.mean(slopes) / 1e9,
            "world_size": n,
            "samples": {op: {str(k): v for k, v in s.items()} for op, s in samples.items()},
        }
        with open(argv[0], "w") as handle:
            json.dump(result, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
