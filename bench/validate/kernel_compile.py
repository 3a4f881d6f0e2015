"""Compile every Triton kernel of the engine for the GPUs users have, on a machine without one.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, native_specialize_impl

from bench.scenario import load_scenario
from moe_engine import kernels
from moe_engine.kernels import cross_entropy
from moe_engine.moe.permute import plan_routing, plan_slots
from moe_engine.precision.mxfp8 import gemm as mxfp8_gemm
from moe_engine.precision.mxfp8 import scaled_mm as mxfp8_scaled_mm
from moe_engine.precision.mxfp8 import wgrad as mxfp8_wgrad
from moe_engine.precision.mxfp8.gemm import SCALED_MMA_TILES
from moe_engine.precision.mxfp8.kernels import quantize_triton
from moe_engine.precision.mxfp8.token_blocks import quantize_token_blocks_triton

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILES = (
    "scenarios/olmo-core3/moe-128e-47b.yaml",
    "scenarios/olmo-core3/moe-1.2t-512gpu.yaml",
    "scenarios/olmo-core3/moe-mxfp8-4gpu.yaml",
    "scenarios/models/qwen3-30b-a3b.yaml",
    "scenarios/models/deepseek-v3.yaml",
)
"""The reference models whose sizes the kernels are compiled at."""
TARGETS = {"sm_90a": 90, "sm_100a": 100, "sm_80": 80}
"""Compile targets: name -> capability (Triton adds the ``a`` feature set for 90 and 100)."""
DEFAULT_TARGETS = ("sm_90a", "sm_100a", "sm_80")
ROWS = 4
"""Rows (tokens) of each recorded op."""


@dataclass(frozen=True)
class Launch:
    """One specialisation of one kernel, as the JIT would compile it."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    """(parameter, Triton type) in order; ``constexpr`` for constexprs and specialised integers."""
    constexprs: tuple[tuple[str, object], ...]
    divisible: tuple[str, ...]
    """Parameters specialised as divisible by 16 (pointers 16-byte aligned, integers)."""
    options: tuple[tuple[str, int], ...]
    """Launch options (num_warps, num_stages)."""

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def needs_fp8(self) -> bool:
        return any("fp8" in kind for _, kind in self.signature)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Launch:
        return cls(
            d["module"],
            d["name"],
            tuple(tuple(x) for x in d["signature"]),
            tuple(tuple(x) for x in d["constexprs"]),
            tuple(d["divisible"]),
            tuple(tuple(x) for x in d["options"]),
        )


@dataclass
class Compiled:
    """One specialisation compiled for one target."""

    kernel: str
    target: str
    ok: bool
    error: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    seconds: float = 0.0
    ir_ops: list[str] = field(default_factory=list)
    """Tensor-core ops in the TTGIR (``tc_gen5_mma``, ``tc_gen5_mma_scaled``, ``warp_group_dot``)."""

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


# --- 1. recording --------------------------------------------------------------------------------------


def describe_launch(fn, args: tuple, kwargs: dict) -> Launch:
    """The specialisation of ``fn`` (a Python function decorated by ``triton.jit``) for these arguments."""

    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    signature, constexprs, divisible = [], [], []
    for p in params:
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, value))
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature.append((p.name, kind))
        if kind == "constexpr":
            constexprs.append((p.name, spec))
        elif spec and "D" in spec:
            divisible.append(p.name)
    options = tuple(sorted((k, int(v)) for k, v in kwargs.items() if k in ("num_warps", "num_stages")))
    return Launch(fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), tuple(divisible), options)


def _record_launches() -> list[Launch]:
    """Run the representative ops with a hook on the interpreter's launches (TRITON_INTERPRET=1)."""

    launches: list[Launch] = []
    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__module__.startswith("moe_engine."):
            launches.append(describe_launch(self.fn, args, kwargs))
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        for path in MODEL_FILES:
            run_representative_ops(_model(ROOT / path))
    finally:
        InterpretedFunction.run = real_run
    return launches


def _model(path: Path):
    return load_scenario(path).model


