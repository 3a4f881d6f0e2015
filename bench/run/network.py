"""The gloo links between local processes: ``bench.validate.netcal`` under torchrun, its alpha and bandwidth."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.run.process import run_with_timeout


def calibrate_network(world_size: int, timeout: float = 300) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moe-netcal-") as tmp:
        out = Path(tmp) / "netcal.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world_size}",
            "--max-restarts=0",
            "-m",
            "bench.validate.netcal",
            str(out),
        ]
        code, tail = run_with_timeout(command, timeout)
        if code != 0 or not out.exists():
            raise RuntimeError(f"network calibration failed (exit {code}): {tail[-1] if tail else 'no output'}")
        return json.loads(out.read_text())
