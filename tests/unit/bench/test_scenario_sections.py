"""The typed run, cluster and proxy sections (``bench.scenario_sections``): they name the schema's fields,
every schema default reaches them, and the schema still refuses a field they do not know."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from bench.scenario import SCENARIO_SCHEMA_PATH, ScenarioError, scenario_from_dict
from bench.scenario_sections import ClusterConfig, CpuScale, ProxyConfig, RunConfig

SCHEMA = json.loads(SCENARIO_SCHEMA_PATH.read_text())["properties"]
SECTIONS = {
    "run": (RunConfig, SCHEMA["run"]),
    "cluster": (ClusterConfig, SCHEMA["cluster"]),
    "proxy": (ProxyConfig, SCHEMA["proxy"]),
    "proxy.cpu_scale": (CpuScale, SCHEMA["proxy"]["properties"]["cpu_scale"]),
}
# The least a proxy scenario gives: no run or proxy section, a cluster of its required fields alone.
MINIMAL_PROXY = {
    "schema_version": 1,
    "mode": "proxy",
    "model": {
        "vocab_size": 128,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "seq_len": 16,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    },
    "cluster": {"gpus": 1, "gpu_memory_gib": 80, "peak_tflops": 989},
}


def _section(scenario, path: str):
    typed = scenario
    for part in path.split("."):
        typed = getattr(typed, part)
    return typed


@pytest.mark.parametrize("path", sorted(SECTIONS))
def test_each_section_names_the_schemas_fields(path):
    cls, schema = SECTIONS[path]
    assert {f.name for f in dataclasses.fields(cls)} == set(schema["properties"])


@pytest.mark.parametrize("path", sorted(SECTIONS))
def test_every_schema_default_lands_in_the_dataclass(path):
    cls, schema = SECTIONS[path]
    typed = _section(scenario_from_dict(copy.deepcopy(MINIMAL_PROXY)), path)
    assert isinstance(typed, cls)
    defaults = {name: field["default"] for name, field in schema["properties"].items() if "default" in field}
    assert defaults, f"{path} has no defaults in the schema"
    assert {name: getattr(typed, name) for name in defaults} == defaults


def test_the_steps_size_defaults_to_four_sequences():
    # The schema gives run.tokens_per_step no default: the loader fills it from the model.
    assert "default" not in SCHEMA["run"]["properties"]["tokens_per_step"]
    assert scenario_from_dict(copy.deepcopy(MINIMAL_PROXY)).run.tokens_per_step == 4 * 16


def test_a_files_values_land_in_the_sections_and_they_are_frozen():
    spec = copy.deepcopy(MINIMAL_PROXY)
    spec["run"] = {"steps": 3, "timeout_s": 30, "compile": True}
    spec["cluster"]["name"] = "one-gpu"
    spec["proxy"] = {"threads": 2, "cpu_scale": {"seq_len": 8, "precision": "fp32"}}
    scenario = scenario_from_dict(spec)
    assert (scenario.run.steps, scenario.run.timeout_s, scenario.run.compile) == (3, 30, True)
    assert scenario.cluster.name == "one-gpu" and scenario.cluster.device is None
    assert scenario.proxy.threads == 2 and scenario.proxy.cpu_scale == CpuScale(seq_len=8, precision="fp32")
    # The raw spec stays as the result documents write it.
    assert scenario.spec["run"]["steps"] == 3 and "device" not in scenario.spec["cluster"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        scenario.run.steps = 4


def test_a_device_profile_fills_the_cluster():
    spec = copy.deepcopy(MINIMAL_PROXY)
    spec["cluster"] = {"gpus": 1, "device": "h100-sxm"}
    cluster = scenario_from_dict(spec).cluster
    assert cluster.device == "h100-sxm" and cluster.gpu_memory_gib > 0 and cluster.peak_tflops > 0
    assert cluster.to_dict() == {k: v for k, v in dataclasses.asdict(cluster).items() if k != "name"}


def test_sections_a_scenario_does_not_have_are_none():
    spec = copy.deepcopy(MINIMAL_PROXY)
    spec["mode"] = "execute"
    del spec["cluster"]
    scenario = scenario_from_dict(spec)
    assert scenario.cluster is None and scenario.proxy is None


@pytest.mark.parametrize(
    "section, patch, field_path",
    [
        ("run", {"step": 3}, "run"),
        ("proxy", {"rank": 0, "replica": 1}, "proxy"),
        ("cluster", {"gpus": 1, "gpu_memory_gib": 80, "peak_tflops": 989, "gpu": "h100"}, "cluster"),
        ("proxy", {"cpu_scale": {"layers": 1}}, "proxy.cpu_scale"),
        ("cluster", {"gpu_memory_gib": 80, "peak_tflops": 989}, "cluster"),  # gpus missing
    ],
)
def test_an_unknown_or_missing_field_is_refused_by_the_schema(section, patch, field_path):
    spec = copy.deepcopy(MINIMAL_PROXY)
    spec[section] = patch
    with pytest.raises(ScenarioError) as caught:
        scenario_from_dict(spec)
    assert caught.value.field_path == field_path
