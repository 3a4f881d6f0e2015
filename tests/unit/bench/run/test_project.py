"""``moe-bench project``: documents, bad input (exit 2, the file and field named), and a layout that does not fit."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from bench.cli import main
from bench.predict.device import DEVICES_DIR
from bench.scenario import ScenarioError, load_scenario, scenario_from_dict

SMALL = "scenarios/smoke/e8-ep2-nosync-bf16.yaml"


def test_projection_document_on_a_gpu(tmp_path, capsys):
    assert main(["project", SMALL, "--device", "h100-sxm", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e8-ep2-nosync-bf16.h100-sxm.json").read_text())
    steps = {
        k: v
        for k, v in doc["breakdown_s"].items()
        if k
        in (
            "compute",
            "expert_comm",
            "pipeline_comm",
            "bubble",
            "grad_sync_exposed",
            "optimizer",
            "param_gather_exposed",
            "other_comm",
            "skew",
            "fsdp_gather_exposed",
        )
    }
    assert doc["step_s"] == pytest.approx(sum(steps.values()))
    assert doc["tokens_per_s_per_gpu"] == pytest.approx(doc["tokens_per_step"] / doc["step_s"] / doc["world_size"])
    assert doc["mfu"] == pytest.approx(doc["tflops_per_gpu"] / 989.4)
    assert doc["memory"]["fits"] and doc["breakdown_s"]["expert_comm"] > 0
    assert "tokens/s/GPU" in capsys.readouterr().out


def test_unknown_device_exits_2(tmp_path, capsys):
    assert main(["project", SMALL, "--device", "h900", "--out", str(tmp_path)]) == 2
    assert "--device: unknown device 'h900'" in capsys.readouterr().err


def test_profile_missing_a_field_exits_2_naming_file_and_field(tmp_path, capsys):
    data = yaml.safe_load((DEVICES_DIR / "b200.yaml").read_text())
    del data["network"]["latency_us"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["project", SMALL, "--device", str(bad), "--out", str(tmp_path)]) == 2
    assert f"{bad}: network.latency_us: missing" in capsys.readouterr().err


def test_profile_with_a_non_positive_rate_exits_2(tmp_path, capsys):
    data = yaml.safe_load((DEVICES_DIR / "b200.yaml").read_text())
    data["peak_tflops"]["bf16"] = 0
    bad = tmp_path / "zero.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["project", SMALL, "--device", str(bad), "--out", str(tmp_path)]) == 2
    assert f"{bad}: peak_tflops.bf16: must be a number > 0" in capsys.readouterr().err


def test_a_layout_that_does_not_fit_is_not_projected(tmp_path, capsys):
    # The 47B layout needs ~217 GB per rank by the plan; an H100 has 80.
    assert (
        main(["project", "scenarios/olmo-core3/moe-128e-47b.yaml", "--device", "h100-sxm", "--out", str(tmp_path)]) == 2
    )
    err = capsys.readouterr().err
    assert "does not fit h100-sxm" in err and "memory_gb = 80" in err
    # In GiB, as moe-bench plan gives the same rank's memory: 80 GB is 74.5 GiB.
    assert re.search(r"needs [\d.]+ GiB by the plan, the device holds 74\.5 GiB", err), err
    assert " GB " not in err.split("memory_gb = 80")[1]
    assert not list(tmp_path.glob("*.json"))


def test_projection_documents_under_results_leave_the_result_loaders_alone(tmp_path):
    """``moe-bench project``'s default folder is results/projections: the report and the gate read
    the results folder around it without a warning."""
    from result_docs import make_doc

    from bench.results import load_nonempty, write_result

    write_result(make_doc("smoke-e8"), tmp_path / "results" / "0.1.0" / "1xnvidia-h200")
    projections = tmp_path / "results" / "projections"
    projections.mkdir()
    (projections / "moe-128e-47b.b300.json").write_text('{"scenario": "moe-128e-47b", "step_s": 1.0}\n')
    warned: list = []
    loaded = load_nonempty(tmp_path / "results", on_bad_file=warned.append)
    assert [d.name for d in loaded.docs] == ["smoke-e8"] and warned == [] and loaded.skipped == []


def test_cluster_device_fills_the_cluster_and_refuses_a_contradiction():
    scenario = load_scenario("scenarios/olmo-core3/moe-128e-47b.yaml")
    assert scenario.cluster.gpu_memory_gib == pytest.approx(288e9 / 2**30)
    assert scenario.cluster.inter_node_gbps == 100
    spec = dict(scenario.spec)
    spec["cluster"] = {"gpus": 8, "device": "b300", "gpu_memory_gib": 288}
    with pytest.raises(ScenarioError, match=re.escape("cluster.gpu_memory_gib: 288 contradicts device b300")):
        scenario_from_dict(spec)
    spec["cluster"] = {"gpus": 8, "device": "b900"}
    with pytest.raises(ScenarioError, match=re.escape("cluster.device: --device: unknown device 'b900'")):
        scenario_from_dict(spec)
    spec["cluster"] = {"gpus": 8}
    with pytest.raises(ScenarioError, match="cluster"):
        scenario_from_dict(spec)


def test_a_layout_the_trace_cannot_build_exits_2_naming_the_field(tmp_path, capsys):
    assert (
        main(["project", "scenarios/olmo-core3/moe-1.2t-512gpu-fsdp.yaml", "--device", "b300", "--out", str(tmp_path)])
        == 2
    )
    assert "parallel.pp: an FSDP layout traces without pipeline stages, got pp 8" in capsys.readouterr().err


def test_the_summary_names_the_step_parts_only():
    """The step line lists the nonzero parts that add up to the step, in the document's order, and
    leaves out what is reported beside the sum (hidden and total times)."""
    from bench.run.project import summary

    doc = {
        "scenario": "s",
        "world_size": 8,
        "device": "h100-sxm",
        "step_s": 0.5,
        "tokens_per_s_per_gpu": 12_815.4,
        "tflops_per_gpu": 400.2,
        "mfu": 0.4046,
        "memory": {"memory_need_bytes": 40 * 2**30, "device_memory_bytes": 80 * 2**30},
        "stages": [{"pipeline_rank": 0, "trace_shared_with": None}],
        "breakdown_s": {
            "compute": 0.3,
            "expert_comm": 0.1,
            "expert_comm_hidden": 0.05,
            "expert_comm_total": 0.15,
            "bubble": 0.0,
            "fsdp_gather_exposed": 0.06,
            "grad_sync_total": 0.2,
            "skew": 0.04,
        },
    }
    assert summary(doc) == (
        "s on 8 x h100-sxm: step 0.500 s, 12,815 tokens/s/GPU, 400 TFLOP/s/GPU, MFU 40.5%; "
        "memory 40.0 GiB of 80.0 GiB\n"
        "  step: compute 300.0 ms, expert_comm 100.0 ms, fsdp_gather_exposed 60.0 ms, skew 40.0 ms"
    )
