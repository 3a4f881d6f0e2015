"""``moe-bench plan`` plans every scenario file, whatever its mode: the whole layout at the scenario's own sizes.

The figures checked by hand are written as literal arithmetic on purpose (see test_plan.py).
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import yaml

from bench.cli import main
from bench.predict.plan import plan_scenario
from bench.results import REPO_ROOT, load_results
from bench.scenario import SCENARIOS_DIR, load_scenario, scenario_from_dict

ALL_SCENARIOS = sorted(p for p in SCENARIOS_DIR.rglob("*.yaml") if p.name != "suites.yaml")

PLAN_METRICS = {
    "total_params",
    "active_params",
    "flops_per_token",
    "recompute_flops_per_token",
    "hardware_flops_per_token",
    "memory_params_bytes",
    "memory_grads_bytes",
    "checkpoint_bytes_per_rank",
    "checkpoint_bytes_total",
    "memory_optimizer_bytes",
    "memory_activations_bytes",
    "memory_comm_buffers_bytes",
    "memory_total_bytes",
    "memory_backward_workspace_bytes",
    "memory_optimizer_step_bytes",
    "comm_all_to_all_bytes",
    "comm_grad_reduce_bytes",
    "comm_pipeline_bytes",
    "comm_total_bytes",
}
PLAN_DETAILS = {
    "layout",
    "recompute",
    "per_rank",
    "most_loaded",
    "stages",
    "assumptions",
    "fits",
    "memory_total_gib",
    "cluster",
}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Every shipped scenario through ``moe-bench plan``: (exit code, stdout, documents by name)."""
    out = tmp_path_factory.mktemp("plans")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["plan", *map(str, ALL_SCENARIOS), "--out", str(out)])
    docs = {d.name: d for d in load_results(out)} if out.exists() else {}
    return code, stdout.getvalue(), docs


def test_plan_takes_every_shipped_scenario(planned):
    code, stdout, docs = planned
    assert code == 0, stdout
    assert len(docs) == len(ALL_SCENARIOS)
    for path in ALL_SCENARIOS:
        scenario = load_scenario(path)
        # A plan scenario's plan keeps its name; the plan of another mode's scenario is a result of its own.
        name = scenario.name if scenario.mode == "plan" else f"{scenario.name}.plan"
        doc = docs[name].data
        assert doc["mode"] == "plan" and doc["status"] == "ok" and doc["device"] == "none", name
        assert doc["scenario"]["spec"] == scenario.spec, "the scenario as written, not a rewritten one"
        assert doc["details"]["scenario_mode"] == scenario.mode
        assert set(doc["details"]) >= PLAN_DETAILS, name
        assert doc["details"]["engine_runs_layout"]["ok"] or scenario.mode == "plan", name
        metrics = set(doc["metrics"])
        if scenario.cluster:
            assert metrics == PLAN_METRICS | {"memory_fraction_of_gpu"}, name
            assert isinstance(doc["details"]["fits"], bool)
        else:
            # No GPU to compare with: the per-rank memory without a fraction, and the line says so.
            assert metrics == PLAN_METRICS and doc["details"]["fits"] is None, name
            line = next(x for x in stdout.splitlines() if x.startswith(f"{name} "))
            assert "no cluster section: not compared with a GPU's memory" in line
        assert f"{name} " in stdout


def test_plan_of_an_execute_scenario_by_hand(planned):
    """scenarios/gpu/e8-top4-random-bf16.yaml: one rank holds the whole model (dp = ep = pp = 1)."""
    _, _, docs = planned
    doc = docs["e8-top4-random-bf16.plan"].data
    # V 50304, D 2048, L 4, 16 heads of 128 (q 2048), 4 kv heads (kv 512), E 8 experts of F 1024.
    attention = 2 * 2048 * 2048 + 2 * 2048 * 512  # q, o + k, v = 10485760 per block
    norms = 2 * 2048  # two RMSNorms per block
    router = 8 * 2048  # fp32
    experts = 4 * 8 * 3 * 2048 * 1024  # 4 blocks x 8 experts x (gate, up, down)
    dense_lowp = 2 * 50304 * 2048 + 2048 + 4 * (attention + norms)  # embedding, LM head, final norm, blocks
    per_rank = doc["details"]["per_rank"]
    assert per_rank["dense_params"] == dense_lowp + 4 * router
    assert per_rank["local_expert_params"] == experts
    m = {k: v["median"] for k, v in doc["metrics"].items()}
    assert m["total_params"] == dense_lowp + 4 * router + experts
    # bf16: 2 bytes per parameter, 4 per gradient (fp32 buffers, grad_dtype's default), 12 of optimizer
    # state; the router 4 / 4 / 8.
    assert m["memory_params_bytes"] == 2 * (dense_lowp + experts) + 4 * 4 * router
    assert m["memory_grads_bytes"] == 4 * (dense_lowp + experts) + 4 * 4 * router
    assert m["memory_optimizer_bytes"] == 12 * (dense_lowp + experts) + 8 * 4 * router
    # One H200 (the scenario's cluster section): the fraction of its 139 GiB.
    assert m["memory_fraction_of_gpu"] == pytest.approx(m["memory_total_bytes"] / (139 * 2**30))
    # 65536 tokens per step, dp 1, two microbatches (the scenario sets them): 8 sequences each.
    assert doc["details"]["layout"]["tokens_per_microbatch_per_rank"] == 32768
    assert doc["details"]["layout"]["microbatches"] == 2


