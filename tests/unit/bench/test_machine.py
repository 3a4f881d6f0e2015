"""``bench.machine``: datasheet peaks by exact device name, MFU against them (BF16, and FP8 for MXFP8 runs),
and the memory a host or GPU has free. Device names are faked: no GPU is needed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from bench import machine

CUDA = torch.device("cuda")


def fake_gpu(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize(
    "name,bf16,fp8",
    [
        ("NVIDIA H100 80GB HBM3", 989.5, 1979.0),  # SXM5
        ("NVIDIA H100 PCIe", 756.5, 1513.0),
        ("NVIDIA H100 NVL", 835.5, 1670.5),
        ("NVIDIA H200", 989.5, 1979.0),  # SXM
        ("NVIDIA H200 NVL", 835.5, 1670.5),
        ("NVIDIA B200", 2250.0, 4500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, None),
        ("NVIDIA A100 80GB PCIe", 312.0, None),
    ],
)
def test_each_part_gets_its_own_datasheet_peak(monkeypatch, name, bf16, fp8):
    fake_gpu(monkeypatch, name)
    peak, source = machine.device_peak(CUDA)
    assert (peak.bf16, peak.fp8) == (bf16, fp8)
    assert name in source and "datasheet" in source


@pytest.mark.parametrize("name", ["NVIDIA H100 SXM5 94GB", "NVIDIA H800", "NVIDIA GeForce RTX 4090", "H200"])
def test_an_unknown_part_gets_no_peak_and_a_reason(monkeypatch, name):
    # A name that merely contains a listed one is not that part: PCIe, NVL and SXM parts differ by 20-25%.
    fake_gpu(monkeypatch, name)
    peak, reason = machine.device_peak(CUDA)
    assert peak is None and repr(name) in reason and "left out rather than guessed" in reason


def test_the_table_holds_dense_figures():
    for name, peak in machine.GPU_PEAKS.items():
        # FP8 doubles BF16 on every listed part (the datasheets round each figure on its own).
        assert peak.fp8 is None or peak.fp8 == pytest.approx(2 * peak.bf16, rel=1e-3), name
        assert peak.bf16 < 2500, name  # a with-sparsity figure would be twice the dense one


def test_available_memory_of_this_host():
    free, source = machine.available_memory_bytes(torch.device("cpu"))
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert 0 < free <= total and "MemAvailable" in source


# ---- MFU through the runner and the worker ------------------------------------------------------

TINY = {
    "schema_version": 1,
    "mode": "execute",
    "model": {
        "vocab_size": 128,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 0},
    "precision": "mxfp8",
    "run": {"warmup_steps": 0, "steps": 2, "tokens_per_step": 64, "timeout_s": 120},
}


def _fake_cuda_runner(monkeypatch, tmp_path, name: str):
    """A runner on a faked one-GPU host; the worker is replaced by one that records the peaks it is given."""
    from bench.run import runner as runner_module
    from bench.run.worker_protocol import WorkerRequest

    fake_gpu(monkeypatch, name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runner_module, "cuda_free_bytes", lambda count: [80 * 2**30] * count)
    peaks = []

    def fake_worker(command, timeout, env=None):
        peaks.append(WorkerRequest.from_json(Path(command[-2]).read_text()).peaks)
        Path(command[-1]).write_text(json.dumps({"status": "ok", "error": None, "metrics": {}, "details": {}}))
        return 0, []

    monkeypatch.setattr(runner_module, "run_with_timeout", fake_worker)
    return runner_module.Runner(CUDA, tmp_path), peaks


def test_an_mxfp8_run_gets_the_fp8_peak_too(monkeypatch, tmp_path):
    from bench.scenario import scenario_from_dict

    runner, peaks = _fake_cuda_runner(monkeypatch, tmp_path, "NVIDIA H200")
    runner.run_one(scenario_from_dict(copy.deepcopy(TINY)))
    (given,) = peaks
    assert given.bf16 == 989.5 and given.fp8 == 1979.0
    # The peaks' source the worker is told to record (its own field in the result).
    assert "H200 SXM" in given.source and "'NVIDIA H200'" in given.source
    # A bf16 run is measured against the BF16 peak alone.
    bf16 = scenario_from_dict({**copy.deepcopy(TINY), "precision": "bf16", "name": "bf"})
    runner.run_one(bf16)
    assert peaks[1].bf16 == 989.5 and peaks[1].fp8 is None


def test_a_pcie_part_is_not_measured_against_the_sxm_peak(monkeypatch, tmp_path):
    from bench.scenario import scenario_from_dict

    runner, peaks = _fake_cuda_runner(monkeypatch, tmp_path, "NVIDIA H100 PCIe")
    runner.run_one(scenario_from_dict(copy.deepcopy(TINY)))
    assert peaks[0].bf16 == 756.5 and peaks[0].fp8 == 1513.0


def test_an_unknown_gpu_records_why_it_has_no_mfu(monkeypatch, tmp_path):
    from bench.scenario import scenario_from_dict

    runner, peaks = _fake_cuda_runner(monkeypatch, tmp_path, "NVIDIA Hypothetical X1")
    outcome = runner.run_one(scenario_from_dict(copy.deepcopy(TINY)))
    assert peaks[0].bf16 is None and peaks[0].fp8 is None and peaks[0].source is None
    missing = outcome.details["mfu_unavailable"]
    assert set(missing) == {"mfu", "mfu_fp8"} and "'NVIDIA Hypothetical X1'" in missing["mfu"]
    doc = json.loads(outcome.path.read_text())
    assert doc["details"]["mfu_unavailable"] == missing


def test_a_gpu_without_fp8_says_so_for_an_mxfp8_run(monkeypatch, tmp_path):
    from bench.scenario import scenario_from_dict

    runner, peaks = _fake_cuda_runner(monkeypatch, tmp_path, "NVIDIA A100-SXM4-80GB")
    outcome = runner.run_one(scenario_from_dict(copy.deepcopy(TINY)))
    assert peaks[0].bf16 == 312.0 and peaks[0].fp8 is None
    assert "no FP8" in outcome.details["mfu_unavailable"]["mfu_fp8"] and "mfu" not in outcome.details["mfu_unavailable"]


@pytest.mark.slow
def test_execute_reports_mfu_against_both_peaks():
    from bench.machine import Peaks
    from bench.run.execute import execute
    from bench.scenario import scenario_from_dict

    result = execute(scenario_from_dict(copy.deepcopy(TINY)), torch.device("cpu"), Peaks(2.0, 4.0, "given by the test"))
    m = result.metrics
    for mfu, mfu_fp8, tflops in zip(m["mfu"]["samples"], m["mfu_fp8"]["samples"], m["tflops_per_gpu"]["samples"]):
        assert mfu == pytest.approx(tflops / 2.0) and mfu_fp8 == pytest.approx(tflops / 4.0)
    assert result.details["peak_tflops_fp8"] == 4.0 and result.details["peak_tflops_source"] == "given by the test"
    bf16 = execute(
        scenario_from_dict({**copy.deepcopy(TINY), "precision": "bf16"}), torch.device("cpu"), Peaks(2.0, 4.0)
    )
    assert "mfu" in bf16.metrics and "mfu_fp8" not in bf16.metrics  # the FP8 peak bounds MXFP8 runs only


@pytest.mark.slow
def test_the_worker_measures_against_the_peaks_it_was_sent():
    from bench.machine import Peaks
    from bench.run.worker import execute_outcome
    from bench.run.worker_protocol import WorkerRequest
    from bench.scenario import scenario_from_dict

    scenario = scenario_from_dict(copy.deepcopy(TINY))
    request = WorkerRequest(scenario.spec, None, "cpu", Peaks(2.0, 4.0, "the runner's words"))
    outcome = execute_outcome(scenario, request, torch.device("cpu"), None)
    m = outcome.metrics
    for mfu, mfu_fp8, tflops in zip(m["mfu"]["samples"], m["mfu_fp8"]["samples"], m["tflops_per_gpu"]["samples"]):
        assert mfu == pytest.approx(tflops / 2.0) and mfu_fp8 == pytest.approx(tflops / 4.0)
    assert (outcome.details["peak_tflops"], outcome.details["peak_tflops_fp8"]) == (2.0, 4.0)
    assert outcome.details["peak_tflops_source"] == "the runner's words"


# Machine identity: results of two machines of one name are not compared -----------------------------

IDENTITY = {
    "cpu_model": "Intel(R) Xeon(R) Processor",
    "cpu_cores": 2,
    "isa_flags": ["avx", "avx2", "avx512f", "fma"],
    "memory_gib": 23.6,
    "gpu": None,
    "calibration": {"kernel": "fp32 512x512 matmul", "gflops": 100.0, "samples": [100.0]},
}


def _identity(**changes):
    out = copy.deepcopy(IDENTITY)
    for key, value in changes.items():
        if key == "gflops":
            out["calibration"]["gflops"] = value
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"gflops": 85.0}, "calibration 100.0 vs 85.0 GFLOP/s (x0.85"),
        ({"gflops": 112.0}, "calibration 100.0 vs 112.0 GFLOP/s (x1.12"),
        ({"isa_flags": ["avx", "avx2", "avx512_bf16", "avx512f", "fma"]}, "ISA flags avx+avx2+avx512f+fma vs"),
        ({"cpu_cores": 4}, "cores 2 vs 4"),
        ({"memory_gib": 30.0}, "memory 23.6 GiB vs 30.0 GiB"),
    ],
)
def test_two_machines_of_one_name_differ_by_what_their_identities_say(changes, words):
    from bench.results import identity_difference

    assert words in identity_difference(IDENTITY, _identity(**changes))


def test_one_machine_within_the_tolerance_is_the_same_machine():
    from bench.results import IDENTITY_TOLERANCE, identity_difference

    assert identity_difference(IDENTITY, _identity(gflops=100.0 * (1 + IDENTITY_TOLERANCE * 0.9))) is None
    assert identity_difference(IDENTITY, _identity(gflops=95.0, memory_gib=23.5)) is None
    assert identity_difference(None, None) is None  # two results from before identities: compared as ever
    assert "baseline records no machine identity" in identity_difference(None, IDENTITY)


def _side(folder: Path, version: str, gflops: float, tokens: float) -> Path:
    """One crafted result of e8-skewed-fp32 on ``cpu-2c-intel-r-xeon`` whose machine calibrated at ``gflops``."""
    from result_docs import make_doc

    from bench.results import metric, write_result

    metrics = {
        "tokens_per_s_per_gpu": metric([tokens * f for f in (0.99, 1.0, 1.01)], "tokens/s", "higher"),
        "step_time_s": metric([2048 / tokens * f for f in (0.99, 1.0, 1.01)], "s", "lower"),
    }
    data = make_doc("e8-skewed-fp32", metrics, version=version, machine="cpu-2c-intel-r-xeon")
    data["scenario"]["file"] = "scenarios/smoke/e8-skewed-fp32.yaml"
    data["engine"]["git_commit"] = "695ee76d8b6aa4d5c692e8d721ed083ff4266191" if version == "0.2.0" else "abc"
    data["machine"] = {**data["machine"], "gpu_name": None, "gpu_count": 0, "identity": _identity(gflops=gflops)}
    return write_result(data, folder / version / "cpu-2c-intel-r-xeon")


def test_two_crafted_machines_are_not_compared_and_the_gate_and_page_say_how_to_compare(tmp_path):
    """The issue's case: one label, two VMs 15-20% apart; the newer version reads 21% slower."""
    from bench.gate.compare import compare_paths
    from bench.gate.verdict import gate
    from bench.report.page import build_report

    _side(tmp_path / "r", "0.2.0", gflops=100.0, tokens=18617.0)
    _side(tmp_path / "r", "0.3.0", gflops=80.0, tokens=14678.0)
    comparison = compare_paths(tmp_path / "r" / "0.2.0", tmp_path / "r" / "0.3.0")
    assert comparison.regressions == () and comparison.compared == ()
    (issue,) = comparison.not_compared
    assert issue.kind == "different_machines" and "calibration 100.0 vs 80.0" in issue.reason
    assert gate(comparison).exit_code == 3  # not compared: neither a pass nor a regression
    line = gate(comparison).failures[0]
    assert line.startswith("DIFFERENT MACHINES e8-skewed-fp32: different machines: not compared")
    assert "moe-bench ab scenarios/smoke/e8-skewed-fp32.yaml --baseline-ref 695ee76d8b6a" in line

    page = build_report(tmp_path / "r", tmp_path / "page", releases=["0.2.0"]).path.read_text()
    assert "data-gate='not-compared'" in page and "<b>Regressed</b>" not in page
    assert "different machines: not compared" in page and "moe-bench ab scenarios/smoke/e8-skewed-fp32.yaml" in page

    # The same two results from one machine (calibrations 3% apart) are compared: a regression.
    _side(tmp_path / "same", "0.2.0", gflops=100.0, tokens=18617.0)
    _side(tmp_path / "same", "0.3.0", gflops=97.0, tokens=14678.0)
    same = compare_paths(tmp_path / "same" / "0.2.0", tmp_path / "same" / "0.3.0")
    assert same.not_compared == () and {r.metric for r in same.regressions} == {"tokens_per_s_per_gpu", "step_time_s"}


