"""bench/gpu-check.sh runs the tests marked cuda with MOE_TEST_DEVICE=cuda; tests/conftest.py marks every test
taking the ``device`` fixture under that setting, so each test that runs on the device is selected, and no
test that would run on the CPU there."""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys

from bench.results import REPO_ROOT

# One module of each kind: tests taking the device fixture, and tests marked cuda by hand.
DEVICE_MODULE = "tests/unit/moe_engine/moe/test_grouped_gemm.py"
MARKED_MODULE = "tests/unit/moe_engine/test_cuda.py"


def gpu_check_pytest_command(script: str) -> list[str]:
    """The words of gpu-check's GPU test command (the one run with MOE_TEST_DEVICE=cuda)."""
    lines = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    commands = [line for line in lines if "MOE_TEST_DEVICE=cuda" in line and "pytest" in line]
    assert len(commands) == 1, commands
    line = commands[0].strip()
    return shlex.split(line[line.index("(") + 1 : line.rindex(")")])


def _is_cuda_mark(node: ast.expr) -> bool:
    node = node.func if isinstance(node, ast.Call) else node
    return isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Attribute)


def expected_selection(source: str, on_cuda: bool) -> set[str]:
    """Names of the module's tests that ``-m cuda`` must select: marked cuda, or (on_cuda) taking ``device``."""
    body = ast.parse(source).body
    whole_module = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and any(_is_cuda_mark(m) for m in (node.value.elts if isinstance(node.value, ast.List) else [node.value]))
        for node in body
    )
    selected = set()
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            arguments = [a.arg for a in node.args.args]
            marked = whole_module or any(_is_cuda_mark(d) for d in node.decorator_list)
            if marked or (on_cuda and "device" in arguments):
                selected.add(node.name)
    return selected


def collected(module: str, on_cuda: bool) -> set[str]:
    """Test names pytest selects with ``-m cuda`` in ``module``, with or without MOE_TEST_DEVICE=cuda."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_TEST_DEVICE"}
    if on_cuda:
        env["MOE_TEST_DEVICE"] = "cuda"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", module],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]  # 5: nothing selected
    return {line.split("::")[1].split("[")[0] for line in done.stdout.splitlines() if "::" in line}


def test_gpu_check_selects_the_gpu_tests_by_the_cuda_marker():
    words = gpu_check_pytest_command((REPO_ROOT / "bench" / "gpu-check.sh").read_text())
    assert words[:2] == ["env", "MOE_TEST_DEVICE=cuda"], words
    after_pytest = words[words.index("pytest") + 1 :]
    assert after_pytest[after_pytest.index("-m") + 1] == "cuda", words
    assert words[-1] == "tests", words


def test_under_moe_test_device_cuda_every_device_test_is_selected_and_nothing_else():
    for module in (DEVICE_MODULE, MARKED_MODULE):
        source = (REPO_ROOT / module).read_text()
        want = expected_selection(source, on_cuda=True)
        assert want, f"{module} has no test for the GPU"
        assert collected(module, on_cuda=True) == want, module


def test_without_it_only_the_tests_marked_by_hand_are_cuda_tests():
    device_tests = (REPO_ROOT / DEVICE_MODULE).read_text()
    assert collected(DEVICE_MODULE, on_cuda=False) == expected_selection(device_tests, on_cuda=False)
    marked = (REPO_ROOT / MARKED_MODULE).read_text()
    assert collected(MARKED_MODULE, on_cuda=False) == expected_selection(marked, on_cuda=False) != set()


def test_the_expectation_tells_tests_apart():
    source = (
        "import pytest\n"
        "def test_a(device):\n    pass\n"
        "@pytest.mark.cuda\ndef test_b():\n    pass\n"
        "def test_c(tmp_path):\n    pass\n"
        "def helper(device):\n    pass\n"
    )
    whole = "import pytest\npytestmark = [pytest.mark.slow, pytest.mark.cuda]\ndef test_d():\n    pass\n"
    assert expected_selection(whole, on_cuda=False) == {"test_d"}
    assert expected_selection(source, on_cuda=True) == {"test_a", "test_b"}
    assert expected_selection(source, on_cuda=False) == {"test_b"}