def run_representative_ops(model, rows: int = ROWS) -> None:
    """Each Triton launch site of the engine at ``model``'s sizes, forward and backward, in bf16 (the
    GPU scenarios' dtype; the router computes in fp32): the fused ops through their public functions,
    the fused loss's row kernels on a chunk of logits of the model's vocabulary (the LM head's GEMMs
    are torch's), the experts' weight gradients added into fp32 buffers, the MXFP8 quantisation along both
    axes and along tokens, its grouped GEMMs (fprop/dgrad and wgrad), and the kernels around torch's scaled GEMM (its A scales' layout, the zeroing
    of the rows it leaves unwritten)."""

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    d, head_dim, moe = model.d_model, model.d_model // model.n_heads, model.moe
    top_k, experts, hidden = moe.top_k, moe.num_experts, moe.expert_hidden

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def backward(*outs):
        torch.autograd.backward([o for o in outs], [torch.randn_like(o) for o in outs])

    backward(kernels.rms_norm(leaf(rows, d), leaf(d), 1e-6))
    backward(*kernels.add_rms_norm(leaf(rows, d), leaf(rows, d), leaf(d), 1e-6))
    backward(kernels.rms_norm(leaf(rows, model.n_heads, head_dim), leaf(head_dim), 1e-6))
    for width in {hidden, model.dense_hidden, moe.shared_expert_hidden} - {0}:
        backward(kernels.swiglu(leaf(rows, width), leaf(rows, width)))
        kernels.swiglu_packed_backward(leaf(rows, 2 * width).detach(), torch.randn(rows, width).to(dtype))
    cos, sin = torch.randn(rows, head_dim, generator=g), torch.randn(rows, head_dim, generator=g)
    backward(kernels.rope(leaf(1, model.n_heads, rows, head_dim), cos, sin))
    logits = torch.randn(rows, model.vocab_size, generator=g).to(dtype)
    labels = torch.randint(0, model.vocab_size, (rows,), generator=g)
    lse, _ = cross_entropy.triton_chunk_loss(logits, labels, cross_entropy.IGNORE_INDEX)
    cross_entropy.triton_chunk_grad(logits, labels, lse, torch.ones(()), cross_entropy.IGNORE_INDEX)

    router_logits = torch.randn(rows, experts, generator=g).requires_grad_()
    expert_TK = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    backward(kernels.router_scores(router_logits, expert_TK, normalize=True)[0])
    plan = plan_routing(expert_TK, experts)
    for rowmap in (plan.rows, plan_slots(plan, 2, rows * top_k).rows):
        x, y = leaf(rows, d), leaf(rowmap.assignment_R.numel(), d)
        weight = torch.rand(rows, top_k, generator=g).to(dtype).requires_grad_()
        maps = (rowmap.filled_R, rowmap.kept_N)
        gathered = kernels.gather_rows(x, rowmap.assignment_R, rowmap.row_N, top_k, *maps)
        combined = kernels.combine_rows(y, weight, rowmap.row_N, rowmap.assignment_R, *maps[::-1])
        backward(gathered, combined)
        end = torch.tensor([rowmap.assignment_R.numel()], dtype=torch.int32)
        kernels.gather_rows_mx(x.detach(), rowmap.assignment_R, top_k, rowmap.filled_R, end)

    # The experts' weight gradients added into fp32 buffers, grad_h^T x and grad_y^T a, from the
    # model's dtype and from fp32 (an fp32 model's operands take the FMA configs). The launch specialises
    # the widths by their divisibility by 16 only, so a width of the same divisibility stands in for
    # each (the full widths' tiles would keep the interpreter busy for minutes); each dtype runs its config.
    local_experts = min(experts, 16)
    wgrad_offsets = torch.full((local_experts,), rows, dtype=torch.int32)
    for operand_dtype in (dtype, torch.float32):
        for m, k in ((2 * hidden, d), (d, hidden)):
            m, k = _stand_in_width(m), _stand_in_width(k)
            a_NM = torch.randn(rows, m, generator=g).to(operand_dtype)
            b_NK = torch.randn(rows, k, generator=g).to(operand_dtype)
            kernels.grouped_wgrad_accumulate(a_NM, b_NK, wgrad_offsets, torch.zeros(local_experts, m, k))

    # MXFP8: activations along their last axis, weights along either (the dgrad operands), the GEMM.
    quantize_triton(torch.randn(rows, d, generator=g).to(dtype))
    quantize_triton(torch.randn(2, 64, 64, generator=g).to(dtype), axis=1)
    a = mxfp8_gemm.quantize_rows(torch.randn(rows, d, generator=g).to(dtype))
    b = mxfp8_gemm.quantize_weight(torch.randn(local_experts, 64, d, generator=g).to(dtype))
    offsets = torch.full((local_experts,), rows, dtype=torch.int32)
    mxfp8_gemm.grouped_mm(a, b, offsets, dtype, path=mxfp8_gemm.GemmPath.TRITON)
    mxfp8_gemm.dequantize_rows_triton(a.data, a.scales, d, dtype)
    # The MXFP8 weight gradients: the four operands blocked along tokens, each weight's GEMM added into
    # an fp32 buffer (ddp) and handed back in the model's dtype (no buffer).
    for m, k in ((2 * hidden, d), (d, hidden)):
        m, k = _stand_in_width(m), _stand_in_width(k)
        grad_out, inputs = (
            quantize_token_blocks_triton(torch.randn(rows, width, generator=g).to(dtype), wgrad_offsets)
            for width in (m, k)
        )
        triton_path = mxfp8_gemm.GemmPath.TRITON
        mxfp8_wgrad.grouped_wgrad(grad_out, inputs, torch.zeros(local_experts, m, k), path=triton_path)
        mxfp8_wgrad.grouped_wgrad(grad_out, inputs, out_dtype=dtype, path=triton_path)
    # torch's scaled op (Blackwell) needs a GPU; the kernels around it do not.
    mxfp8_scaled_mm.zero_rows_after(torch.randn(rows, d, generator=g).to(dtype), offsets)
    mxfp8_scaled_mm.blocked_group_scales(a.scales, offsets)


