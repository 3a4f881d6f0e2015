"""What the repository tracks and tells a new user: no generated artefacts, install commands that work."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess

import pytest

from bench.results import REPO_ROOT

# Written by commands on every run: committing them freezes one run's output next to code that has
# moved on (results under results/<version>/ are measurements and are committed on purpose).
GENERATED = [
    "moe-bench-export*",
    "results/plots/*",
    "results/report/*",
    "bench/engine.json",
    "gpu-check-out/*",
    "*.egg-info/*",
    "docs/report/*",
    "docs/report.png",
]


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_no_generated_artefact_is_tracked():
    tracked = [f for f in tracked_files() if any(fnmatch.fnmatch(f, pattern) for pattern in GENERATED)]
    assert tracked == []


def test_readme_installs_the_cpu_build_of_the_ci_pin():
    """The README's install line gets the CPU wheel on any machine, at the version .ci/run pins."""
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    pin = re.search(r"pip install --quiet (torch==[\d.]+)", ci)[1]
    lines = [line for line in readme.splitlines() if re.match(r"\s*pip install torch", line)]
    assert lines, "the README has no torch install line"
    for line in lines:
        assert pin in line and "--index-url https://download.pytorch.org/whl/cpu" in line, line
