"""What importing a module loads and configures, seen from a fresh interpreter (pytest's own process has
loaded everything already): the engine needs no transformers, the formulas no torch, and bench sets up
no logging until a command asks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.results import REPO_ROOT


def _fresh(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    "module",
    [
        "moe_engine.interop.olmoe",
        "moe_engine.interop.mixtral",
        "moe_engine.interop.qwen3_moe",
        "moe_engine.interop.deepseek_v3",
    ],
)
def test_engine_imports_without_transformers(module):
    assert _fresh(f"import sys, {module}; print('transformers' in sys.modules)") == "False"


def test_flops_module_loads_no_model():
    """Plans import the formulas for trillion-parameter configs: torch and the model must stay unloaded."""
    loaded = _fresh(
        "import sys, moe_engine.flops; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'moe_engine.model'))"
    )
    assert loaded == "[]"


def test_importing_bench_configures_no_logging():
    code = (
        "import logging, bench.cli, bench.run.runner, bench.validate.variants; "
        "print(logging.getLogger('bench').handlers, logging.getLogger().handlers)"
    )
    assert _fresh(code) == "[] []"
