"""Lints over the source of the tests and the engine for two mistakes that only a GPU run would show.

1. A host-to-device copy inside ``forbid_host_sync()``. On CUDA the guard turns on
   ``torch.cuda.set_sync_debug_mode("error")``, and a blocking copy from host memory (``x.cuda()``,
   ``x.to("cuda")``, ``torch.tensor(..., device="cuda")``) synchronises: the block fails on a GPU
   while it passes on the CPU, where the copy is no copy. The guard refuses ``torch.tensor`` at run
   time on every device; this lint also sees the copies that only exist on a GPU.
2. A CUDA test that draws random routes. ``routing="random"`` (and ``"skewed"``) draw from Philox on
   CUDA and from mt19937 on the CPU: with one seed a CUDA run and its CPU reference route tokens to
   other experts, and the comparison fails for a reason that has nothing to do with the code under test.
"""

import ast

import pytest

from bench.results import REPO_ROOT

ROOT = REPO_ROOT
SCANNED = ("tests", "moe_engine", "bench")

_FROM_HOST_DATA = {"tensor", "as_tensor", "from_numpy"}
_RANDOM_ROUTES = {"random", "skewed", "RANDOM", "SKEWED"}


def _is_guard(expr: ast.expr) -> bool:
    """``forbid_host_sync()``, also as one branch of ``forbid_host_sync() if fast else nullcontext()``."""
    return any(
        isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "forbid_host_sync"
        for node in ast.walk(expr)
    )


def _names_a_device(arg: ast.expr) -> bool:
    if isinstance(arg, ast.Constant):
        return isinstance(arg.value, str)  # "cuda", "cuda:0"; dtypes are never strings in .to()
    if isinstance(arg, ast.Call):
        return getattr(arg.func, "attr", None) == "device"  # torch.device(...)
    name = getattr(arg, "id", getattr(arg, "attr", ""))
    return "device" in name or name in {"cuda", "dev"}


def _host_copy(call: ast.Call) -> str | None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr == "cuda":
        return ".cuda()"
    if func.attr in _FROM_HOST_DATA and getattr(func.value, "id", None) == "torch":
        return f"torch.{func.attr}()"
    if func.attr == "to" and (any(k.arg == "device" for k in call.keywords) or any(map(_names_a_device, call.args))):
        return ".to(device)"
    return None


def host_copies_in_guarded_blocks(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for each host-to-device copy written inside a ``forbid_host_sync()`` block."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.With | ast.AsyncWith) and any(_is_guard(item.context_expr) for item in node.items):
            for statement in node.body:
                for inner in ast.walk(statement):
                    if isinstance(inner, ast.Call) and (what := _host_copy(inner)):
                        found.append(f"{filename}:{inner.lineno}: {what} inside forbid_host_sync()")
    return found


def _marked_cuda(decorators: list[ast.expr]) -> bool:
    return any(
        isinstance(d, ast.Attribute) and d.attr == "cuda" and getattr(d.value, "attr", None) == "mark"
        for d in decorators
    )


def random_routes_in_cuda_tests(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: test`` for each CUDA-marked test that asks for random or skewed routing."""
    tree = ast.parse(source, filename)
    module_marked = any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
        and _marked_cuda([n.value])
        for n in tree.body
    )
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        if not (module_marked or _marked_cuda(node.decorator_list)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.keyword) and inner.arg == "routing":
                value = inner.value
                route = value.value if isinstance(value, ast.Constant) else getattr(value, "attr", None)
                if route in _RANDOM_ROUTES:
                    found.append(f"{filename}:{inner.value.lineno}: {node.name} routes {route!r} on CUDA")
    return found


def _sources():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_host_to_device_copy_inside_a_guarded_block():
    found = [hit for name, source in _sources() for hit in host_copies_in_guarded_blocks(source, name)]
    assert found == []


def test_cuda_tests_route_the_same_on_both_devices():
    found = [
        hit
        for name, source in _sources()
        if name.startswith("tests/")
        for hit in random_routes_in_cuda_tests(source, name)
    ]
    assert found == []


@pytest.mark.parametrize(
    "body, found",
    [
        # The three copies the first GPU run would have failed on.
        ("y = layer(x)\n    (y * grad.cuda().to(dtype)).sum().backward()", [".cuda()"]),
        ("(y * grad_TD.cuda()).sum().backward()", [".cuda()"]),
        ("t.index_put_((t > 0,), torch.tensor(0.0, device=t.device))", ["torch.tensor()"]),
        ("y = x.to('cuda', non_blocking=False)", [".to(device)"]),
        ("y = x.to(device)", [".to(device)"]),
        ("y = x.to(device=x.device)", [".to(device)"]),
        ("y = x.to(torch.device('cuda'))", [".to(device)"]),
        ("y = torch.as_tensor(values)", ["torch.as_tensor()"]),
        ("def inner():\n        return x.cuda()\n    inner()", [".cuda()"]),
        # What is allowed.
        ("y = x.to(dtype)", []),
        ("y = x.to(torch.bfloat16)", []),
        ("y = layer(x)\n    y.sum().backward()", []),
        ("y = x.new_zeros(())", []),
    ],
)
def test_the_lint_sees_a_copy_in_a_guarded_block(body, found):
    for guard in ("forbid_host_sync()", "forbid_host_sync() if fast else contextlib.nullcontext()"):
        source = f"def test():\n    with {guard}:\n        " + body.replace("\n    ", "\n        ") + "\n"
        assert [hit.split(": ", 1)[1] for hit in host_copies_in_guarded_blocks(source)] == [
            f"{what} inside forbid_host_sync()" for what in found
        ]


def test_the_lint_ignores_copies_outside_a_guarded_block():
    source = "def test():\n    grad = grad_TD.cuda()\n    with forbid_host_sync():\n        (y * grad).sum()\n"
    assert host_copies_in_guarded_blocks(source) == []
    source = "def test():\n    with torch.no_grad():\n        x = torch.tensor(1.0).cuda()\n"
    assert host_copies_in_guarded_blocks(source) == []


@pytest.mark.parametrize(
    "source, found",
    [
        ("@pytest.mark.cuda\ndef test_a():\n    MoEConfig(routing='random')\n", 1),
        ("@pytest.mark.cuda\ndef test_a():\n    MoEConfig(routing=RoutingMode.SKEWED)\n", 1),
        ("pytestmark = pytest.mark.cuda\ndef test_a():\n    MoEConfig(routing='random')\n", 1),
        ("@pytest.mark.cuda\ndef test_a():\n    MoEConfig(routing='balanced')\n", 0),
        ("def test_a():\n    MoEConfig(routing='random')\n", 0),  # a CPU test
    ],
)
def test_the_lint_sees_random_routes_in_a_cuda_test(source, found):
    assert len(random_routes_in_cuda_tests(source)) == found
