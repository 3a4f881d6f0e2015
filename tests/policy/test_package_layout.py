"""The shape of ``bench/``: the data's way, read from the import statements of every module.

- the engine never imports ``bench``, and holds none of the benchmark's machinery;
- no import circle between modules (imports inside functions count too);
- no module imports another module's private name;
- imports run down the layer list (``LAYERS``), imports inside functions included;
- an import inside a function is rare and says why (heavy or optional);
- no ``print`` outside the commands and the runner's console: modules log (``bench.logs``);
- pure arithmetic (``bench.predict``, the gate's comparison modules) imports nothing
  that runs a model.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.results import REPO_ROOT

PACKAGES = ("bench", "moe_engine")
# ``bench``, top to bottom: a module imports its own layer or the layers below it. The commands
# orchestrate everything; validate's experiments run whole suites through the A/B gate and the
# runner; the A/B gate and release images run both sides and read the gate and the report; run
# labels what it writes with the release record, which carries the gate's accepted changes, so
# release sits between run and gate; scenario files take their device defaults from the device
# profiles of predict, the arithmetic, which reads only the documents and numbers at the bottom.
LAYERS = (
    ("bench.cli", "bench.commands"),
    ("bench.validate",),
    ("bench.ab",),
    ("bench.report",),
    ("bench.run",),
    ("bench.release",),
    ("bench.gate",),
    ("bench.scenario", "bench.scenario_sections"),
    ("bench.predict",),
    ("bench.results", "bench.metrics", "bench.units", "bench.machine", "bench.termination", "bench.logs"),
)
# Imports allowed against LAYERS, each with its reason: none today (at most one may be added).
CLIMBS_ALLOWED: dict[tuple[str, str], str] = {}
ARITHMETIC = (
    "bench.predict.plan",
    "bench.predict.projection",
    "bench.predict.collectives",
    "bench.predict.overlap",
    "bench.predict.skew",
    "bench.predict.device",
    "bench.predict.ops",
    "bench.predict.traced",
    "bench.predict.fused_ops",
    "bench.predict.pricing",
    "bench.predict.op_projection",
    "bench.predict.plan.bytes",
    "bench.predict.plan.activations",
    "bench.predict.plan.rank",
    "bench.predict.dispatch_rows",
    "bench.predict.op_kinds",
    "bench.predict.breakdown",
    "bench.predict.pipeline_replay",
    "bench.predict.split_weights",
    "bench.gate.compare",
    "bench.gate.groups",
    "bench.gate.work",
    "bench.gate.accept",
    "bench.gate.verdict",
    "bench.gate.formatting",
    "bench.gate.tables",
    "bench.report.comparisons",
    "bench.predict.proxy_projection",
    "bench.metrics",
    "bench.units",
)
# What arithmetic may reach inside the project: configuration, the FLOP formulas, the rank layout,
# the paired pipeline plan, and the result/scenario documents. Everything else in the engine builds or runs a model.
ARITHMETIC_MAY_IMPORT = (
    "bench.results",
    "bench.metrics",
    "bench.units",
    "bench.scenario",
    "bench.scenario_sections",
    "moe_engine",
    "moe_engine.config",
    "moe_engine.flops",
    "moe_engine.parallel.layout",
    "moe_engine.parallel",
    # torch's pipeline plans with their neighbours paired: the order of actions, no stage, no model.
    "moe_engine.parallel.paired_plan",
)
# What measures or stands in for a run, used only by the benchmark: it lives in ``bench.run``
# (collective_log, phase_timer, sync_timeline, proxy.rank), not in the engine.
BENCHMARK_MACHINERY = (
    "CollectiveRecorder",
    "CollectiveCall",
    "PhaseTimer",
    "instrument_model",
    "SyncTimeline",
    "build_proxy_rank",
    "join_fake_world",
    "SimulatedPeers",
    "ProxyDispatcher",
    "ProxyPipeline",
)


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if "micro" in parts and parts[:2] == ("bench", "micro"):
                continue  # the pytest-benchmark files are tests, not modules
            files[".".join(parts)] = path
    return files


MODULES = module_files()


def imports_of(name: str) -> list[tuple[str, list[str]]]:
    """(imported module, imported names) for every import statement of the module, resolved to modules."""
    tree = ast.parse(MODULES[name].read_text())
    found = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "moe_engine" and name != "moe_engine":
                # the package's own names (its lazy __getattr__ included) are found in its submodules
                found += [(_lazy_home(alias.name), []) for alias in node.names]
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            found.append((node.module, [n for n in names if f"{node.module}.{n}" not in MODULES]))
            found += [(sub, []) for sub in submodules]
    return [(module, names) for module, names in found if module.split(".")[0] in PACKAGES]


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations run nothing)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _lazy_home(attribute: str) -> str:
    return {"Transformer": "moe_engine.model", "build_model": "moe_engine.model", "__version__": "moe_engine"}.get(
        attribute, "moe_engine.config"
    )


def graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in imports_of(name) if m in MODULES and m != name} for name in MODULES}


def test_the_engine_never_imports_bench():
    offenders = [
        (name, m)
        for name in MODULES
        if name.startswith("moe_engine")
        for m, _ in imports_of(name)
        if m.split(".")[0] == "bench"
    ]
    assert offenders == []


def test_the_engine_holds_no_benchmark_machinery():
    engine = [name for name in MODULES if name.startswith("moe_engine")]
    defined = [
        f"{name}.{node.name}"
        for name in engine
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in BENCHMARK_MACHINERY
    ]
    assert defined == []
    assert [name for name in engine if name == "moe_engine.proxy" or name.startswith("moe_engine.proxy.")] == []


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_a_private_name():
    offenders = [
        f"{name}: from {m} import {n}"
        for name in MODULES
        for m, names in imports_of(name)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert offenders == []


@pytest.mark.parametrize("name", ARITHMETIC)
def test_arithmetic_imports_nothing_that_runs_a_model(name):
    edges = graph()
    reached, todo = set(), [name]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    assert sorted(reached - {name} - set(ARITHMETIC) - set(ARITHMETIC_MAY_IMPORT)) == []


def layer(name: str) -> int | None:
    """Index in ``LAYERS`` of the module's layer (0 is the top), by its longest listed prefix."""
    found = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    return max(found)[1] if found else None