def test_the_repositorys_0_2_0_results_are_not_compared_with_a_run_here(tmp_path):
    """0.2.0's results record no identity (another VM with this label wrote them): a result that
    carries this machine's measured identity is not compared with them."""
    from bench.gate.compare import compare
    from bench.results import REPO_ROOT, load_result, load_results, write_result

    stored = load_results(REPO_ROOT / "results" / "0.2.0")
    here = copy.deepcopy(
        load_result(REPO_ROOT / "results" / "0.2.0" / "cpu-2c-intel-r-xeon" / "e8-skewed-fp32.json").data
    )
    info = machine.machine_info()
    here["engine"]["version"] = "0.3.0+1.gabc"
    here["machine"] = {**here["machine"], "identity": machine.machine_identity(info, machine.calibrate())}
    path = write_result(here, tmp_path / "here")
    comparison = compare([d for d in stored if d.name == "e8-skewed-fp32"], [load_result(path)])
    (issue,) = comparison.not_compared
    assert issue.kind == "different_machines" and comparison.rows == ()
    assert "the baseline records no machine identity" in issue.reason
    assert "--baseline-ref 695ee76d8b6a" in issue.command


def test_the_gate_exits_3_when_not_compared_and_1_when_something_also_regressed(tmp_path, capsys):
    """``moe-bench gate``: two machines alone exit 3 (NOT COMPARED); a real regression beside them exits 1."""
    from bench.cli import main

    _side(tmp_path / "base", "0.2.0", gflops=100.0, tokens=18617.0)
    _side(tmp_path / "cand", "0.3.0", gflops=80.0, tokens=14678.0)
    assert main(["gate", "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")]) == 3
    out = capsys.readouterr().out
    assert out.startswith("NOT COMPARED: 0 scenario(s) compared") and "DIFFERENT MACHINES e8-skewed-fp32" in out

    # A second scenario on one machine (calibrations 2% apart) that regressed: the regression decides.
    from result_docs import make_doc

    from bench.results import metric, write_result

    for side, version, tokens in (("base", "0.2.0", 1000.0), ("cand", "0.3.0", 800.0)):
        data = make_doc(
            "e64-random-bf16",
            {"tokens_per_s_per_gpu": metric([tokens] * 3, "tokens/s", "higher")},
            version=version,
            machine="other-box",
        )
        data["machine"] = {**data["machine"], "identity": _identity(gflops=100.0 if side == "base" else 98.0)}
        write_result(data, tmp_path / side / version / "other-box")
    assert main(["gate", "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL: 1 scenario(s) compared") and "REGRESSION e64-random-bf16" in out
