"""bench/gpu-check.sh runs its `cuda_tests` with MOE_TEST_DEVICE=cuda to run the engine's tests on the
GPU: each of those modules must take the ``device`` fixture (tests/conftest.py) or be marked cuda, else
it runs on the CPU there and checks nothing about the device."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

from bench.results import REPO_ROOT

REPO = REPO_ROOT


def cuda_test_modules(script: str) -> list[Path]:
    """The test modules of the script's `cuda_tests` array (directories: every test_*.py under them)."""
    match = re.search(r"^\s*cuda_tests=\((.*?)\)", script, re.DOTALL | re.MULTILINE)
    assert match, "bench/gpu-check.sh defines the cuda_tests array"
    modules = []
    for entry in shlex.split(match.group(1), comments=True):
        path = REPO / entry
        assert path.exists(), f"cuda_tests names {entry}, which does not exist"
        modules += sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
    return modules


def _is_cuda_mark(node: ast.expr) -> bool:
    """pytest.mark.cuda, called or not."""
    node = node.func if isinstance(node, ast.Call) else node
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "cuda"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    )


def runs_on_the_device(source: str) -> bool:
    """Some test of the module takes the ``device`` fixture, or is marked cuda (itself or by pytestmark)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(_is_cuda_mark(mark) for mark in marks):
                return True
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            arguments = [a.arg for a in node.args.args + node.args.kwonlyargs]
            if "device" in arguments or any(_is_cuda_mark(d) for d in node.decorator_list):
                return True
    return False


def test_every_gpu_check_test_module_runs_on_the_device():
    modules = cuda_test_modules((REPO / "bench" / "gpu-check.sh").read_text())
    assert len(modules) >= 8, modules
    on_the_cpu = [str(m.relative_to(REPO)) for m in modules if not runs_on_the_device(m.read_text())]
    assert on_the_cpu == [], "these run on the CPU under MOE_TEST_DEVICE=cuda: take the device fixture or mark cuda"


def test_the_check_tells_modules_apart():
    assert runs_on_the_device("def test_a(device):\n    pass\n")
    assert runs_on_the_device("import pytest\n@pytest.mark.cuda\ndef test_a():\n    pass\n")
    marked = "import pytest\npytestmark = [pytest.mark.slow, pytest.mark.cuda]\ndef test_a():\n    pass\n"
    assert runs_on_the_device(marked)
    assert not runs_on_the_device("import pytest\n@pytest.mark.slow\ndef test_a(tmp_path):\n    pass\n")
    assert not runs_on_the_device("def helper(device):\n    pass\ndef test_a():\n    pass\n")
    script = "x=1\ncuda_tests=(tests/unit/moe_engine/test_model.py\n            tests/unit/moe_engine/precision)  # comment\nrun_step a b\n"
    found = [m.relative_to(REPO).as_posix() for m in cuda_test_modules(script)]
    assert (
        found[0] == "tests/unit/moe_engine/test_model.py"
        and "tests/unit/moe_engine/precision/test_mxfp8.py" in found[1:]
    )
