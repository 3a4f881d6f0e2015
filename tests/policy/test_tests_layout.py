"""The shape of ``tests/`` (tests/README.md): unit tests mirror the packages, whatever starts processes is an
integration test, and test modules share helpers through ``tests/support`` only."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys

from bench.results import REPO_ROOT

TESTS = REPO_ROOT / "tests"
INTEGRATION_KINDS = {"distributed", "workers", "toolchains", "imports", "docker", "browser"}
# What only an integration test may use: gloo ranks, Docker images, a browser, torchrun.
PROCESS_STARTERS = re.compile(
    r"^\s*(from|import) (distributed_harness|image_build|selenium)\b|[\[,]\s*\"torch\.distributed\.run\"", re.M
)
# Modules of the split packages with no test module of their own, and why.
UNTESTED: dict[str, str] = {}


def _test_modules(folder):
    return sorted(p for p in folder.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_unit_folders_mirror_the_packages():
    for folder in sorted(p for p in (TESTS / "unit").rglob("*") if p.is_dir() and p.name != "__pycache__"):
        package = REPO_ROOT / folder.relative_to(TESTS / "unit")
        assert (package / "__init__.py").exists(), f"{folder.relative_to(REPO_ROOT)} mirrors no package"


def test_integration_tests_are_sorted_by_kind():
    folders = {p.name for p in (TESTS / "integration").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == INTEGRATION_KINDS


def test_unit_tests_start_no_ranks_images_or_browsers():
    offenders = [
        str(p.relative_to(REPO_ROOT)) for p in _test_modules(TESTS / "unit") if PROCESS_STARTERS.search(p.read_text())
    ]
    assert offenders == [], "these start processes: move the tests that do to tests/integration"


PLANTED_UNIT_TESTS = """
import os, subprocess, sys
import pytest

@pytest.fixture(scope="module")
def child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_an_interpreter_in_a_fixture(child):
    pass

def test_an_interpreter_in_the_test():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_a_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def test_git_answers_a_fact():
    subprocess.run(["git", "--version"], check=True, capture_output=True)
"""


def test_a_unit_test_that_starts_a_process_fails(tmp_path):
    """The rule's runtime half (tests/unit/conftest.py), on planted unit tests in a copy of the folder."""
    unit = tmp_path / "unit"
    unit.mkdir()
    shutil.copy(TESTS / "unit" / "conftest.py", unit / "conftest.py")
    (unit / "test_planted.py").write_text(PLANTED_UNIT_TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(unit), "-q", "-rA", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    outcomes = {test: outcome for outcome, test in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", done.stdout, re.M)}
    assert outcomes == {
        "test_an_interpreter_in_a_fixture": "ERROR",
        "test_an_interpreter_in_the_test": "FAILED",
        "test_a_fork": "FAILED",
        "test_git_answers_a_fact": "PASSED",
    }, done.stdout
    assert "tests that start processes go under tests/integration" in done.stdout


def test_no_test_module_imports_another():
    offenders = []
    for path in _test_modules(TESTS) + _test_modules(REPO_ROOT / "bench" / "micro"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [f"{path.relative_to(REPO_ROOT)}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert offenders == [], "shared test helpers live in tests/support"


def test_every_gate_and_command_module_has_its_test_module():
    missing = []
    for package in ("gate", "commands"):
        for module in sorted((REPO_ROOT / "bench" / package).glob("*.py")):
            name = f"bench/{package}/{module.name}"
            if module.name == "__init__.py" or name in UNTESTED:
                continue
            if not (TESTS / "unit" / "bench" / package / f"test_{module.name}").exists():
                missing.append(name)
    assert missing == []


def test_the_readme_names_every_folder_of_tests():
    readme = (TESTS / "README.md").read_text()
    folders = ["unit", "integration", "policy", "support", *(f"integration/{k}" for k in sorted(INTEGRATION_KINDS))]
    assert [f for f in folders if f"tests/{f}" not in readme] == []
