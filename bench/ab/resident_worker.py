"""One side of the A/B gate, resident: built and warmed once, then timed block by block on command.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_setting(scenario, name: str):
    """A ``run:`` setting of the scenario as the side's own loader gives it: a typed ``RunConfig`` on
    this tree, a plain dict on releases up to 0.2.0 (this script runs on both)."""
    run = scenario.run
    return run[name] if isinstance(run, dict) else getattr(run, name)


def _reply(message: dict) -> None:
    stdout = sys.__stdout__
    assert stdout is not None  # the gate starts the worker with a stdout pipe
    stdout.write(json.dumps(message) + "\n")
    stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resident_worker.py")
    parser.add_argument("scenario_json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    sys.stdout = sys.stderr  # keep stdout for the protocol

    # The side's own code, imported once stdout is the protocol's: whatever it prints goes to stderr.
    import torch.distributed as dist

    from bench.scenario import scenario_from_dict
    from moe_engine.parallel.groups import build_process_groups
    from moe_engine.parallel.layout import Layout
    from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

    payload = json.loads(Path(args.scenario_json).read_text())
    scenario = scenario_from_dict(payload["spec"], payload["file"])
    world = scenario.world_size
    children: list[subprocess.Popen] = []
    groups = None
    if world > 1:
        port = args.port or _free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(args.rank))
        if args.rank == 0:
            for rank in range(1, world):
                children.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            args.scenario_json,
                            "--device",
                            args.device,
                            "--rank",
                            str(rank),
                            "--port",
                            str(port),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=sys.stderr,
                    )
                )
        dist.init_process_group("gloo", timeout=timedelta(seconds=payload.get("timeout_s", 600)))
        groups = build_process_groups(Layout(scenario.parallel_config))

    device = torch.device(args.device)
    config, parallel = scenario.model, scenario.parallel_config
    seed = scenario.spec["routing"]["seed"]
    try:
        from bench.run.execute import build_trainer
    except ImportError:  # a baseline from before recompute, compile and clipping
        rank_model = build_rank_model(config, parallel, groups, device, seed=seed)
        trainer = ParallelTrainer(rank_model, parallel, groups)
    else:
        rank_model, trainer = build_trainer(scenario, groups, device)
    gemms: contextlib.AbstractContextManager
    try:
        from moe_engine.precision.cpu_bf16 import bf16_gemms_in_fp32
    except ImportError:  # a baseline from before it: its bf16 GEMMs run as ATen runs them
        gemms = contextlib.nullcontext()
    else:
        # As ``moe-bench run`` times its steps (bf16 GEMMs in fp32 on a CPU without bf16 arithmetic).
        gemms = bf16_gemms_in_fp32(device, config.dtype.torch_dtype)
    dp_rank = groups.coords.dp_rank if groups else 0
    sequences = _run_setting(scenario, "tokens_per_step") // config.seq_len
    per_rank = sequences // parallel.dp

    def run_block(steps: int) -> tuple[float, list[float]]:
        for module in rank_model.module.modules():
            reset = getattr(module, "reset_routing_generator", None)
            if reset is not None:
                reset()
        generator = torch.Generator().manual_seed(seed + 12345)
        batches = []
        for _ in range(steps):
            tokens = torch.randint(0, config.vocab_size, (sequences, config.seq_len + 1), generator=generator)
            batches.append(tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(device))
        if groups:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with gemms:
            losses = [trainer.step(tokens[:, :-1], tokens[:, 1:]) for tokens in batches]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if groups:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed), [float(loss) for loss in losses if loss is not None]

    run_block(_run_setting(scenario, "warmup_steps") or 1)
    if args.rank == 0:
        _reply({"ready": True, "ranks": world})
    try:
        while True:
            if args.rank == 0:
                line = sys.stdin.readline()
                command = json.loads(line) if line.strip() else {"stop": True}
            else:
                command = None
            if groups:
                box = [command]
                dist.broadcast_object_list(box, src=0)
                command = box[0]
            assert command is not None  # rank 0's, broadcast to the others
            if command.get("stop"):
                break
            seconds, losses = run_block(int(command["block"]))
            if args.rank == 0:
                _reply({"seconds": seconds, "losses": losses})
    finally:
        if groups:
            dist.destroy_process_group()
        for child in children:
            child.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
