""".ci/run fails fast: a copy of the script runs with every tool it calls replaced by a stub on PATH that
records its arguments, so the order is the script's own, executed, and a failing step stops it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from bench.results import REPO_ROOT

STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CI_LOG"
if [ "$(basename "$0") $1" = "python3 -m" ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && : > "$3/bin/activate"
fi
if [ "$(basename "$0")" = moe-bench ] && [ "$1" = release ]; then
  echo 0.3.0
fi
case "$(basename "$0") $*" in
  "$CI_FAIL"*) exit 1 ;;
esac
exit 0
"""
TOOLS = ("python3", "python", "ruff", "mypy", "moe-bench", "chromium", "chromedriver", "apt-get")
"""Every command .ci/run runs that is not a shell builtin or a coreutil (chromium and its driver
present: nothing is installed)."""

ORDER = [
    "ruff check .",
    "ruff format --check .",
    "mypy",
    "python -m pytest -m not slow --durations=15",
    "python -m bench.validate.kernel_compile",
    "python -m pytest -m slow --durations=30",
    "moe-bench report results --out docs/report --screenshot docs/report.png",
    "moe-bench release --latest",
    "moe-bench ab --suite ci --tolerance 4.5% --warn-above 3% --budget 45 --deadline 570",
]


def run_ci(tmp_path: Path, fail: str = "-no such command-") -> tuple[int, list[str]]:
    """Run a copy of .ci/run in an empty tree with stub tools; its return code and the steps it ran
    (installs left out); ``fail``: the stub whose command line starts with it exits 1."""
    tree, stubs = tmp_path / "tree", tmp_path / "stubs"
    (tree / ".ci").mkdir(parents=True)
    stubs.mkdir()
    shutil.copy2(REPO_ROOT / ".ci" / "run", tree / ".ci" / "run")
    for tool in TOOLS:
        (stubs / tool).write_text(STUB)
        (stubs / tool).chmod((stubs / tool).stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "log"
    log.touch()
    env = {
        "PATH": f"{stubs}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "CI_LOG": str(log),
        "CI_FAIL": fail,
        "HOME": str(tmp_path),
    }
    done = subprocess.run(["bash", str(tree / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    lines = [line.rstrip() for line in log.read_text().splitlines()]
    steps = [line for line in lines if not line.startswith(("python3", "python -m pip", "python -c"))]
    # The gate's acceptances of unreleased changes come and go with releases: the step is its command.
    steps = [line.split(" --accept ")[0] for line in steps]
    return done.returncode, [line for line in steps if not line.startswith(("chromium", "chromedriver"))]


def test_ci_runs_the_cheap_checks_first_then_the_tests_the_report_and_the_gate(tmp_path):
    code, steps = run_ci(tmp_path)
    assert code == 0 and steps == ORDER


@pytest.mark.parametrize(
    "failing, last",
    [
        ("ruff check", "ruff check ."),
        ("ruff format", "ruff format --check ."),
        ("mypy", "mypy"),
        ("python -m pytest -m not slow", "python -m pytest -m not slow --durations=15"),
        ("python -m bench.validate.kernel_compile", "python -m bench.validate.kernel_compile"),
        ("python -m pytest -m slow", "python -m pytest -m slow --durations=30"),
    ],
)
def test_a_failing_step_stops_ci_before_anything_after_it(tmp_path, failing, last):
    code, steps = run_ci(tmp_path, fail=failing)
    assert code != 0 and steps == ORDER[: ORDER.index(last) + 1]