def test_every_bench_module_has_a_layer():
    assert [name for name in MODULES if name.startswith("bench.") and layer(name) is None] == []


def test_imports_run_down_the_layers():
    """Imports inside functions count: deferring one does not make it run the other way."""
    climbs = sorted(
        f"{name} (layer {layer(name)}) imports {m} (layer {layer(m)})"
        for name in MODULES
        if name.startswith("bench.")
        for m, _ in imports_of(name)
        if m.startswith("bench.") and (name, m) not in CLIMBS_ALLOWED and (layer(m) or 0) < (layer(name) or 0)
    )
    assert climbs == [], "\n".join(climbs)


def test_the_allowed_climbs_are_still_there():
    """An exception that no longer happens is removed from ``CLIMBS_ALLOWED``; one at most."""
    assert len(CLIMBS_ALLOWED) <= 1
    assert [pair for pair in CLIMBS_ALLOWED if pair[1] not in {m for m, _ in imports_of(pair[0])}] == []


# Imports inside functions: only where the import is heavy (torch, matplotlib, the engine: kept out of
# ``moe-bench --help`` and the commands that need none of it) or optional (docker, selenium, a side's
# older tree), each with its reason in a comment, and few of them.
LOCAL_IMPORTS_PER_1000_LINES = 1.5


def function_local_imports() -> list[tuple[Path, ast.stmt, list[str]]]:
    """(file, import statement, the file's lines) for every import inside a function of ``bench``."""
    found = []
    for name, path in MODULES.items():
        if not name.startswith("bench"):
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [(path, sub, lines) for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))]
    return found


def test_few_imports_inside_functions():
    lines = sum(len(path.read_text().splitlines()) for name, path in MODULES.items() if name.startswith("bench"))
    count = len(function_local_imports())
    assert count * 1000 / lines <= LOCAL_IMPORTS_PER_1000_LINES, f"{count} imports inside functions, {lines} lines"


def test_every_import_inside_a_function_says_why():
    """Its own line, or the line above its block of imports, carries a comment (or opens the ``try:`` of an
    optional import)."""
    unexplained = []
    for path, node, lines in function_local_imports():
        above = node.lineno - 2
        while (above >= 0 and lines[above].strip().startswith(("from ", "import ", ")"))) or (
            above >= 0 and lines[above].strip() == "" and lines[above - 1].strip().startswith(("from ", "import "))
        ):
            above -= 1
        said = "#" in lines[node.lineno - 1] or (
            above >= 0 and (lines[above].strip().startswith("#") or lines[above].strip().startswith("try:"))
        )
        if not said:
            unexplained.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert unexplained == []


# Three or more sibling modules named ``<prefix>_...`` are a family that belongs in a subpackage. Pending, with
# why (folder, prefix): none.
PREFIX_FAMILIES_PENDING: set[tuple[str, str]] = set()


def test_no_prefix_family_where_a_subpackage_belongs():
    folders = {path.parent for path in MODULES.values()}
    families = set()
    for folder in folders:
        prefixes = [p.stem.split("_")[0] for p in folder.glob("*.py") if "_" in p.stem.strip("_")]
        families |= {(str(folder.relative_to(REPO_ROOT)), p) for p in prefixes if prefixes.count(p) >= 3}
    assert families - PREFIX_FAMILIES_PENDING == set()
    assert families >= PREFIX_FAMILIES_PENDING, "a family that is gone leaves PREFIX_FAMILIES_PENDING"


# What a user reads as a command's output is written by the commands and the runner's console; every
# other module logs (``logging.getLogger(__name__)``, shown by ``bench.logs.console_logging``).
PRINT_ALLOWED = ("bench.commands", "bench.run.console")


def print_calls(name: str) -> list[int]:
    """Line numbers of the calls of the builtin ``print`` in the module."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]


def test_only_the_commands_and_the_console_print():
    offenders = [
        f"{MODULES[name].relative_to(REPO_ROOT)}:{line}"
        for name in MODULES
        if name.startswith("bench.") and not any(name == p or name.startswith(p + ".") for p in PRINT_ALLOWED)
        for line in print_calls(name)
    ]
    assert offenders == [], "log instead (logging.getLogger(__name__)): " + ", ".join(offenders)


def test_the_print_check_finds_a_print(tmp_path):
    """The check reads calls, not text: neither a print in a string nor a rich console's ``console.print``
    is one."""
    source = 'text = "print(1)"\nconsole.print(text)\nif text:\n    print(text, flush=True)\n'
    (tmp_path / "planted.py").write_text(source)
    MODULES["bench.planted"] = tmp_path / "planted.py"
    try:
        assert print_calls("bench.planted") == [4]
    finally:
        del MODULES["bench.planted"]
