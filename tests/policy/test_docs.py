"""Every command the documentation shows is checked, so that the docs cannot go stale.

The docs are README.md, CHANGELOG.md and docs/**/*.md. Every command line of their fenced shell blocks
(bash, sh, shell) is checked by what it would run:

- ``moe-bench ...`` (also ``torchrun ... -m bench.cli ...`` and what follows ``docker compose run --rm
  bench``): parsed by moe-bench's own parser, reached through the ``moe-bench`` entry point's
  ``main(argv)`` and stopped right after parsing. Every scenario file or folder it names exists and
  loads (schema and layout), every suite is in scenarios/suites.yaml, every device profile loads,
  every results folder and release ref exists. Placeholders (``<...>``, ``DIR``, ``X.Y.Z``) are
  parsed but not looked up.
- ``python -m MODULE ...``: the module imports and its ``main(argv)`` parses the arguments with its
  own parser (stopped the same way); the folders it would write into exist. ``python -m pytest``
  with paths collects them.
- Everything else (docker, pip, git, torchrun, scripts) is never run; what can be checked without
  running it is (the compose service, the script, the install extra, the torch pin).

RUN lists the quick read-only commands that really run (through the same entry point, outputs
redirected to a temporary folder) with what their output must show; NOT_RUN gives, for every other
kind of command, the reason it is not run. A command of a kind in neither fails the test.

Beside the commands: relative links between pages resolve (anchors included), repository paths named
in inline code exist, Python blocks compile with imports that resolve and calls that bind to the
callees' signatures, YAML blocks hold only scenario fields the schema accepts, and a block without a
shell language holds no command.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import fnmatch
import importlib
import importlib.metadata
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import pytest
import yaml
from packaging.version import Version

from bench.results import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell"}


# ---------------------------------------------------------------------------------------------------
# Reading the pages


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str
    """The page, relative to the repository root."""
    line: int
    """Line number of the block's first line of content."""
    language: str
    """The fence's info string, lower case ('' when none)."""
    text: str
    """The content, dedented by the fence's own indentation."""


@dataclass(frozen=True)
class Command:
    """One command of a shell block: its words as the shell would split them."""

    page: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return shlex.join(self.words)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}: {self}"[:140]


FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[\w+-]*)")


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    name = str(page.relative_to(REPO_ROOT))
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        closing = re.compile(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, j = [], i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][indent:] if not lines[j][:indent].strip() else lines[j])
            j += 1
        blocks.append(Block(name, i + 2, opening["info"].lower(), "\n".join(body)))
        i = j + 1
    return blocks


def prose_of(page: Path) -> str:
    """The page without its fenced blocks (each replaced by blank lines, so line numbers hold)."""
    kept, inside = [], None
    for line in page.read_text().splitlines():
        fence = FENCE.match(line)
        if inside is None and fence:
            inside = fence["fence"]
            kept.append("")
        elif inside is not None:
            if re.fullmatch(rf"\s*{re.escape(inside[0])}{{{len(inside)},}}\s*", line):
                inside = None
            kept.append("")
        else:
            kept.append(line)
    return "\n".join(kept)


