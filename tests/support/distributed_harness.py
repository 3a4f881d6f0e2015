"""Run a function on N gloo ranks in fresh processes, with a timeout and cleanup of every process.

``run_ranks(fn, world_size, *args)`` returns ``[fn(*args) on rank 0, ..., on rank N-1]``. ``fn``
must be a module-level function (the ranks are spawned, so it is imported by name); results travel
back through ``torch.save`` files, so tensors of any size are fine. A rank that raises makes the
call fail with that rank's traceback; a rank that hangs makes it fail after ``timeout`` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch


class RankFailure(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, port, out_dir, args, timeout):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    path = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="moe-ranks-") as out_dir:
        procs = [
            context.Process(target=_rank_main, args=(fn, r, world_size, port, out_dir, args, timeout), daemon=True)
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            outcomes = {}
            for r in range(world_size):
                path = Path(out_dir) / f"rank{r}.pt"
                if path.exists():
                    outcomes[r] = torch.load(path, weights_only=False)
            failed = [(r, o["error"]) for r, o in sorted(outcomes.items()) if not o["ok"]]
            if failed:
                rank, error = failed[0]
                raise RankFailure(f"rank {rank} failed:\n{error}")
            if hung:
                raise RankFailure(f"ranks {hung} did not finish within {timeout:g} s")
            missing = [r for r in range(world_size) if r not in outcomes]
            if missing:
                codes = {r: procs[r].exitcode for r in missing}
                raise RankFailure(f"ranks {missing} died without a result (exit codes {codes})")
            return [outcomes[r]["result"] for r in range(world_size)]
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
