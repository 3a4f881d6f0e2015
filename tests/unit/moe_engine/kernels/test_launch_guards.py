"""Every Triton launch of the engine runs inside ``on_device`` (Triton launches on the current CUDA
device, which need not be the tensor's: without the guard a kernel on a second GPU reads the first
one's addresses). Checked on the source: a launch is ``kernel[grid](...)`` with ``kernel`` a function the
engine decorates with ``triton.jit``."""

import ast
from pathlib import Path

import moe_engine

ENGINE = Path(moe_engine.__file__).parent


def _jit_names(tree: ast.AST) -> set[str]:
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
    }


def _launches(tree: ast.AST, kernels: set[str]) -> list[tuple[int, bool]]:
    """(line, inside ``with on_device(...)``) of each launch of one of ``kernels``."""
    found: list[tuple[int, bool]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.With):
            guarded = guarded or any(
                isinstance(item.context_expr, ast.Call)
                and isinstance(item.context_expr.func, ast.Name)
                and item.context_expr.func.id == "on_device"
                for item in node.items
            )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in kernels
        ):
            found.append((node.lineno, guarded))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return found


def test_every_engine_launch_is_inside_on_device():
    trees = {path.relative_to(ENGINE): ast.parse(path.read_text()) for path in sorted(ENGINE.rglob("*.py"))}
    kernels = set().union(*(_jit_names(tree) for tree in trees.values()))
    launches = {str(path): _launches(tree, kernels) for path, tree in trees.items()}
    unguarded = {path: [line for line, ok in found if not ok] for path, found in launches.items()}
    assert {path: lines for path, lines in unguarded.items() if lines} == {}
    # The check sees the launches it should: the fused ops' and the MXFP8 kernels'.
    assert len(launches["precision/mxfp8/gemm.py"]) == 2  # the GEMM, the dequantize
    assert len(launches["precision/mxfp8/kernels.py"]) == 2  # the quantize along the last axis, along another
    assert sum(len(found) for found in launches.values()) >= 12


def test_the_check_sees_an_unguarded_launch():
    planted = ast.parse(
        "@triton.jit\ndef k(x):\n    pass\n\ndef f(x):\n    with on_device(x):\n        k[(1,)](x)\n    k[(2,)](x)\n"
    )
    assert _launches(planted, _jit_names(planted)) == [(7, True), (8, False)]