SUBSTITUTION = re.compile(r"\$\([^)]*\)")
SEPARATORS = {";", "&&", "||", "|", "&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def commands_of(block: Block) -> Iterator[Command]:
    """Each command of a shell block: continuations joined, comments, `&&`/`;` lists, leading
    variable assignments and `time` taken apart as the shell would."""
    logical: list[tuple[int, str]] = []
    pending, start = "", None
    for offset, raw in enumerate(block.text.splitlines()):
        start = block.line + offset if start is None else start
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        logical.append((start, pending + raw))
        pending, start = "", None
    for line, text in logical:
        lexer = shlex.shlex(SUBSTITUTION.sub("SUBSTITUTED", text), posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SEPARATORS:
                words.append(token)
                continue
            while words and (ASSIGNMENT.match(words[0]) or words[0] == "time"):
                words.pop(0)
            if words:
                yield Command(block.page, line, tuple(words))
            words = []


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
COMMANDS = [command for block in BLOCKS if block.language in SHELL_LANGUAGES for command in commands_of(block)]


def is_placeholder(word: str) -> bool:
    """`<scenario>.yaml`, `results/0.1.0/<machine>`, `DIR`, `devices/NAME.yaml`, `X.Y.Z`: the reader's own."""
    parts = set(re.split(r"[/.]", word)) - {"README", "CHANGELOG"}
    return "<" in word or ">" in word or any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in parts)


def ignored_by_git(path: str) -> bool:
    """Whether .gitignore covers the path: written by a command (the report page, the image's version
    record), named in the docs but absent from a checkout."""
    for pattern in (REPO_ROOT / ".gitignore").read_text().splitlines():
        if not pattern.strip() or pattern.startswith("#"):
            continue
        anchored, pattern = pattern.startswith("/"), pattern.strip().strip("/")
        if (
            path == pattern
            or path.startswith(pattern + "/")
            or fnmatch.fnmatch(path, pattern)
            or (not anchored and fnmatch.fnmatch(Path(path).name, pattern))
        ):
            return True
    return False


# ---------------------------------------------------------------------------------------------------
# What the named things must be


def check_scenarios(paths: list[str]) -> None:
    from bench.run.suites import expand_paths
    from bench.scenario import ScenarioError, load_scenario

    for path in paths:
        if is_placeholder(path):
            continue
        assert (REPO_ROOT / path).exists(), f"{path}: no such scenario file or folder"
        files = expand_paths([REPO_ROOT / path])
        assert files, f"{path}: a folder without scenario files"
        for file in files:
            try:
                load_scenario(file)
            except ScenarioError as err:
                pytest.fail(f"{path}: does not load: {err}")


def check_suite(name: str | None) -> None:
    import torch

    from bench.run.suites import suite_files
    from bench.scenario import ScenarioError

    if name is None:
        return
    try:
        files = [f for kind in ("cpu", "cuda") for f in suite_files(name, torch.device(kind))]
    except ScenarioError as err:
        pytest.fail(f"--suite {name}: {err}")
    assert files, f"--suite {name}: the suite lists no scenario file"


def check_devices(names: list[str] | str | None) -> None:
    from bench.predict.device import ProfileError, load_profile

    for name in [names] if isinstance(names, str) else names or []:
        if is_placeholder(name):
            continue
        try:
            load_profile(REPO_ROOT / name if name.endswith((".yaml", ".yml")) else name)
        except ProfileError as err:
            pytest.fail(f"device {name}: {err}")


def check_results_folder(path: str | None) -> None:
    if path is None or is_placeholder(path):
        return
    assert (REPO_ROOT / path).is_dir(), f"{path}: no such results folder"


def recorded_releases() -> list[dict[str, Any]]:
    return json.loads((REPO_ROOT / "releases.json").read_text())["releases"]


def check_release_ref(ref: str | None) -> None:
    if ref is None or is_placeholder(ref):
        return
    versions = [release["version"] for release in recorded_releases()]
    assert ref.startswith("v") and ref[1:] in versions, f"--baseline-ref {ref}: no recorded release {ref[1:]!r}"


def check_output_folder(path: str | None) -> None:
    """A file a command writes into the repository goes into a folder that exists."""
    if path is None or is_placeholder(path) or Path(path).is_absolute():
        return
    assert (REPO_ROOT / path).parent.is_dir(), f"{path}: its folder does not exist"


# For each moe-bench command, the parsed arguments that name something that must exist.
NAMED: dict[str, dict[str, Callable[[Any], None]]] = {
    "run": {"files": check_scenarios, "suite": check_suite, "project_on": check_devices},
    "plan": {"files": check_scenarios},
    "project": {"files": check_scenarios, "device": check_devices, "fallback_device": check_devices},
    "ab": {"files": check_scenarios, "suite": check_suite, "baseline_ref": check_release_ref},
    "proxy-check": {"files": check_scenarios, "device_profile": check_devices, "json": check_output_folder},
    "compare": {"base": check_results_folder, "cand": check_results_folder},
    "gate": {"baseline": check_results_folder, "candidate": check_results_folder},
    "report": {"results": check_results_folder},
    "plot": {"results_dir": check_results_folder},
    "export": {"results": check_results_folder},
    "versions": {"suite": check_suite},
    "profile-device": {"base": check_devices},
}
# The same, by argument name, for the `python -m` tools' own parsers.
NAMED_BY_TOOLS: dict[str, Callable[[Any], None]] = {
    "files": check_scenarios,
    "suite": check_suite,
    "out": check_output_folder,
    "json": check_output_folder,
}


# ---------------------------------------------------------------------------------------------------
# Parsing with a command's own parser


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parsed_by_own_parser(main: Callable[[list[str]], Any], argv: list[str], what: str) -> argparse.Namespace:
    """Call `main(argv)` and stop it as soon as its argparse parser has parsed `argv`: the arguments are
    checked by the real parser, and nothing runs."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    stderr = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), contextlib.redirect_stderr(stderr):
        try:
            main(list(argv))
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit:
            pytest.fail(f"{what}: its parser refuses the arguments: {stderr.getvalue().strip()}")
    pytest.fail(f"{what}: main() returned without parsing its arguments")


def moe_bench_main() -> Callable[[list[str]], Any]:
    (entry,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "moe-bench"]
    return entry.load()


def parse_moe_bench(argv: list[str]) -> tuple[str, argparse.Namespace]:
    namespace = parsed_by_own_parser(moe_bench_main(), argv, "moe-bench " + shlex.join(argv))
    command = argv[0] if argv else "run"
    for dest, check in NAMED.get(command, {}).items():
        assert hasattr(namespace, dest), f"moe-bench {command} has no argument {dest!r} any more: update NAMED"
        check(getattr(namespace, dest))
    return command, namespace


# ---------------------------------------------------------------------------------------------------
# Commands that really run, and what their output must show


def first_group(pattern: str, text: str) -> str:
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"no line matches {pattern!r}"
    return match[1]


def releases_by_version() -> list[str]:
    return sorted((release["version"] for release in recorded_releases()), key=Version)


def expect_version(argv, code, out, err) -> None:
    assert code == 0
    (line,) = out.splitlines()
    pyproject = first_group(r'^version = "([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert Version(line).base_version in {pyproject, *releases_by_version()}, line


def expect_release_list(argv, code, out, err) -> None:
    assert code == 0
    if "--latest" in argv:
        assert out.strip() == releases_by_version()[-1]
        return
    for release in recorded_releases():
        assert re.search(rf"^{re.escape(release['version'])}\s+{release['commit']}", out, re.MULTILINE), release


def expect_plans(argv, code, out, err) -> None:
    from bench.run.suites import expand_paths

    assert code == 0, err
    files = expand_paths([REPO_ROOT / path for path in parse_moe_bench(list(argv))[1].files])
    summaries = [line for line in out.splitlines() if re.search(r" parameters \(.* active\)", line)]
    assert len(summaries) == len(files), out
    assert re.search(rf"^{len(files)} scenarios, 0 not ok", out, re.MULTILINE), out


def _scenario_names(folder: str) -> set[str]:
    return {f.name.split(".")[0] for f in (REPO_ROOT / folder).glob("*.json")}


def expect_gate(argv, code, out, err) -> None:
    namespace = parse_moe_bench(list(argv))[1]
    shared = _scenario_names(namespace.baseline) & _scenario_names(namespace.candidate)
    assert code in (0, 1), err
    assert re.match(rf"(PASS|FAIL): {len(shared)} scenario\(s\) compared", out), out
    assert out.startswith("PASS") == (code == 0)


def expect_comparison(argv, code, out, err) -> None:
    shared = _scenario_names(argv[1]) & _scenario_names(argv[2])
    assert code in (0, 1), err
    assert shared and all(name in out for name in shared), out


def expect_report(argv, code, out, err) -> None:
    namespace = parse_moe_bench(list(argv))[1]
    assert code == 0, err
    page = (Path(namespace.out) / "index.html").read_text()
    versions = (
        [namespace.base, namespace.new]
        if namespace.base
        else [
            folder.name
            for folder in (REPO_ROOT / namespace.results).iterdir()
            if folder.is_dir() and folder.name != "report"
        ]
    )
    assert versions and all(version in page for version in versions), versions
    assert '<script src="http' not in page  # self-contained: opens from a file with no network


@dataclass(frozen=True)
class Quick:
    """A read-only moe-bench command that takes seconds, run for real."""

    applies: Callable[[argparse.Namespace], bool]
    """Whether this parsed command is the quick kind (a release *list*, a report without a browser)."""
    expect: Callable[..., None]
    """Checks (argv, exit code, stdout, stderr)."""
    redirect: tuple[str, ...] = ()
    """Options pointed at a temporary folder, so that running writes nothing into the repository."""


RUN: dict[str, Quick] = {
    "version": Quick(lambda a: True, expect_version),
    "release": Quick(lambda a: a.version is None and not a.accept, expect_release_list),
    "plan": Quick(lambda a: True, expect_plans, redirect=("--out",)),
    "gate": Quick(lambda a: True, expect_gate),
    "compare": Quick(lambda a: True, expect_comparison),
    "report": Quick(lambda a: a.screenshot is None, expect_report, redirect=("--out",)),
}

NOT_RUN = {
    "moe-bench run": "runs scenarios for real: a suite takes minutes to an hour",
    "moe-bench ab": "runs two checkouts side by side for up to a minute of blocks per scenario",
    "moe-bench project": "traces a rank's full-size step under fake tensors: minutes",
    "moe-bench proxy-check": "real multi-rank runs and their proxies: tens of minutes",
    "moe-bench profile-device": "measures this machine for minutes and writes a device profile",
    "moe-bench micro": "timing benchmarks",
    "moe-bench versions": "needs a Docker engine and the release images",
    "moe-bench plot": "draws a PNG per scenario and machine: about half a minute",
    "moe-bench export": "writes moe-bench-export* files into the working directory",
    "moe-bench release VERSION": "records a release: writes releases.json and tags HEAD",
    "moe-bench report --screenshot": "needs headless Chromium (tests/integration/browser/test_report_browser.py drives it)",
    "python -m pytest": "the test suite or the timed micro-benchmarks: CI runs them; here they are collected",
    "python -m bench.validate": "measurements that take minutes to an hour",
    "python -m venv": "creates a virtual environment",
    ".": "activates the virtual environment the command before creates",
    "pip install": "installs packages from the network",
    "docker": "needs a Docker engine and builds an image (minutes)",
    "torchrun": "starts a multi-process launch",
    "git": "commits, tags and pushes",
    "bench/gpu-check.sh": "needs a CUDA GPU (its --dry-run is run by tests/integration/workers/test_gpu_check.py)",
    ".ci/run": "is CI itself: a fresh virtual environment, the whole suite and the A/B gate",
}


def not_run_reason(kind: str) -> str:
    reason = next(
        (
            NOT_RUN[key]
            for key in sorted(NOT_RUN, key=len, reverse=True)
            if kind == key or kind.startswith((key + " ", key + "."))
        ),
        None,
    )
    assert reason, f"{kind!r}: a kind of command the docs test does not know: add it to RUN or NOT_RUN"
    return reason


# ---------------------------------------------------------------------------------------------------
# Checking each kind of command


def check_moe_bench(argv: list[str], tmp_path: Path, capsys, may_run: bool = True) -> None:
    command, namespace = parse_moe_bench(argv)
    quick = RUN.get(command)
    if not (quick and quick.applies(namespace)):
        kind = {"release": "moe-bench release VERSION", "report": "moe-bench report --screenshot"}.get(command)
        not_run_reason(kind or f"moe-bench {command}")
        return
    if not may_run:
        return  # quick, but reached through docker or torchrun: the launcher is not run
    argv = list(argv)
    for option in quick.redirect:
        argv = [*argv, option, str(tmp_path / option.strip("-"))]
    capsys.readouterr()
    code = moe_bench_main()(argv)
    out, err = capsys.readouterr()
    quick.expect(argv, code, out, err)


def pytest_paths(args: list[str]) -> list[str]:
    takes_value = {"-k", "-m", "-p", "-o", "-c", "--timeout", "-n"}
    paths, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = arg in takes_value
            continue
        paths.append(arg.split("::")[0])
    return paths


def check_pytest(args: list[str], tmp_path: Path) -> None:
    not_run_reason("python -m pytest")
    for path in pytest_paths(args):
        assert (REPO_ROOT / path).exists(), f"pytest {path}: no such test file or folder"
    if not pytest_paths(args):
        return  # the whole suite: .ci/run runs it
    # Collected, not run: the options must be known to pytest and its plugins, the paths must collect.
    args = [re.sub(r"^(--benchmark-json)=.*", rf"\1={tmp_path / 'benchmark.json'}", arg) for arg in args]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert re.search(r"^[1-9]\d* tests? collected", collected.stdout, re.MULTILINE), collected.stdout[-2000:]


def check_module(module: str, args: list[str], tmp_path: Path, capsys) -> None:
    if module == "pytest":
        return check_pytest(args, tmp_path)
    if module == "bench.cli":
        return check_moe_bench(args, tmp_path, capsys, may_run=False)
    not_run_reason(f"python -m {module}")
    if module == "venv":
        return
    main: Callable[[list[str]], Any] | None = getattr(importlib.import_module(module), "main", None)
    assert main is not None, f"python -m {module}: no main(argv) whose parser could check the arguments"
    namespace = parsed_by_own_parser(main, args, f"python -m {module} {shlex.join(args)}")
    for dest, check in NAMED_BY_TOOLS.items():
        if getattr(namespace, dest, None) is not None:
            check(getattr(namespace, dest))


def check_docker(words: list[str], tmp_path: Path, capsys) -> None:
    not_run_reason("docker")
    if words[:2] == ["docker", "build"]:
        assert (REPO_ROOT / words[-1] / "Dockerfile").exists(), "docker build: no Dockerfile in its context"
        return
    assert words[:2] == ["docker", "compose"], f"{shlex.join(words)}: only docker build and docker compose are known"
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    if words[2] != "run":
        assert words[2:] == ["build"], f"{shlex.join(words)}: an unknown compose command"
        return
    rest = [w for w in words[3:] if w != "--rm"]
    service, args = rest[0], rest[1:]
    assert service in services, (
        f"docker compose run {service}: no such service (docker-compose.yml has {sorted(services)})"
    )
    if "pytest" in services[service].get("entrypoint", []):
        for path in pytest_paths(args):
            assert (REPO_ROOT / path).exists(), f"pytest {path}: no such test file or folder"
    else:  # the image's entrypoint runs moe-bench: the arguments, or the service's own command
        check_moe_bench(args or list(services[service]["command"]), tmp_path, capsys, may_run=False)


def check_pip(words: list[str]) -> None:
    not_run_reason("pip install")
    if "-e" in words:
        extras = re.fullmatch(r"\.(?:\[(.*)\])?", words[words.index("-e") + 1])
        assert extras, "pip install -e: the project's own folder"
        provided = importlib.metadata.metadata("moe-engine").get_all("Provides-Extra") or []
        assert set(filter(None, (extras[1] or "").split(","))) <= set(provided), provided
        return
    pin = first_group(r"pip install --quiet (torch==[\d.]+)", (REPO_ROOT / ".ci" / "run").read_text())
    assert pin in words, f"{shlex.join(words)}: .ci/run pins {pin}"
    assert "https://download.pytorch.org/whl/cpu" in words, "torch from PyPI on Linux is the multi-GB CUDA build"


def check_command(command: Command, tmp_path: Path, capsys) -> None:
    words = list(command.words)
    program = words[0]
    if program == "moe-bench":
        check_moe_bench(words[1:], tmp_path, capsys)
    elif program in ("python", "python3") and words[1:2] == ["-m"]:
        check_module(words[2], words[3:], tmp_path, capsys)
    elif program == "docker":
        check_docker(words, tmp_path, capsys)
    elif program == "pip":
        check_pip(words)
    elif program == "torchrun":
        not_run_reason("torchrun")
        module = words[words.index("-m") + 1]
        assert module == "bench.cli", f"torchrun -m {module}: the docs launch moe-bench only"
        check_moe_bench(words[words.index("-m") + 2 :], tmp_path, capsys, may_run=False)
    elif program in ("ruff", "mypy"):
        # Run for real (seconds on the tree): the lint, format and types the docs promise hold.
        done = subprocess.run(words, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    elif program in ("git", ".", "pre-commit"):
        not_run_reason(program)
    else:  # a script of the repository
        not_run_reason(program)
        script = REPO_ROOT / program
        assert script.is_file() and os.access(script, os.X_OK), f"{program}: no such executable script"


# ---------------------------------------------------------------------------------------------------
# The tests


def test_the_docs_show_commands_of_every_kind():
    """The extraction reads what the pages hold (a broken fence parser would check nothing)."""
    programs = {command.words[0] for command in COMMANDS}
    assert {"moe-bench", "python", "docker", "pip"} <= programs, programs
    assert len(COMMANDS) >= 50, len(COMMANDS)


def test_the_readme_gives_the_two_jobs_and_ci_runs_its_test_command():
    readme = [str(c) for c in COMMANDS if c.page == "README.md"]
    for job in ("docker compose run --rm bench", "docker compose run --rm test", "moe-bench run", "python -m pytest"):
        assert job in readme, f"the README lost {job!r}"
    # CI runs the README's test command as its two lanes, the fast one first: "not slow" and "slow"
    # select every test between them, so together they are `python -m pytest`.
    ci = [shlex.split(line) for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    lanes = [words[words.index("-m", 3) + 1] for words in ci if words[:3] == ["python", "-m", "pytest"]]
    assert lanes == ["not slow", "slow"], f".ci/run no longer runs the README's test command as its two lanes: {lanes}"
    fast_lane = ["python", "-m", "pytest", "-m", "not slow"]
    assert any(list(c.words) == fast_lane for c in COMMANDS if c.page == "README.md"), "the README lost the fast lane"


@pytest.mark.parametrize(
    "command",
    # A cold mypy run over the tree takes most of a minute: CI runs it (and .ci/run runs mypy itself).
    [pytest.param(c, marks=pytest.mark.slow) if c.words[0] == "mypy" else c for c in COMMANDS],
    ids=[c.id for c in COMMANDS],
)
def test_command(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    check_command(command, tmp_path, capsys)


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.language not in SHELL_LANGUAGES], ids=lambda b: f"{b.page}:{b.line}"
)
def test_a_block_that_is_not_shell_holds_no_command(block):
    if block.language in ("python", "yaml"):
        return
    for offset, line in enumerate(block.text.splitlines()):
        assert not re.match(r"\s*(moe-bench|python3? -m|docker|pip) ", line), (
            f"{block.page}:{block.line + offset}: a command outside a shell block is never checked: fence it as bash"
        )


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`\n]+`")


def anchors_of(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose_of(page), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", prose_of(page))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors_of(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO_ROOT)}")
    assert broken == []


REPOSITORY_PATH = re.compile(
    r"`((?:bench|moe_engine|tests|scenarios|devices|docs|docker|results|\.ci|\.github)/[^`\s]*"
    r"|[\w.-]+\.(?:py|yaml|yml|json|toml|sh|md))`"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_repository_paths_named_in_the_prose_exist(page):
    """`bench/gate/compare.py`, `scenarios/suites.yaml`: a module moved or renamed leaves no stale name."""
    missing = []
    for path in REPOSITORY_PATH.findall(prose_of(page)):
        path = path.rstrip(".,:;")
        if "/" not in path or is_placeholder(path) or "*" in path or ignored_by_git(path):
            continue
        if not (REPO_ROOT / path).exists():
            missing.append(path)
    assert missing == []


def _imported_names(tree: ast.Module) -> dict[str, Any]:
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                names[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module(alias.name.split(".")[0])
                )
        elif isinstance(node, ast.ImportFrom):
            assert node.module and not node.level, "an example imports from the packages, not relatively"
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _callee(node: ast.expr, names: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _callee(node.value, names)
        return getattr(owner, node.attr, None) if inspect.ismodule(owner) or inspect.isclass(owner) else None
    return None


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=lambda b: f"{b.page}:{b.line}")
def test_python_example_imports_resolve_and_calls_bind(block):
    """The examples are not run (a bf16 training step of the first takes minutes on a CPU without bf16
    units); what goes stale when the API changes is checked: every import, and every call of an
    imported name against the callee's signature (a renamed or removed keyword fails)."""
    tree = ast.parse(block.text)
    names = _imported_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node.func, names)
        if callee is None:
            continue  # a method of an object the example made (trainer.step): its class is not known here
        try:
            signature = inspect.signature(callee)
        except (TypeError, ValueError):
            continue  # a builtin without a signature (torch.randint)
        try:
            signature.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg})
        except TypeError as err:
            pytest.fail(f"{block.page}:{block.line + node.lineno - 1}: {ast.unparse(node.func)}(...): {err}")


def _scenario_schema_without_required() -> dict[str, Any]:
    schema = copy.deepcopy(json.loads((REPO_ROOT / "scenarios" / "schema.json").read_text()))
    schema.pop("required", None)
    return schema


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "yaml"], ids=lambda b: f"{b.page}:{b.line}")
def test_yaml_example_holds_only_fields_the_scenario_schema_accepts(block):
    """A fragment (`parallel: ...`, `recompute: ...`) need not be a whole scenario, but every field it
    names must exist with a value the schema accepts: a renamed field or value fails."""
    fragment = yaml.safe_load(block.text)
    validator = jsonschema.Draft202012Validator(_scenario_schema_without_required())
    errors = [e for e in validator.iter_errors(fragment) if e.validator not in ("required", "dependentRequired")]
    assert not errors, "; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