def _stand_in_width(width: int) -> int:
    """A small width that a launch specialises as it does ``width``: divisible by 16 or not."""
    return 64 if width % 16 == 0 else 64 + width % 16


def record(python: str = sys.executable, timeout: float = 900) -> list[Launch]:
    """The engine's distinct launches, recorded in a child process under Triton's interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "launches.json"
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [python, "-m", "bench.validate.kernel_compile", "--record", str(out)]
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"recording the launches failed:\n{done.stderr[-4000:]}")
        return [Launch.from_json(d) for d in json.loads(out.read_text())]


def distinct(launches: Iterable[Launch]) -> list[Launch]:
    return list(dict.fromkeys(launches))


# --- 2. compiling --------------------------------------------------------------------------------------

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_TC_OPS = ("tc_gen5_mma_scaled", "tc_gen5_mma", "warp_group_dot")


def _jit_function(launch: Launch):
    return unwrap(getattr(importlib.import_module(launch.module), launch.name))


def unwrap(fn):
    """The ``JITFunction`` under Triton's launch wrappers (``triton.autotune``, ``triton.heuristics``)."""

    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def compile_launch(launch: Launch, target: str, fn=None) -> Compiled:
    """Compile ``launch`` for ``target`` and read its registers and spills from ``ptxas -v``."""

    capability = TARGETS[target]
    fn = unwrap(fn) if fn is not None else _jit_function(launch)
    names = [name for name, _ in launch.signature]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in launch.divisible}
    source = ASTSource(fn=fn, signature=dict(launch.signature), constexprs=dict(launch.constexprs), attrs=attrs)
    start = time.perf_counter()
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(launch.options))
    except Exception as error:  # any compiler failure is the finding
        return Compiled(launch.kernel, target, False, f"{type(error).__name__}: {str(error)[-2000:]}")
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        cmd = [
            get_ptxas(capability).path,
            "-v",
            f"--gpu-name=sm_{capability}a" if capability >= 90 else "--gpu-name=sm_80",
        ]
        done = subprocess.run([*cmd, str(ptx), "-o", str(Path(tmp) / "kernel.o")], capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        return Compiled(launch.kernel, target, False, f"ptxas: {log[-2000:]}", seconds=seconds)
    registers = max((int(m) for m in _REGISTERS.findall(log)), default=0)
    stores = sum(int(s) for s, _ in _SPILLS.findall(log))
    loads = sum(int(l_) for _, l_ in _SPILLS.findall(log))
    ttgir = kernel.asm.get("ttgir", "")
    ir_ops = [op for op in _TC_OPS if re.search(rf"\b{op}\b", ttgir)]
    return Compiled(launch.kernel, target, True, "", registers, stores, loads, seconds, ir_ops)


def targets_for(launch: Launch, targets: Iterable[str]) -> list[str]:
    """The targets a kernel claims: sm_80 only without fp8 operands (Triton's e4m3 needs 8.9)."""
    return [t for t in targets if not (TARGETS[t] < 89 and launch.needs_fp8)]


def compile_all(launches: list[Launch], targets: Iterable[str]) -> list[tuple[Launch, Compiled]]:
    return [(launch, compile_launch(launch, t)) for launch in launches for t in targets_for(launch, targets)]


# --- 3. judging ----------------------------------------------------------------------------------------


MXFP8_GEMM = "moe_engine.precision.mxfp8.gemm._mx_grouped_mm_kernel"
MXFP8_WGRAD = "moe_engine.precision.mxfp8.wgrad._mx_wgrad_kernel"
SCALED_MMA = "tc_gen5_mma_scaled"


def scaled_mma_tiles() -> tuple[tuple[int, int], ...]:
    """The MXFP8 GEMM's (BLOCK_M, BLOCK_N) that Blackwell's tuning keeps: they must reach the scaled MMA."""

    return SCALED_MMA_TILES


def failures(results: list[tuple[Launch, Compiled]], tiles: tuple[tuple[int, int], ...] | None = None) -> list[str]:
    """What fails the check: compile errors, spills, an MXFP8 GEMM config that Blackwell's tuning keeps
    (``tiles``, default ``scaled_mma_tiles()``) and the MXFP8 weight-gradient GEMM without the scaled MMA
    in their sm_100a IR."""
    out = []
    for launch, c in results:
        if not c.ok:
            out.append(f"{c.kernel} on {c.target} does not compile: {c.error.splitlines()[0] if c.error else ''}")
            continue
        if c.spills:
            out.append(
                f"{c.kernel} on {c.target} spills ({c.spill_stores} B stored, {c.spill_loads} B loaded, "
                f"{c.registers} registers) at {dict(launch.constexprs)}"
            )
        if c.kernel == MXFP8_GEMM and c.target == "sm_100a":
            constexprs = dict(launch.constexprs)
            tile = (constexprs.get("BLOCK_M"), constexprs.get("BLOCK_N"))
            if tile in (scaled_mma_tiles() if tiles is None else tiles) and SCALED_MMA not in c.ir_ops:
                out.append(f"{c.kernel} on sm_100a at {tile[0]} x {tile[1]} lacks {SCALED_MMA}: {c.ir_ops}")
        if c.kernel == MXFP8_WGRAD and c.target == "sm_100a" and SCALED_MMA not in c.ir_ops:
            out.append(f"{c.kernel} on sm_100a lacks {SCALED_MMA}: {c.ir_ops}")
    return out


def summary(launches: list[Launch], results: list[tuple[Launch, Compiled]]) -> dict:
    per_kernel: dict[str, dict] = {}
    for launch in launches:
        per_kernel.setdefault(launch.kernel, {"specialisations": 0, "targets": {}})["specialisations"] += 1
    for _, c in results:
        t = per_kernel[c.kernel]["targets"].setdefault(c.target, {"max_registers": 0, "spills": 0, "ir_ops": []})
        t["max_registers"] = max(t["max_registers"], c.registers)
        t["spills"] += int(c.spills)
        t["ir_ops"] = sorted(set(t["ir_ops"]) | set(c.ir_ops))
    # Per target, the tensor-core ops each tile of the MXFP8 GEMM's configs compiled to.
    tiles: dict[str, dict[str, list[str]]] = {}
    for launch, c in results:
        if c.kernel == MXFP8_GEMM and c.ok:
            constexprs = dict(launch.constexprs)
            tile = f"{constexprs.get('BLOCK_M')}x{constexprs.get('BLOCK_N')}"
            ops = tiles.setdefault(c.target, {}).setdefault(tile, [])
            ops[:] = sorted(set(ops) | set(c.ir_ops))
    return {
        "specialisations": len(launches),
        "compiles": len(results),
        "compile_seconds": sum(c.seconds for _, c in results),
        "kernels": per_kernel,
        "mxfp8_gemm_tiles": tiles,
        "failures": failures(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validate.kernel_compile", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated, of " + ", ".join(TARGETS)
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record:
        args.record.write_text(json.dumps([launch.to_json() for launch in distinct(_record_launches())]))
        return 0
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    launches = distinct(record())
    results = compile_all(launches, targets)
    report = summary(launches, results)
    sys.stdout.write(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    sys.stdout.write("".join(f"FAIL: {line}\n" for line in report["failures"]))
    return 1 if report["failures"] else 0


def render(report: dict) -> str:
    """The report's lines as ``main`` writes them: each kernel's targets, the MXFP8 tiles, the totals."""
    lines = []
    for kernel, info in report["kernels"].items():
        cells = ", ".join(
            f"{t} {v['max_registers']} regs{' SPILLS' if v['spills'] else ''}{' ' + '/'.join(v['ir_ops']) if v['ir_ops'] else ''}"
            for t, v in info["targets"].items()
        )
        lines.append(f"{kernel}: {info['specialisations']} specialisations; {cells}")
    for target, tiles in report["mxfp8_gemm_tiles"].items():
        lines.append(
            f"MXFP8 GEMM tiles on {target}: " + ", ".join(f"{t} {'/'.join(ops) or '-'}" for t, ops in tiles.items())
        )
    lines.append(
        f"{report['specialisations']} specialisations, {report['compiles']} compiles in "
        f"{report['compile_seconds']:.0f} s"
    )
    return "".join(line + "\n" for line in lines)


if __name__ == "__main__":
    sys.exit(main())
