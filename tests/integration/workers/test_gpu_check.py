"""bench/gpu-check.sh on a CPU: its header's arithmetic against the code it describes, the dry run of
every step, a broken step failing it by name, and the install check refusing another checkout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench.micro import FUSED_OPS
from bench.predict.device import load_profile
from bench.results import REPO_ROOT
from bench.run.profile.sweep import cuda_quick_sweep, estimate_seconds, timed_points

ROOT = REPO_ROOT
SCRIPT = ROOT / "bench" / "gpu-check.sh"
STEPS = ["tests-cuda", "micro-cuda", "suite-gpu", "profile", "project"]
CUDA_START_S, FIRST_USE_S, BELOW_PEAK = 15, 5, 2
"""The profile step's allowances besides its points, as the header states them: CUDA start-up, the first
use of each library's kernels, and kernels running at half the peaks the estimate assumes."""


def _header() -> str:
    lines = []
    for line in SCRIPT.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def _limits() -> dict[str, int]:
    """Each step's limit as the script passes it to run_step (the suite's without node scenarios)."""
    return {
        name: int(limit)
        for name, limit in re.findall(r"^run_step ([\w-]+) \$?\(?\(?(\d+)", SCRIPT.read_text(), re.MULTILINE)
    }


def test_header_states_each_steps_limit_and_their_sum():
    limits = _limits()
    assert list(limits) == STEPS
    header = _header()
    for name, limit in limits.items():
        assert re.search(rf"\b{name} +{limit} s: \S", header), f"{name}: header lacks '{name} {limit} s: ...'"
    minutes = float(re.search(r"([\d.]+) minutes in all", header).group(1))
    assert minutes == sum(limits.values()) / 60


def test_quick_cuda_sweep_fits_the_profile_step():
    sweep = cuda_quick_sweep()
    count, estimate = len(timed_points(sweep)), estimate_seconds(sweep)
    stated = re.search(r"profile +\d+ s: .*? times (\d+) points, ([\d.]+) s by estimate_seconds", _header())
    assert (int(stated.group(1)), float(stated.group(2))) == (count, round(estimate, 1))
    assert CUDA_START_S + FIRST_USE_S + BELOW_PEAK * estimate <= _limits()["profile"]
    # The only fp32 GEMMs the gpu suite prices, the router's (tokens x experts x d_model and its two
    # gradients, at 32,768 tokens a microbatch, 8 or 128 experts, d_model 2,048), stay measured.
    fp32 = {shape for kind, dtype, shape, _, _ in timed_points(sweep) if (kind, dtype) == ("gemm", "fp32")}
    assert {
        (32768, 128, 2048),
        (32768, 2048, 128),
        (128, 2048, 32768),
        (32768, 8, 2048),
        (8, 2048, 32768),
        (32768, 2048, 8),
    } <= fp32


