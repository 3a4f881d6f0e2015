"""The shape of ``tests/`` (tests/README.md): unit tests mirror the packages, whatever starts processes is an
integration test, and test modules share helpers through ``tests/support`` only."""

from __future__ import annotations

import ast
import re

from bench.results import REPO_ROOT

TESTS = REPO_ROOT / "tests"
INTEGRATION_KINDS = {"distributed", "workers", "docker", "browser"}
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
