"""moe-bench run end to end: scenarios run in worker processes, recorded as they ran."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from scenario_files import TINY, variant, write_scenario

from bench import results
from bench.cli import main
from bench.results import load_results
from bench.scenario import load_scenario
from moe_engine.flops import training_flops_per_token
from moe_engine.precision.cpu_bf16 import gemm_details


def run_cli(tmp_path, *scenarios) -> tuple[int, list]:
    files = [str(write_scenario(tmp_path, name, data)) for name, data in scenarios]
    out = tmp_path / "results"
    code = main(["run", *files, "--out", str(out), "--device", "cpu"])
    return code, load_results(out) if out.exists() else []


@pytest.mark.slow
def test_recompute_flops_are_the_extra_matmuls_the_step_runs(tmp_path):
    """hardware_tflops_per_gpu counts the model's FLOPs plus the recompute's: the formula's recompute
    FLOPs must be what a recomputing step's counted matmuls (work_matmul_flops) add to the same step
    without recompute. The convention leaves out the attention scores and the router's GEMM, which
    the counter sees; at these sizes they are a few percent of the recompute."""
    code, docs = run_cli(tmp_path, ("none", TINY), ("full", variant(recompute={"mode": "full"})))
    assert code == 0
    by_name = {doc.data["scenario"]["name"]: doc for doc in docs}
    none, full = by_name["none"], by_name["full"]
    tokens = TINY["run"]["tokens_per_step"]
    recompute = full.data["details"]["recompute_flops_per_token"]
    assert none.data["details"]["recompute_flops_per_token"] == 0
    counted = full.metrics["work_matmul_flops"]["median"] - none.metrics["work_matmul_flops"]["median"]
    assert recompute * tokens == pytest.approx(counted, rel=0.1)
    ratio = full.metrics["hardware_tflops_per_gpu"]["median"] / full.metrics["tflops_per_gpu"]["median"]
    assert ratio == pytest.approx(1 + recompute / full.data["details"]["flops_per_token"], rel=1e-9)
    assert none.metrics["hardware_tflops_per_gpu"]["median"] == none.metrics["tflops_per_gpu"]["median"]


@pytest.mark.slow
def test_smoke_run_end_to_end_is_consistent(tmp_path):
    code, docs = run_cli(tmp_path, ("tiny", TINY))
    assert code == 0
    (doc,) = docs
    assert doc.status == "ok" and doc.data["mode"] == "execute"
    assert doc.path.parent.parent.name == doc.version
    assert doc.path.parent.name == doc.machine
    m = doc.metrics
    assert len(m["step_time_s"]["samples"]) == 3
    tokens_per_step = TINY["run"]["tokens_per_step"]
    flops_per_token = training_flops_per_token(load_scenario(doc.path.parent.parent.parent.parent / "tiny.yaml").model)
    for step_time, tokens_per_s, tflops in zip(
        m["step_time_s"]["samples"], m["tokens_per_s_per_gpu"]["samples"], m["tflops_per_gpu"]["samples"]
    ):
        assert tokens_per_s * step_time == pytest.approx(tokens_per_step, rel=1e-9)
        assert tflops == pytest.approx(flops_per_token * tokens_per_s / 1e12, rel=1e-9)
    assert m["peak_tensor_bytes"]["median"] > 0 and m["rss_peak_bytes"]["median"] > m["peak_tensor_bytes"]["median"]
    assert 0 < m["mfu"]["median"] < 1
    # Random routing over 8 experts of 2 x 128 assignments: around 32 each, never all on one expert.
    assert m["tokens_per_expert_max"]["median"] < 128
    assert doc.data["scenario"]["hash"] == results.scenario_hash(doc.data["scenario"]["spec"])
    assert doc.data["engine"]["git_commit"] is None or len(doc.data["engine"]["git_commit"]) == 40


@pytest.mark.slow
def test_failures_are_recorded_and_the_suite_goes_on(tmp_path):
    # The reference path: its backward turns the overflow into NaN at once (the fused loss does not, yet).
    nan = variant(model__init_std=1e30, model__fused_kernels=False)
    slow = variant(run__timeout_s=0.5)
    code, docs = run_cli(tmp_path, ("nan", nan), ("slow", slow), ("tiny", TINY))
    assert code == 1
    by_name = {d.name: d for d in docs}
    assert by_name["nan"].status == "failed" and "loss is nan" in by_name["nan"].data["error"]
    assert by_name["slow"].status == "timeout" and "timeout of 0.5 s" in by_name["slow"].data["error"]
    assert by_name["tiny"].status == "ok"


@pytest.mark.slow
def test_mxfp8_scenario_records_the_path_that_ran(tmp_path):
    code, docs = run_cli(
        tmp_path,
        ("mx", variant(precision="mxfp8")),
        ("bf", variant(precision="bf16", model__fused_kernels=False)),
        ("fused", variant(precision="bf16", model__fused_kernels=True)),
    )
    assert code == 0
    by_name = {d.name: d for d in docs}
    mx, bf, fused = by_name["mx"].data, by_name["bf"].data, by_name["fused"].data
    assert mx["details"]["expert_backend"] == "mxfp8"
    assert mx["details"]["expert_backend_path"] == "torch-emulation"  # no GPU: the emulation, and it says so
    assert bf["details"]["expert_backend"] == "torch"
    # How the timed steps ran their GEMMs: in fp32 from bf16 operands where this CPU has no bf16 arithmetic.
    assert bf["details"]["gemms"] == gemm_details("cpu", torch.bfloat16)
    assert mx["details"]["gemms"] == gemm_details("cpu", torch.bfloat16)
    # Same seed, same data: the first measured losses agree to MXFP8 accuracy.
    assert mx["details"]["losses"][0] == pytest.approx(bf["details"]["losses"][0], rel=0.02)
    # Fused kernels on a CPU run their reference compositions and say so, op by op.
    assert bf["details"]["fused_kernels"] == "off"
    paths = dict(part.split(": ", 1) for part in fused["details"]["fused_kernels"].split("; "))
    assert set(paths) >= {"rms_norm", "swiglu", "linear_cross_entropy", "rope", "router_scores", "gather_rows"}
    assert all(path == "reference: the Triton kernel runs on CUDA devices, not cpu" for path in paths.values())
    assert fused["details"]["losses"][0] == pytest.approx(bf["details"]["losses"][0], rel=0.02)


# ---- memory check before starting ----------------------------------------------------------------


QUERY_IN_A_FRESH_PROCESS = """
import json, torch
from bench.run.memory import cuda_free_bytes
free = cuda_free_bytes(torch.cuda.device_count())
initialized = torch.cuda.is_initialized()
print(json.dumps({"free": free, "initialized": initialized,
                  "total": [torch.cuda.get_device_properties(i).total_memory for i in range(len(free))]}))
"""


@pytest.mark.cuda
def test_the_gpu_memory_query_leaves_cuda_uninitialised_in_the_asking_process():
    import sys

    from bench.results import REPO_ROOT

    # A fresh process: this one may have initialised CUDA in an earlier test.
    done = subprocess.run(
        [sys.executable, "-c", QUERY_IN_A_FRESH_PROCESS],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["initialized"] is False
    assert len(answer["free"]) >= 1 and all(0 < f <= t for f, t in zip(answer["free"], answer["total"]))
