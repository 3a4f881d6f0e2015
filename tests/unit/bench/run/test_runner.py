"""moe-bench run: scenario validation, bad input, end-to-end execute, statuses, result files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from result_docs import make_doc
from scenario_files import TINY, variant, write_scenario

from bench import results
from bench.cli import main
from bench.results import load_results, write_result
from bench.run.suites import suite_files
from bench.scenario import SCENARIOS_DIR, load_scenario

ALL_SCENARIOS = sorted(p for p in SCENARIOS_DIR.rglob("*.yaml") if p.name != "suites.yaml")


@pytest.mark.parametrize("path", ALL_SCENARIOS, ids=lambda p: str(p.relative_to(SCENARIOS_DIR)))
def test_every_shipped_scenario_validates(path):
    scenario = load_scenario(path)
    assert scenario.name == path.stem


def test_suites_resolve_to_existing_scenarios():

    default = suite_files("default", torch.device("cpu"))
    assert any("smoke" in str(p) for p in default) and any("olmo-core3" in str(p) for p in default)
    # The proxies take minutes each on a CPU: they have a suite of their own.
    proxies = suite_files("proxy", torch.device("cpu"))
    assert [p.name for p in proxies] == [
        "moe-1.2t-512gpu-proxy.yaml",
        "moe-128e-47b-proxy.yaml",
        "moe-2.38t-proxy.yaml",
    ]
    assert not set(proxies) & set(default)
    recompute = suite_files("proxy-recompute", torch.device("cpu"))
    assert sorted(p.name for p in recompute) == [
        "moe-1.2t-512gpu-recompute-full-proxy.yaml",
        "moe-1.2t-512gpu-recompute-selective-proxy.yaml",
        "moe-128e-47b-recompute-full-proxy.yaml",
        "moe-128e-47b-recompute-selective-proxy.yaml",
    ]
    assert not set(recompute) & (set(default) | set(proxies))
    assert set(suite_files("ci", torch.device("cpu"))) <= set(ALL_SCENARIOS)


BAD_INPUTS = [
    ("not-yaml", "model: [unclosed\n  d_model: 3", "(top level): not valid YAML"),
    ("schema", variant(model__moe__top_k="two"), "model.moe.top_k: 'two' is not of type 'integer'"),
    ("unknown-field", variant(model__moe__experts=8), "model.moe: Additional properties"),
    ("top-k", variant(model__moe__top_k=9), "model.moe.top_k: 9 exceeds moe.num_experts=8"),
    ("ep-experts", variant(parallel={"dp": 3, "ep": 3}), "parallel.ep: ep=3 does not divide model.moe.num_experts=8"),
    ("ep-dp", variant(parallel={"dp": 2, "ep": 4}), "parallel.ep: ep=4 does not divide dp=2"),
    ("pp-layers", variant(parallel={"pp": 4}), "parallel.pp: pp * virtual_stages = 4 exceeds model.n_layers=2"),
    ("fsdp-ep", variant(parallel={"dp": 2, "ep": 2, "dp_mode": "fsdp"}), "parallel.dp_mode: the engine's fsdp mode"),
    (
        "mxfp8-backend",
        variant(precision="mxfp8", model__moe__backend="loop"),
        "model.moe.backend: precision mxfp8 runs the mxfp8 expert backend",
    ),
    ("world-size", variant(parallel={"dp": 2, "world_size": 4}), "parallel.world_size: 4 != dp * pp = 2"),
    ("plan-without-cluster", variant(mode="plan"), "(top level): 'cluster' is a required property"),
    ("tokens", variant(run__tokens_per_step=100), "run.tokens_per_step: 100 is not a multiple of model.seq_len=32"),
    # Pipeline layouts torch.distributed.pipelining refuses: caught here, not 10 s later inside the ranks.
    (
        "pp2-1f1b-one-microbatch",
        variant(parallel={"pp": 2, "microbatches": 1}),
        "parallel.microbatches: schedule 1f1b needs at least one microbatch per stage, pp=2; got 1",
    ),
    (
        "pp2-interleaved-rounds",
        variant(
            model__n_layers=4,
            run__tokens_per_step=320,
            parallel={"pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2, "microbatches": 5},
        ),
        "parallel.microbatches: schedule interleaved1f1b runs microbatches in rounds of about pp=2: 5 microbatches "
        "make 2 rounds and do not split into them (the nearest counts that do: 4, 6)",
    ),
    (
        "virtual-stages-schedule",
        variant(model__n_layers=4, parallel={"pp": 2, "virtual_stages": 2}),
        "parallel.virtual_stages: more than one stage per rank needs schedule interleaved1f1b",
    ),
    (
        "stages-blocks",
        variant(parallel={"pp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2}),
        "parallel.pp: pp * virtual_stages = 4 exceeds model.n_layers=2",
    ),
    (
        "batch-microbatches",
        variant(parallel={"dp": 2, "microbatches": 3}),
        "parallel.microbatches: 2 sequences per rank do not split into 3 microbatches",
    ),
    (
        "batch-default-microbatches",
        variant(parallel={"pp": 2}, run__tokens_per_step=96),
        "parallel.microbatches: 3 sequences per rank do not split into 2 microbatches (parallel.microbatches is not "
        "set: it defaults to pp=2)",
    ),
    (
        "recompute-mode",
        variant(recompute={"mode": "partial"}),
        "recompute.mode: 'partial' is not one of ['none', 'full', 'selective']",
    ),
    (
        "recompute-part",
        variant(recompute={"mode": "selective", "parts": ["mlp"]}),
        "recompute.parts.0: 'mlp' is not one of ['attention', 'experts', 'norms']",
    ),
    (
        "recompute-no-parts",
        variant(recompute={"mode": "selective"}),
        "recompute.parts: selective recompute needs at least one part",
    ),
    (
        "recompute-parts-full",
        variant(recompute={"mode": "full", "parts": ["norms"]}),
        "recompute.parts: only selective recompute takes parts, not mode full",
    ),
    ("recompute-every", variant(recompute={"mode": "full", "every": 3}), "recompute.every: 3 exceeds model.n_layers=2"),
    (
        "recompute-first-per-stage",
        variant(parallel={"pp": 2, "microbatches": 2}, recompute={"mode": "full", "first_per_stage": 2}),
        "recompute.first_per_stage: 2 exceeds the 1 blocks of the smallest pipeline stage",
    ),
    (
        "recompute-two-subsets",
        variant(model__n_layers=4, recompute={"mode": "full", "every": 2, "first_per_stage": 1}),
        "recompute.first_per_stage: choose one block subset: every=2 or first_per_stage=1",
    ),
    ("max-grad-norm", variant(run__max_grad_norm=-1), "run.max_grad_norm: -1 is less than the minimum of 0"),
    (
        "grad-dtype",
        variant(parallel={"grad_dtype": "bf16"}),
        "parallel.grad_dtype: 'bf16' is not one of ['fp32', 'param']",
    ),
    # The model fields of public architectures: head_dim, MLA, interleave, groups, tied embeddings.
    ("head-dim-odd", variant(model__head_dim=7), "model.head_dim: 7 must be even for RoPE"),
    (
        "mla-rope-odd",
        variant(
            model__n_kv_heads=4,
            model__mla={"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 3, "v_head_dim": 8},
        ),
        "model.mla.qk_rope_head_dim: must be even and >= 2 for RoPE",
    ),
    (
        "mla-kv-heads",
        variant(model__mla={"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}),
        "model.n_kv_heads: multi-head latent attention up-projects keys and values for every head",
    ),
    (
        "mla-head-dim",
        variant(
            model__n_kv_heads=4,
            model__head_dim=16,
            model__mla={"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
        ),
        "model.head_dim: multi-head latent attention sets its own head widths",
    ),
    (
        "mla-missing-dim",
        variant(model__mla={"kv_lora_rank": 16}),
        "model.mla: 'qk_nope_head_dim' is a required property",
    ),
    (
        "moe-every",
        variant(model__n_layers=4, model__n_dense_layers=1, model__dense_hidden=32, model__moe_every=4),
        "model.moe_every: 4 exceeds the 3 blocks after the n_dense_layers=1 leading dense ones",
    ),
    (
        "moe-every-dense-hidden",
        variant(model__moe_every=2),
        "model.dense_hidden: must be >= 1 when the model has dense blocks",
    ),
    ("groups-divide", variant(model__moe__n_groups=3), "model.moe.n_groups: 3 groups do not divide moe.num_experts=8"),
    (
        "top-groups",
        variant(model__moe__n_groups=4, model__moe__top_groups=5),
        "model.moe.top_groups: must be between 1 and moe.n_groups=4, got 5",
    ),
    (
        "top-k-groups",
        variant(model__moe__n_groups=8, model__moe__top_groups=1),
        "model.moe.top_k: 2 exceeds the 1 experts of the 1 chosen groups",
    ),
    (
        "tied-pp",
        variant(model__tie_embeddings=True, parallel={"pp": 2}),
        "model.tie_embeddings: tied embeddings need the embedding and the LM head on one pipeline rank; pp=2",
    ),
    (
        "proxy-blocks-interleaved",
        variant(
            mode="proxy",
            model__n_layers=4,
            model__moe_every=2,
            model__dense_hidden=32,
            proxy={"cpu_scale": {"blocks": 1}},
            cluster={"gpus": 1, "gpu_memory_gib": 80, "peak_tflops": 900},
        ),
        "proxy.cpu_scale.blocks: scaling the blocks needs a model without dense layers (n_dense_layers 0, moe_every 1)",
    ),
]


@pytest.mark.parametrize("name, data, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_stops_before_any_work(tmp_path, capsys, name, data, message):
    good = write_scenario(tmp_path, "good", TINY)
    bad = write_scenario(tmp_path, name, data)
    out = tmp_path / "results"
    code = main(["run", str(good), str(bad), "--out", str(out), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"moe-bench: error: {bad}: {message}" or (
        err.startswith(f"moe-bench: error: {bad}: ") and message in err
    ), err
    assert "Traceback" not in err
    assert err.count("\n") == 1, "one message, one line"
    assert not out.exists(), "nothing may be written on bad input"


def test_missing_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "r")]) == 2
    assert "no such scenario file" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "r")]) == 2
    assert "no such scenario file" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_pipeline_without_microbatches_gets_one_per_stage(tmp_path):
    path = write_scenario(tmp_path, "pp2", variant(parallel={"pp": 2}))
    scenario = load_scenario(path)
    # The scenario as run names the count that runs (1F1B needs at least pp).
    assert scenario.parallel["microbatches"] == scenario.parallel_config.microbatches == 2
    scenario.parallel_config.validate_executable()
    assert load_scenario(write_scenario(tmp_path, "pp1", TINY)).parallel["microbatches"] == 1


def _document():
    return make_doc("x", {"step_time_s": results.metric([1.0, 2.0, 3.0, 4.0], "s", "lower")})


def test_existing_results_are_never_overwritten(tmp_path):
    first = write_result(_document(), tmp_path)
    second = write_result(_document(), tmp_path)
    assert first.name == "x.json" and second.name == "x.2.json"
    assert json.loads(first.read_text())["scenario"]["name"] == "x"


def test_crash_mid_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def crash(fd):
        raise OSError("disk vanished")

    monkeypatch.setattr(results.os, "fsync", crash)
    with pytest.raises(OSError, match="disk vanished"):
        write_result(_document(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_invalid_document_is_not_written(tmp_path):
    doc = _document()
    doc["status"] = "exploded"
    with pytest.raises(results.ResultValidationError, match="status"):
        write_result(doc, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_metric_statistics():
    m = results.metric([4.0, 1.0, 3.0, 2.0, 100.0], "s", "lower")
    assert m["median"] == 3.0
    assert m["spread"]["min"] == 1.0 and m["spread"]["max"] == 100.0
    assert m["spread"]["iqr"] == 2.0  # quartiles 2 and 4 (inclusive method)
    assert m["spread"]["rel_iqr"] == pytest.approx(2 / 3)


def test_run_stops_when_the_results_folder_is_not_writable(tmp_path, capsys):
    """In a container running as the wrong uid, the run stops before any work with one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["run", "scenarios/smoke/e8-random-bf16.yaml", "--out", str(blocker / "results")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error:") and "results folder not writable" in err and "HOST_UID" in err


# ---- memory check before starting ----------------------------------------------------------------

GPU_SCENARIO = SCENARIOS_DIR / "gpu" / "e8-top4-random-bf16.yaml"  # 0.7B parameters, 16 x 4096 tokens a step


class WorkerStarted(AssertionError):
    pass


def no_worker(*args, **kwargs):
    raise WorkerStarted("a worker process was started")


def fake_host(monkeypatch, available_gib: float):
    """This host has ``available_gib`` free; the CPU peak measurement is skipped."""
    from bench.run import execute, runner

    source = "MemAvailable in /proc/meminfo"
    monkeypatch.setattr(
        runner, "available_memory_bytes", lambda device: (int(available_gib * 2**30), source), raising=False
    )
    monkeypatch.setattr(execute, "measure_peak_tflops", lambda device, dtype, seconds=1.0: 1.0)


def test_a_scenario_that_cannot_fit_is_recorded_oom_without_starting(tmp_path, monkeypatch, capsys):
    from bench.predict.plan import plan_scenario
    from bench.run import execute, runner

    fake_host(monkeypatch, 22.8)
    monkeypatch.setattr(runner, "run_with_timeout", no_worker)
    popen = subprocess.Popen

    def no_worker_process(command, *args, **kwargs):  # git and platform queries may still run
        if any("bench.run.worker" in str(part) for part in command):
            no_worker()
        return popen(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", no_worker_process)
    monkeypatch.setattr(execute, "measure_peak_tflops", no_worker)  # refused before any measurement too
    out = tmp_path / "results"
    assert main(["run", str(GPU_SCENARIO), "--out", str(out), "--device", "cpu", "--no-plots"]) == 1
    (doc,) = load_results(out)
    planned = plan_scenario(load_scenario(GPU_SCENARIO))[0]["memory_total_bytes"]["median"]
    assert planned > (1 + runner.MEMORY_MARGIN) * 22.8 * 2**30  # cannot fit the fake host, margin included
    assert doc.status == "oom" and doc.metrics == {}
    assert doc.data["error"] == (
        f"planned {planned / 2**30:.1f} GiB per rank, 22.8 GiB available (MemAvailable in /proc/meminfo); "
        "not started (moe-bench run --force starts it anyway)"
    )
    check = doc.data["details"]["memory_check"]
    assert check["pools"][0]["planned_bytes"] == planned and check["forced"] is False
    assert "planned" in capsys.readouterr().out


def test_force_starts_it_anyway(tmp_path, monkeypatch):
    from bench.run import runner

    fake_host(monkeypatch, 22.8)
    started = []

    def fake_worker(command, timeout, env=None):
        started.append(command)
        Path(command[-1]).write_text(json.dumps({"status": "ok", "error": None, "metrics": {}, "details": {}}))
        return 0, []

    monkeypatch.setattr(runner, "run_with_timeout", fake_worker)
    out = tmp_path / "results"
    assert main(["run", str(GPU_SCENARIO), "--out", str(out), "--device", "cpu", "--no-plots", "--force"]) == 0
    assert len(started) == 1
    (doc,) = load_results(out)
    check = doc.data["details"]["memory_check"]
    assert doc.status == "ok" and check["forced"] is True and check["shortfall"].startswith("planned ")


def test_a_scenario_that_fits_is_started(tmp_path, monkeypatch):
    from bench.run import runner

    fake_host(monkeypatch, 22.8)
    monkeypatch.setattr(runner, "run_with_timeout", no_worker)
    with pytest.raises(WorkerStarted):
        main(["run", str(write_scenario(tmp_path, "tiny", TINY)), "--out", str(tmp_path / "r"), "--device", "cpu"])


def test_ranks_sharing_a_host_are_summed_and_the_margin_is_kept():
    from bench.run.memory import MEMORY_MARGIN, RankMemory, memory_shortfall

    gib = 2**30
    assert MEMORY_MARGIN == 0.10

    def host(*planned, available, name="h"):
        return [
            RankMemory(r, name, "cpu", int(p * gib), int(available * gib), "MemAvailable")
            for r, p in enumerate(planned)
        ]

    # Two pipeline stages of 10 and 2 GiB on a 13 GiB host fit, though 10 > 13 / 2.
    assert memory_shortfall(host(10, 2, available=13))[0] is None
    reason, pools = memory_shortfall(host(10, 2, available=10))
    assert reason == (
        "planned 12.0 GiB for the 2 ranks sharing this host's memory (10.0 GiB on the most loaded), "
        "10.0 GiB available (MemAvailable); not started"
    )
    assert pools == [
        {
            "pool": "this host's memory",
            "ranks": 2,
            "planned_bytes": 12 * gib,
            "available_bytes": 10 * gib,
            "source": "MemAvailable",
        }
    ]
    # Within the margin the run decides; past it, it is refused.
    assert memory_shortfall(host(10.9, available=10))[0] is None
    assert memory_shortfall(host(11.1, available=10))[0].startswith("planned 11.1 GiB per rank, 10.0 GiB available")
    # Hosts of a launch are pools of their own (named by index, not by host name) ...
    two_nodes = host(10, available=10.5, name="a") + host(10, available=10.5, name="b")
    assert memory_shortfall(two_nodes)[0] is None
    assert [p["pool"] for p in memory_shortfall(two_nodes)[1]] == ["node 0's memory", "node 1's memory"]
    # ... and so are GPUs: one full GPU is enough to refuse.
    gpus = [
        RankMemory(0, "h", "cuda:0", 5 * gib, 80 * gib, "free"),
        RankMemory(1, "h", "cuda:1", 90 * gib, 80 * gib, "free"),
    ]
    assert memory_shortfall(gpus)[0] == "planned 90.0 GiB per rank, 80.0 GiB available (free); not started"


# ---- who writes what in the result's details ----------------------------------------------------


def test_the_workers_peak_fields_reach_the_result_as_it_wrote_them(tmp_path, monkeypatch):
    from bench.run import runner

    fake_host(monkeypatch, 64)
    worker_details = {"peak_tflops": 1.0, "peak_tflops_fp8": None, "peak_tflops_source": "the worker's own words"}

    def fake_worker(command, timeout, env=None):
        Path(command[-1]).write_text(
            json.dumps({"status": "ok", "error": None, "metrics": {}, "details": worker_details})
        )
        return 0, []

    monkeypatch.setattr(runner, "run_with_timeout", fake_worker)
    out = tmp_path / "results"
    assert main(["run", str(write_scenario(tmp_path, "tiny", TINY)), "--out", str(out), "--device", "cpu"]) == 0
    (doc,) = load_results(out)
    assert {k: doc.data["details"][k] for k in worker_details} == worker_details
    assert doc.data["details"]["memory_check"]["forced"] is False  # the runner's own field, added


@pytest.mark.slow
def test_the_peak_and_its_source_go_to_the_worker_which_records_them(tmp_path, monkeypatch):
    """The runner hands its peak and the peak's source to the worker (``bench.run.worker``, run in this
    process here); the worker measures MFU against it and records both."""
    from bench.run import runner, worker

    fake_host(monkeypatch, 64)  # measure_peak_tflops: 1.0 TFLOP/s

    def worker_in_process(command, timeout, env=None):
        return worker.main(command[command.index("bench.run.worker") + 1 :]), []

    monkeypatch.setattr(runner, "run_with_timeout", worker_in_process)
    out = tmp_path / "results"
    assert main(["run", str(write_scenario(tmp_path, "tiny", TINY)), "--out", str(out), "--device", "cpu"]) == 0
    (doc,) = load_results(out)
    details = doc.data["details"]
    assert details["peak_tflops"] == 1.0 and details["peak_tflops_fp8"] is None
    assert details["peak_tflops_source"] == "fp32 dense matmul measured on all cores, divided by the ranks sharing them"
    mfu, tflops = doc.metrics["mfu"]["samples"], doc.metrics["tflops_per_gpu"]["samples"]
    assert mfu == pytest.approx(tflops)  # against the 1.0 TFLOP/s peak


@pytest.mark.parametrize(
    "times, median",
    [
        ([0.4, 0.1, 0.3, 0.2], 0.25),  # even: the mean of the two middle steps, 0.2 and 0.3
        ([0.5, 0.1, 0.3], 0.3),
        ([0.7, 0.2, 0.9, 0.1, 0.4, 0.3], 0.35),  # middle two of 0.1 0.2 0.3 0.4 0.7 0.9
    ],
)
def test_a_ranks_median_step_is_the_median(times, median):
    from bench.run.execute import _rank_details, _RankRecord

    details = _rank_details(_RankRecord(rank=0, step_times=times), None)
    assert details["step_time_s_median"] == pytest.approx(median, rel=1e-12)
