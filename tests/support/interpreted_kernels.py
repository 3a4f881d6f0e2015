"""``run_interpreted``: the Triton kernels on CPU tensors under Triton's interpreter, in a child process
(``interpreter_child.py``: Triton decides between compiling and interpreting when a kernel is defined,
so TRITON_INTERPRET=1 must be set before the import)."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from fused_cases import SEED

from bench.results import REPO_ROOT

SUPPORT = Path(__file__).resolve().parent


def interpreter_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child under Triton's interpreter: the repository and this folder
    first on its import path."""
    path = os.pathsep.join([str(REPO_ROOT), str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, **extra)


def run_interpreted(folder: Path, inputs: dict) -> dict:
    """The child's outputs for ``inputs``, run with TRITON_INTERPRET=1 (the same MOE_KERNEL_SEED)."""
    inputs_path, outputs_path = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(inputs, inputs_path)
    env = interpreter_env(MOE_KERNEL_SEED=str(SEED))
    command = [sys.executable, str(SUPPORT / "interpreter_child.py"), str(inputs_path), str(outputs_path)]
    run = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(outputs_path)