def _run(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    process = subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the script and every step it started
        process.communicate()
        raise
    return process.returncode, output


def _env(**extra: str) -> dict[str, str]:
    """This environment for the script, its python this one's; ``PATH`` is put in front of it."""
    env = dict(os.environ, PYTHON=sys.executable, **extra)
    env["PATH"] = os.pathsep.join(
        p for p in (extra.get("PATH"), str(Path(sys.executable).parent), os.environ["PATH"]) if p
    )
    env.pop("GPU_CHECK_BASE", None)
    env.pop("MOE_TEST_DEVICE", None)
    return env


def _steps(out: Path) -> dict[str, tuple[int, int]]:
    rows = [
        re.fullmatch(r"([\w-]+) rc=(\d+) seconds=\d+ limit=(\d+)", line).groups()
        for line in (out / "steps.txt").read_text().splitlines()
    ]
    return {name: (int(rc), int(limit)) for name, rc, limit in rows}


@pytest.mark.slow
def test_dry_run_runs_every_step_with_its_files(tmp_path):
    out = tmp_path / "check"
    code, output = _run(["--dry-run", str(out)], _env(), timeout=900)
    assert code == 0, output
    assert output.splitlines()[-1] == f"gpu-check: all 5 steps passed; results in {out}"
    steps = _steps(out)
    assert list(steps) == STEPS
    assert steps == {name: (0, limit) for name, limit in _limits().items()}
    assert "dry run on the CPU: torch" in (out / "environment.txt").read_text()
    tests = ET.parse(out / "tests-cuda.xml").getroot().find("testsuite")
    assert int(tests.get("tests")) > int(tests.get("skipped")) and tests.get("failures") == "0"
    micro = json.loads((out / "micro-cuda.json").read_text())
    fused = {f"fused_over_eager_{op}" for op in FUSED_OPS}
    assert len(micro["benchmarks"]) == 18
    assert set(micro["derived"]) == {"moe_layer_vs_dense_flops", "experts_128_vs_8_tokens", "memory_rate"} | fused
    # Each fused op's benchmark and its eager twin set against the base profile's memory rate.
    rates = micro["derived"]["memory_rate"]
    assert len(rates) == 14 and all(r["profile"] == "cpu-2core" and r["fraction"] > 0 for r in rates.values())
    (result,) = (out / "results").glob("*/*/dry-run-fp32.json")
    assert json.loads(result.read_text())["status"] == "ok"
    profile = load_profile(out / "device-profile.yaml")
    assert (profile.name, profile.kind) == ("dry-run-cpu", "cpu") and profile.measured["command"].endswith("--tiny")
    doc = json.loads((out / "projections" / "dry-run-bf16.dry-run-cpu.json").read_text())
    assert doc["device_file"] == str(out / "device-profile.yaml") and "device_fallback" not in doc
    assert doc["step_s"] > 0


BROKEN_PROFILE = """#!/usr/bin/env bash
# The script's python with its profile step broken; the steps before it, run by the test above, stubbed.
case " $* " in
    *" profile-device "*) echo "planted failure" >&2; exit 3 ;;
    *" -m pytest "* | *pytest.main* | *" bench.cli run "*) exit 0 ;;
esac
exec {python} "$@"
"""


@pytest.mark.slow
def test_a_broken_step_fails_the_check_by_name_and_the_projection_falls_back(tmp_path):
    python = tmp_path / "python"
    python.write_text(BROKEN_PROFILE.format(python=sys.executable))
    python.chmod(0o755)
    out = tmp_path / "check"
    code, output = _run(["--dry-run", str(out)], dict(_env(), PYTHON=str(python)), timeout=600)
    assert code == 1, output
    assert output.splitlines()[-1] == f"gpu-check: FAILED: profile (of 5 steps; logs and results in {out})"
    assert {name: rc for name, (rc, _) in _steps(out).items()} == {
        "tests-cuda": 0,
        "micro-cuda": 0,
        "suite-gpu": 0,
        "profile": 3,
        "project": 0,
    }
    assert "planted failure" in (out / "profile.log").read_text()
    said = f"gpu-check: {out}/device-profile.yaml: no such profile file; projected on the shipped profile cpu-2core"
    assert said in output
    doc = json.loads((out / "projections" / "dry-run-bf16.cpu-2core.json").read_text())
    assert doc["device"] == "cpu-2core" and doc["device_fallback"].startswith(f"{out}/device-profile.yaml: ")


def test_another_checkout_on_the_import_path_stops_the_check(tmp_path):
    elsewhere = tmp_path.resolve() / "elsewhere"
    for package in ("bench", "moe_engine"):
        (elsewhere / package).mkdir(parents=True)
        (elsewhere / package / "__init__.py").write_text("")
    code, output = _run(["--dry-run", str(tmp_path / "check")], _env(PYTHONPATH=str(elsewhere)), timeout=120)
    assert code == 2
    assert output.strip() == (
        f"gpu-check: bench and moe_engine do not import from {ROOT} outside it (found: "
        f"{elsewhere} {elsewhere}); run pip install -e . there"
    )
    assert not (tmp_path / "check" / "steps.txt").exists()


def test_a_moe_bench_of_another_install_stops_the_check(tmp_path):
    (tmp_path / "bin").mkdir()
    other = tmp_path / "bin" / "moe-bench"
    other.write_text("#!/bin/sh\nexit 0\n")
    other.chmod(0o755)
    code, output = _run(["--dry-run", str(tmp_path / "check")], _env(PATH=str(tmp_path / "bin")), timeout=120)
    assert code == 2
    assert output.strip() == (
        f"gpu-check: moe-bench ({other}) does not run {ROOT}/bench/cli.py; run pip install -e . there"
    )


RECORDING = """#!/usr/bin/env bash
# The script's python on a GPU host, each step's command recorded instead of run; the install check real.
case " $* " in
    *"import os, bench, moe_engine"*) exec {python} "$@" ;;
esac
printf '%s|%s|%s\\n' "${{MOE_TEST_DEVICE:-}}" "${{MOE_BENCH_DEVICE:-}}" "${{*//$'\\n'/ }}" >>{log}
"""


def test_the_gpu_steps_hand_the_measured_profile_to_the_projection(tmp_path):
    python, log, out = tmp_path / "python", tmp_path / "calls.txt", tmp_path / "check"
    python.write_text(RECORDING.format(python=sys.executable, log=log))
    python.chmod(0o755)
    code, output = _run([str(out)], dict(_env(), PYTHON=str(python)), timeout=120)
    assert code == 0, output
    calls = [line.split("|") for line in log.read_text().splitlines()]
    steps = [(test, bench, args) for test, bench, args in calls if args.startswith("-m ")]
    gpu = " ".join(f"scenarios/gpu/{name}" for name in sorted(p.name for p in (ROOT / "scenarios/gpu").glob("*.yaml")))
    assert [(test, bench, args.split()[:2]) for test, bench, args in steps] == [
        ("cuda", "", ["-m", "pytest"]),
        ("", "cuda", ["-m", "pytest"]),
        ("", "", ["-m", "bench.cli"]),
        ("", "", ["-m", "bench.cli"]),
        ("", "", ["-m", "bench.cli"]),
    ]
    assert steps[2][2] == f"-m bench.cli run --suite gpu --device cuda --out {out}/results --no-plots"
    assert steps[3][2] == (
        f"-m bench.cli profile-device --device cuda --quick --name measured-gpu --base h200-sxm "
        f"--out {out}/device-profile.yaml"
    )
    assert steps[4][2] == (
        f"-m bench.cli project {gpu} --device {out}/device-profile.yaml --fallback-device h200-sxm "
        f"--out {out}/projections"
    )
