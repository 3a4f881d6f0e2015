"""``mxfp8.scaled_mm``'s Triton kernels, run by Triton's interpreter on CPU in a fresh process under
TRITON_INTERPRET=1 (it must be set before triton is imported): the tail zeroing writes +0.0 after the
last expert's rows only, in place, and the one-kernel A-scale layout gives the bytes of the composition
it replaces."""

import json
import subprocess
import sys
import textwrap

from interpreted_kernels import interpreter_env
from scaled_mm_cases import BLOCKED_CASES, ZERO_CASES

from bench.results import REPO_ROOT

REPO = REPO_ROOT


# The interpreter is chosen when triton.jit runs, so the kernel module is imported in a fresh process.
ZERO_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from moe_engine.precision.mxfp8 import scaled_mm as smm

    results = []
    for rows, cols, end, dtype in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(rows + end)
        out = torch.randn(rows, cols, generator=g).to(getattr(torch, dtype))
        out[::3] = float("nan")  # garbage rows, as the op leaves them
        before = out.clone()
        offsets = torch.tensor([end // 2, end], dtype=torch.int32)
        got = smm.zero_rows_after(out, offsets)
        results.append({
            "in_place": got.data_ptr() == out.data_ptr(),
            "kept": bool(torch.equal(got[:end].view(torch.int16 if dtype == "bfloat16" else torch.int32),
                                     before[:end].view(torch.int16 if dtype == "bfloat16" else torch.int32))),
            "zeroed": bool((got[end:] == 0).all()) and not torch.signbit(got[end:]).any().item(),
        })
    print(json.dumps(results))
    """
)


def _interpreted(script: str, cases: list) -> list:
    """What ``script`` prints last (JSON) for ``cases``, run in a fresh process under Triton's interpreter
    (the variable must be set before triton is imported)."""
    env = interpreter_env()
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_zeroing_kernel_in_interpreter_writes_only_the_tail():
    for case, got in zip(ZERO_CASES, _interpreted(ZERO_SCRIPT, ZERO_CASES)):
        assert got == {"in_place": True, "kept": True, "zeroed": True}, case


BLOCKED_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from moe_engine.precision.mxfp8 import scaled_mm as smm

    results = []
    for counts, padding, cols, strided in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(len(results))
        rows = sum(counts) + padding
        codes = torch.randint(0, 256, (cols, rows) if strided else (rows, cols), generator=g, dtype=torch.uint8)
        scales = (codes.t() if strided else codes).view(torch.float8_e8m0fnu)
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        got = smm.blocked_group_scales(scales, offsets).view(torch.uint8)
        want = smm.to_blocked(smm.group_padded_rows(scales, offsets)).view(torch.uint8)
        results.append(bool(got.shape == want.shape and torch.equal(got, want)))
    print(json.dumps(results))
    """
)


def test_blocked_group_scales_kernel_in_interpreter_matches_the_composition():
    """The one-kernel A-scale layout gives the bytes of ``to_blocked(group_padded_rows(...))``, which
    tests/unit/moe_engine/precision/mxfp8/test_scaled_mm.py checks against the index formula and the
    op's contract."""
    assert _interpreted(BLOCKED_SCRIPT, BLOCKED_CASES) == [True] * len(BLOCKED_CASES)
