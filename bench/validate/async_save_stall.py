"""How long an async checkpoint save stalls training, against a sync save of the same state.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.distributed.checkpoint import FileSystemWriter

from bench.logs import console_logging
from bench.machine import machine_info
from moe_engine import checkpoint
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, Precision, RoutingMode
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

logger = logging.getLogger(__name__)

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype=Precision.FP32,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, routing=RoutingMode.RANDOM, routing_seed=5),
)


def _trainer() -> ParallelTrainer:
    rank_model = build_rank_model(CONFIG, ParallelConfig(), None, torch.device("cpu"), seed=0)
    trainer = ParallelTrainer(rank_model, ParallelConfig(), None, OptimizerConfig(lr=1e-2))
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1), generator=generator)
        trainer.step(tokens[:, :-1], tokens[:, 1:])
    return trainer


def measure(write_delay_s: float, repeats: int, folder: Path) -> dict[str, Any]:
    trainer = _trainer()
    original = FileSystemWriter.write_data

    def delayed_write(self, plan, planner):
        time.sleep(write_delay_s)
        return original(self, plan, planner)

    sync_s, stall_s = [], []
    with mock.patch.object(FileSystemWriter, "write_data", delayed_write):
        for i in range(repeats):
            start = time.perf_counter()
            checkpoint.save(trainer, folder / f"sync-{i}", {"step": 2})
            sync_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            future = checkpoint.async_save(trainer, folder / f"async-{i}", {"step": 2})
            stall_s.append(time.perf_counter() - start)
            future.result()
    sync_median, stall_median = statistics.median(sync_s), statistics.median(stall_s)
    return {
        "write_delay_s": write_delay_s,
        "sync_save_s": sync_s,
        "async_stall_s": stall_s,
        "sync_save_median_s": sync_median,
        "async_stall_median_s": stall_median,
        "stall_ratio": stall_median / sync_median,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m bench.validate.async_save_stall", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--write-delay-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the measurement document here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.write_delay_s < 0:
        logger.error("async_save_stall: --repeats must be positive and --write-delay-s not negative")
        return 2
    with tempfile.TemporaryDirectory(prefix="moe-async-stall-") as folder:
        report = measure(args.write_delay_s, args.repeats, Path(folder))
    sys.stdout.write(
        f"writes delayed {args.write_delay_s:g} s: sync save {report['sync_save_median_s']:.3f} s, async stall "
        f"{report['async_stall_median_s']:.3f} s (medians of {args.repeats}); stall / sync = "
        f"{report['stall_ratio']:.3f}\n"
    )
    if args.out:
        document = {
            "command": " ".join(["python -m bench.validate.async_save_stall", *argv]),
            "machine": machine_info(),
            **report,
        }
        Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    console_logging()
    sys.exit(main())