def test_plan_of_a_proxy_scenario_by_hand(planned):
    """moe-128e-47b-proxy at the scenario's own sizes (not the proxy's CPU scale-down: 14 blocks, not 1)."""
    _, _, docs = planned
    doc = docs["moe-128e-47b-proxy.plan"].data
    # V 100278, D 4096, L 14, 32 heads = 32 kv heads (q = kv = 4096), qk_norm; E 128 of F 2048 over ep 8.
    attention = 4 * 4096 * 4096
    norms = 2 * 4096 + 4096 + 4096  # two block norms, q_norm and k_norm over the full projections
    router = 128 * 4096
    local_experts = 14 * (128 // 8) * 3 * 4096 * 2048  # 16 local experts per block
    dense_lowp = 2 * 100278 * 4096 + 4096 + 14 * (attention + norms)
    per_rank = doc["details"]["per_rank"]
    assert doc["details"]["layout"]["layers_per_rank"] == 14
    assert per_rank["dense_params"] == dense_lowp + 14 * router
    assert per_rank["local_expert_params"] == local_experts
    m = {k: v["median"] for k, v in doc["metrics"].items()}
    assert m["memory_params_bytes"] == 2 * (dense_lowp + local_experts) + 4 * 14 * router
    # ZeRO-1: the dense optimizer state over dp 8; experts over edp = dp / ep = 1.
    dense_optimizer = (12 * dense_lowp + 8 * 14 * router) / 8
    assert per_rank["memory_bytes"]["optimizer_dense"] == pytest.approx(dense_optimizer, abs=1)
    assert per_rank["memory_bytes"]["optimizer_experts"] == 12 * local_experts
    # 4194304 tokens over dp 8 and 32 microbatches: 16384 tokens (4 sequences) per microbatch and rank.
    assert doc["details"]["layout"]["tokens_per_microbatch_per_rank"] == 16384
    assert m["memory_fraction_of_gpu"] == pytest.approx(m["memory_total_bytes"] / 288e9)
    # ... the same plan as the layout it replays.
    base = docs["moe-128e-47b-zero1"].data
    assert doc["metrics"] == base["metrics"]


def test_an_execute_scenario_with_a_cluster_is_compared_with_its_gpus():
    spec = yaml.safe_load((REPO_ROOT / "scenarios/gpu/e8-top4-random-bf16.yaml").read_text())
    spec["cluster"] = {"gpus": 1, "gpu_memory_gib": 141, "peak_tflops": 989}
    metrics, details = plan_scenario(scenario_from_dict(copy.deepcopy(spec), file="e8.yaml"))
    total = metrics["memory_total_bytes"]["median"]
    assert metrics["memory_fraction_of_gpu"]["median"] == pytest.approx(total / (141 * 2**30))
    assert details["fits"] is (total <= 141 * 2**30)
    spec["cluster"]["gpu_memory_gib"] = 1
    _, details = plan_scenario(scenario_from_dict(spec, file="e8.yaml"))
    assert details["fits"] is False


def test_a_plan_says_when_the_engine_would_not_execute_the_layout():
    # 1F1B with fewer microbatches than stages: priced by the plan, refused by torch's Schedule1F1B.
    spec = yaml.safe_load((REPO_ROOT / "scenarios/olmo-core3/moe-1.2t-512gpu.yaml").read_text())
    spec["parallel"] |= {"schedule": "1f1b", "virtual_stages": 1, "microbatches": 4}
    _, details = plan_scenario(scenario_from_dict(spec, file="x.yaml"))
    runs = details["engine_runs_layout"]
    assert runs["ok"] is False and runs["reason"].startswith("parallel.microbatches: schedule 1f1b needs")
