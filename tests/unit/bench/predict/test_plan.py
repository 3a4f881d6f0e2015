"""``bench.predict.plan``: the olmo-core3 reference scenarios and the plan arithmetic against hand-computed numbers.

Expected values are written as literal arithmetic on purpose: reusing the module's helpers here would
only check that the module agrees with itself.
"""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from bench.predict.plan import in_flight_microbatches, plan_scenario, stage_layers, summary_line
from bench.predict.plan.rank import experts_wgrad_in_gemm
from bench.results import REPO_ROOT
from bench.scenario import load_scenario, scenario_from_dict
from moe_engine.config import ParallelConfig
from moe_engine.flops import parameter_counts

OLMO_DIR = REPO_ROOT / "scenarios" / "olmo-core3"

# Published OLMo-core 3 MoE figures: (total, active) parameters; None where no active figure is given.
PUBLISHED = {
    "moe-8e-4.6b": (4.6e9, 3.2e9),
    "moe-128e-47b": (47e9, 3.2e9),
    "moe-1.2t-512gpu": (1.2e12, 58.36e9),
    "moe-2.38t": (2.38e12, None),
    "moe-bf16-4gpu": (4.6e9, 3.2e9),
    "moe-mxfp8-4gpu": (4.6e9, 3.2e9),
}

METRICS = {
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
    "memory_fraction_of_gpu",
}


def olmo(name: str):
    return load_scenario(OLMO_DIR / f"{name}.yaml")


def olmo_dict(name: str) -> dict:
    return yaml.safe_load((OLMO_DIR / f"{name}.yaml").read_text())


def median(metrics, name):
    return metrics[name]["median"]


# ---- the reference scenarios ------------------------------------------------------------------


# Layout variants of a published configuration: same model and cluster, another parallel design.
VARIANTS = {
    "moe-128e-47b-zero1": "moe-128e-47b",
    "moe-128e-47b-fsdp": "moe-128e-47b",
    "moe-1.2t-512gpu-fsdp": "moe-1.2t-512gpu",
}


# Recompute variants of a layout: same model, cluster, layout and batch; activation recompute on.
RECOMPUTE_VARIANTS = {
    "moe-1.2t-512gpu-recompute-full": "moe-1.2t-512gpu",
    "moe-1.2t-512gpu-recompute-selective": "moe-1.2t-512gpu",
    "moe-128e-47b-zero1-recompute-full": "moe-128e-47b-zero1",
    "moe-128e-47b-zero1-recompute-selective": "moe-128e-47b-zero1",
}


# Proxy variants: one rank of the layout run for real (``bench.run.proxy.run``), same model and cluster.
PROXIES = {
    "moe-128e-47b-proxy": "moe-128e-47b-zero1",
    "moe-1.2t-512gpu-proxy": "moe-1.2t-512gpu",
    "moe-2.38t-proxy": "moe-2.38t",
    "moe-128e-47b-recompute-full-proxy": "moe-128e-47b-zero1-recompute-full",
    "moe-1.2t-512gpu-recompute-full-proxy": "moe-1.2t-512gpu-recompute-full",
    "moe-128e-47b-recompute-selective-proxy": "moe-128e-47b-zero1-recompute-selective",
    "moe-1.2t-512gpu-recompute-selective-proxy": "moe-1.2t-512gpu-recompute-selective",
}


def test_every_published_configuration_has_a_scenario():
    assert {p.stem for p in OLMO_DIR.glob("*.yaml")} == (
        set(PUBLISHED) | set(VARIANTS) | set(RECOMPUTE_VARIANTS) | set(PROXIES)
    )


@pytest.mark.parametrize("proxy,base", sorted(PROXIES.items()))
def test_proxy_variants_replay_their_plan_scenario(proxy, base):
    a, b = olmo_dict(proxy), olmo_dict(base)
    assert a["mode"] == "proxy" and b["mode"] == "plan"
    assert a["model"] == b["model"] and a["cluster"] == b["cluster"]
    # A proxy runs gpipe or 1f1b: a base of a multi-stage schedule is replayed as its one-stage 1F1B twin
    # (the same blocks per rank), as the projection traces it.
    twin = dict(b["parallel"])
    if twin.get("schedule") not in (None, "gpipe", "1f1b"):
        twin |= {"schedule": "1f1b"}
        twin.pop("virtual_stages", None)
    assert a["parallel"] == twin
    assert a.get("recompute") == b.get("recompute")
    assert a["run"]["tokens_per_step"] == b["run"]["tokens_per_step"]
    assert olmo(proxy).proxy.rank == 0


@pytest.mark.parametrize("variant,base", sorted(RECOMPUTE_VARIANTS.items()))
def test_recompute_variants_trade_flops_for_activations(variant, base):
    a, b = olmo_dict(variant), olmo_dict(base)
    assert a["mode"] == b["mode"] == "plan" and "recompute" not in b
    for section in ("model", "cluster", "parallel", "run", "precision", "routing"):
        assert a[section] == b[section], section
    recomputed, details = plan_scenario(olmo(variant))
    plain, _ = plan_scenario(olmo(base))
    assert details["recompute"]["blocks"] == olmo(variant).model.n_layers  # every block
    assert median(recomputed, "memory_activations_bytes") < median(plain, "memory_activations_bytes")
    assert median(recomputed, "memory_total_bytes") < median(plain, "memory_total_bytes")
    assert median(recomputed, "flops_per_token") == median(plain, "flops_per_token")
    assert median(recomputed, "hardware_flops_per_token") > median(plain, "hardware_flops_per_token")
    for key in ("params", "grads", "optimizer"):
        assert median(recomputed, f"memory_{key}_bytes") == median(plain, f"memory_{key}_bytes")
    # Only full recompute runs the dispatch's all-to-alls again: half as many bytes again.
    more = median(recomputed, "comm_all_to_all_bytes") / median(plain, "comm_all_to_all_bytes")
    assert more == pytest.approx(1.5 if a["recompute"]["mode"] == "full" else 1.0)


@pytest.mark.parametrize("variant,base", sorted(VARIANTS.items()))
def test_layout_variants_change_only_the_layout(variant, base):
    a, b = olmo_dict(variant), olmo_dict(base)
    assert a["model"] == b["model"] and a["cluster"] == b["cluster"] and a["run"] == b["run"]
    assert a["parallel"] != b["parallel"]


def test_zero1_and_fsdp_plans_of_the_47b_model():
    ddp, _ = plan_scenario(olmo("moe-128e-47b"))
    zero1, _ = plan_scenario(olmo("moe-128e-47b-zero1"))
    fsdp, _ = plan_scenario(olmo("moe-128e-47b-fsdp"))
    # ZeRO-1 shards the optimizer over dp = 8 (the experts over edp = 1: they are already sharded by ep).
    assert median(zero1, "memory_params_bytes") == median(ddp, "memory_params_bytes")
    assert median(zero1, "memory_optimizer_bytes") < median(ddp, "memory_optimizer_bytes")
    # FSDP holds 1/8 of every parameter plus one gathered block, and gathers parameters every microbatch.
    assert median(fsdp, "comm_grad_reduce_bytes") > median(ddp, "comm_grad_reduce_bytes")
    assert median(fsdp, "comm_all_to_all_bytes") == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_olmo_scenario_loads_and_matches_published_counts(name):
    scenario = olmo(name)
    assert scenario.mode == "plan"
    assert scenario.cluster is not None and scenario.cluster.gpus == scenario.world_size
    assert scenario.spec["routing"] == {"mode": "random", "seed": 0, "zipf_exponent": 1.0}
    assert "tokens_per_step" in olmo_dict(name)["run"]
    counts = parameter_counts(scenario.model)
    total, active = PUBLISHED[name]
    assert abs(counts.total / total - 1) < 0.03, counts.total
    if active is not None:
        assert abs(counts.active / active - 1) < 0.03, counts.active


def test_expert_pool_pair_shares_everything_but_the_pool():
    small, large = olmo("moe-8e-4.6b").model, olmo("moe-128e-47b").model
    assert (small.moe.num_experts, large.moe.num_experts) == (8, 128)
    assert small.moe.top_k == large.moe.top_k == 4
    assert small.to_dict() | {"moe": None} == large.to_dict() | {"moe": None}


def test_4gpu_pair_differs_only_in_precision():
    bf16, mxfp8 = olmo_dict("moe-bf16-4gpu"), olmo_dict("moe-mxfp8-4gpu")
    assert (bf16.pop("precision"), mxfp8.pop("precision")) == ("bf16", "mxfp8")
    bf16.pop("description"), mxfp8.pop("description")
    assert bf16 == mxfp8
    assert olmo("moe-bf16-4gpu").world_size == 4


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_plan_metrics_are_well_formed(name):
    metrics, details = plan_scenario(olmo(name))
    assert set(metrics) == METRICS
    for key, entry in metrics.items():
        assert set(entry) >= {"unit", "better", "samples", "median", "spread"}, key
        assert len(entry["samples"]) == 1 and math.isfinite(entry["median"]), key
        # One sample: no spread (bench.results.metric), or a finite one.
        assert entry["spread"] is None or all(math.isfinite(v) for v in entry["spread"].values()), key
    assert metrics["total_params"]["better"] is None and metrics["memory_total_bytes"]["better"] == "lower"
    assert metrics["memory_fraction_of_gpu"]["unit"] == "ratio"
    assert set(details) >= {"layout", "per_rank", "assumptions", "fits", "cluster"}
    assert details["assumptions"] and all(isinstance(a, str) for a in details["assumptions"])
    state = sum(median(metrics, f"memory_{p}_bytes") for p in ("params", "grads", "optimizer"))
    backward = sum(median(metrics, f"memory_{p}_bytes") for p in ("activations", "comm_buffers", "backward_workspace"))
    assert median(metrics, "memory_total_bytes") == pytest.approx(
        state + max(backward, median(metrics, "memory_optimizer_step_bytes"))
    )
    assert median(metrics, "memory_fraction_of_gpu") == pytest.approx(
        median(metrics, "memory_total_bytes") / 288e9  # a B300: 288 GB (devices/b300.yaml)
    )
    assert details["fits"] is True


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_stages_partition_the_model(name):
    scenario = olmo(name)
    _, details = plan_scenario(scenario)
    ep = scenario.parallel["ep"]
    held = sum(s["dense_params"] + ep * s["local_expert_params"] for s in details["stages"])
    assert held == parameter_counts(scenario.model).total
    assert sum(s["layers"] for s in details["stages"]) == scenario.model.n_layers


# ---- hand-computed small scenario ---------------------------------------------------------------
#
# vocab 1000, D 64, 2 MoE layers, 4 heads = 4 kv heads (q = kv = 64), no qk-norm, E 8, k 2, F 32.
#   embedding 1000*64 = 64000; head = lm_head 64000 + final norm 64 = 64064
#   block: attention 4*64*64 = 16384 + norms 2*64 = 128 -> 16512; router 8*64 = 512 (fp32)
#   one expert 3*64*32 = 6144
# dp 4, ep 2 (edp 2, 4 local experts), pp 1; 8 sequences of 16 tokens, 2 microbatches -> T = 16.
#   dense bf16 params = 64000 + 64064 + 2*16512 = 161088, router 2*512 = 1024
#   local experts = 2 layers * 4 * 6144 = 49152
# Gradient buffers are fp32 by default (grad_dtype fp32): 4 bytes per gradient element.


def small_spec(**parallel) -> dict:
    return {
        "schema_version": 1,
        "name": "small",
        "mode": "plan",
        "model": {
            "vocab_size": 1000,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 4,
            "seq_len": 16,
            "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32},
            # The hand-worked activation bytes below are the reference (unfused) step's.
            "fused_kernels": False,
        },
        "routing": {"mode": "random", "seed": 0},
        "precision": "bf16",
        "parallel": {"dp": 4, "ep": 2, "pp": 1, "microbatches": 2, **parallel},
        "run": {"tokens_per_step": 128},
        "cluster": {"gpus": parallel.get("dp", 4) * parallel.get("pp", 1), "gpu_memory_gib": 1, "peak_tflops": 1},
    }


def small_plan(precision: str = "bf16", **parallel):
    spec = small_spec(**parallel)
    spec["precision"] = precision
    return plan_scenario(scenario_from_dict(spec))


def test_small_counts():
    metrics, details = small_plan()
    assert median(metrics, "total_params") == 64000 + 64064 + 2 * 16512 + 2 * 512 + 2 * 8 * 6144
    assert median(metrics, "active_params") == 64000 + 64064 + 2 * 16512 + 2 * 512 + 2 * 2 * 6144
    layout = details["layout"]
    assert (layout["dp"], layout["ep"], layout["pp"], layout["edp"]) == (4, 2, 1, 2)
    assert (layout["layers_per_rank"], layout["local_experts"], layout["tokens_per_microbatch_per_rank"]) == (2, 4, 16)
    assert details["per_rank"]["dense_params"] == 161088 + 1024
    assert details["per_rank"]["local_expert_params"] == 49152


def test_summary_line_counts_in_t_b_m():
    # 64000 + 64064 + 2 * 16512 + 2 * 512 = 162112 dense; + 2 * 8 * 6144 experts = 260416, 2 * 2 * 6144 active.
    metrics, details = small_plan()
    assert summary_line("small", metrics, details).startswith("small: 260K parameters (187K active), ")
    # The 1.2T layout: 1,193,900,875,776 parameters, 58,016,243,712 active -> 1.19T and 58B, never "1193.90B".
    metrics, details = plan_scenario(load_scenario(OLMO_DIR / "moe-1.2t-512gpu.yaml"))
    assert median(metrics, "total_params") == 1193900875776
    assert summary_line("big", metrics, details).startswith("big: 1.19T parameters (58B active), ")


def test_small_ddp_state_bytes():
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="none")
    assert median(metrics, "memory_params_bytes") == 2 * 161088 + 4 * 1024 + 2 * 49152  # 424576
    # fp32 gradient buffers for the bf16 parameters too: 2 / 4 / 12
    assert median(metrics, "memory_grads_bytes") == 4 * 161088 + 4 * 1024 + 4 * 49152  # 845056
    assert median(metrics, "memory_optimizer_bytes") == 12 * 161088 + 8 * 1024 + 12 * 49152  # 2531072
    # grad_dtype param: bf16 buffers, 2 / 2 / 12 (the router stays 4 / 4 / 8)
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="none", grad_dtype="param")
    assert median(metrics, "memory_grads_bytes") == 2 * 161088 + 4 * 1024 + 2 * 49152  # 424576
    assert median(metrics, "memory_params_bytes") == 424576
    assert median(metrics, "memory_optimizer_bytes") == 2531072


def test_small_zero1_state_bytes():
    metrics, details = small_plan(dp_mode="ddp", optimizer_sharding="zero1")
    assert median(metrics, "memory_params_bytes") == 424576
    memory = details["per_rank"]["memory_bytes"]
    assert memory["optimizer_dense"] == (12 * 161088 + 8 * 1024) / 4  # 485312
    assert memory["optimizer_experts"] == 12 * 49152 / 2  # 294912
    assert median(metrics, "memory_optimizer_bytes") == 485312 + 294912


def test_small_fsdp_state_bytes():
    # FSDP keeps its own fp32 gradient shards whatever grad_dtype: the same 16 bytes per parameter,
    # priced at 2 / 2 / 12.
    metrics, details = small_plan(dp_mode="fsdp")
    # Largest unit: the head 64064 * 2 = 128128 bytes (embedding 128000; a block with its 4 local experts
    # 16512*2 + 512*4 + 4*6144*2 = 84224).
    sharded = (2 * 161088 + 4 * 1024) / 4 + 2 * 49152 / 2  # 81568 + 49152
    assert details["per_rank"]["memory_bytes"]["gathered_unit_params"] == 128128
    assert median(metrics, "memory_params_bytes") == sharded + 128128  # 258848
    assert median(metrics, "memory_grads_bytes") == sharded + 128128
    assert median(metrics, "memory_optimizer_bytes") == 485312 + 294912


def test_small_activation_bytes():
    # No-sync dispatch at cf 1.25 (the defaults): R = 1.25 * T 16 * k 2 = 40 expert rows; a = 2.
    # RMSNorm over D: T * D * (4 + a) = 16*64*6 = 6144 (fp32 input copy, normalised values)
    # attention per block: 6144 + the norm's output 2*16*64 = 2048 + q, k, v, o 2*16*(2*64 + 2*64) = 8192
    #                      + fp32 log-sum-exp 4*16*4 = 256  -> 16640
    # MoE per block: 6144 + router (fp32 input 4*16*64 + logits, scores 8*16*8 = 5120)
    #                + experts 40*2*(64 + 2*32) = 10240 + combine 2*16*2*64 = 4096  -> 25600
    #                (no shared expert: the norm's bf16 output is saved by nothing)
    # head: 6144 + its input 2048 + 4*16*1000 = 72192; pp 1 -> one microbatch in flight
    metrics, details = small_plan("bf16")
    assert median(metrics, "memory_activations_bytes") == 2 * (16640 + 25600) + 72192  # 156672
    assert details["per_rank"]["memory_bytes"]["recompute_peak"] == 0
    # mxfp8: the expert-GEMM inputs at 1 + 1/32 bytes: 40 * 33/32 * 128 = 5280
    metrics, _ = small_plan("mxfp8")
    assert median(metrics, "memory_activations_bytes") == 2 * (16640 + 6144 + 5120 + 5280 + 4096) + 72192  # 146752
    # sync dispatch sends exact counts: R = 32 rows, experts 32*2*128 = 8192
    metrics, _ = small_plan("bf16", dispatch="sync")
    assert median(metrics, "memory_activations_bytes") == 2 * (16640 + 25600 - 10240 + 8192) + 72192
    # A shared expert of hidden 16 saves the MoE norm's output (2048) and its SwiGLU 4*2*16*16 = 2048.
    spec = small_spec()
    spec["model"]["moe"]["shared_expert_hidden"] = 16
    metrics, _ = plan_scenario(scenario_from_dict(spec))
    assert median(metrics, "memory_activations_bytes") == 2 * (16640 + 25600 + 2048 + 2048) + 72192


def test_small_backward_workspace_and_optimizer_step():
    # workspace: the largest of one MoE block's expert backward, R 40 * 2 * 4F (128) + 2 * 4 local experts
    # * 3 * 64 * 32 = 10240 + 49152 = 59392, less the LM head's activations 72192 its backward freed
    # first; the cross-entropy's backward 8 * 16 * 1000 = 128000; the LM head's, its logits' gradient
    # 2 * 16 * 1000 and its weight gradient 2 * 1000 * 64 = 160000; the embedding's gradient 128000
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="none")
    assert median(metrics, "memory_backward_workspace_bytes") == 160000
    # With F = 512 and the weight gradients made whole, the experts' workspace is the larger:
    # R 40 * 2 * 2048 + 2 * 4 * 3 * 64 * 512 - 72192
    spec = small_spec(accumulate_in_gemm=False)
    spec["model"]["moe"]["expert_hidden"] = 512
    _, details = plan_scenario(scenario_from_dict(spec))
    assert details["per_rank"]["memory_bytes"]["backward_workspace"] == 40 * 2 * 2048 + 2 * 4 * 3 * 64 * 512 - 72192
    # Added inside their GEMM (the default under ddp, pp 1), they never exist: R 40 * 2 * 2048 - 72192
    # = 91648 is below the LM head's 160000
    spec["parallel"]["accumulate_in_gemm"] = True
    _, details = plan_scenario(scenario_from_dict(spec))
    assert details["per_rank"]["memory_bytes"]["backward_workspace"] == 160000
    # ... also under a pipeline schedule that does not split the backward, but not under one that does
    # (torch's weight phase takes the gradients through autograd.grad) nor under fsdp (no such buffer)
    for parallel, whole in (
        ({"pp": 2, "schedule": "1f1b", "microbatches": 4}, False),
        ({"pp": 2, "schedule": "zbv", "virtual_stages": 2, "microbatches": 4}, True),
        ({"pp": 2, "schedule": "dualpipev", "virtual_stages": 2, "microbatches": 4}, True),
        # interleaved 1F1B's paired plan (expert parallelism: microbatches overlap) splits its cool-down
        ({"pp": 2, "ep": 2, "dp": 2, "schedule": "interleaved1f1b", "virtual_stages": 2, "microbatches": 4}, True),
        (
            {
                "pp": 2,
                "ep": 2,
                "dp": 2,
                "schedule": "interleaved1f1b",
                "virtual_stages": 2,
                "microbatches": 4,
                "overlap": "none",
            },
            False,
        ),
        ({"dp_mode": "fsdp"}, True),
        ({"accumulate_in_gemm": False}, True),
        ({"grad_dtype": "param"}, True),
    ):
        assert experts_wgrad_in_gemm(ParallelConfig(**parallel)) is not whole, parallel
    # optimizer step: every family fits in one bucket (2^22 elements): dense 161088 + 1024 router elements,
    # experts 49152; 8 bytes of AdamW temporaries per element of the larger, and no fp32 gradient copy:
    # the buffers are fp32 already
    assert median(metrics, "memory_optimizer_step_bytes") == 8 * 162112  # 1296896
    state = 424576 + 845056 + 2531072
    assert median(metrics, "memory_total_bytes") == state + 1296896  # the step outweighs the backward
    # grad_dtype param: bf16 buffers, so the step makes the fp32 copy: 4 + 8 bytes per element
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="none", grad_dtype="param")
    assert median(metrics, "memory_optimizer_step_bytes") == 12 * 162112  # 1945344
    assert median(metrics, "memory_total_bytes") == 424576 + 424576 + 2531072 + 1945344
    # zero1: a quarter of the dense family, half of the experts (edp 2); gradients gain the
    # reduce-scatter outputs in the buffer's dtype (dense grads / 4 + expert grads / 2)
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="zero1")
    assert median(metrics, "memory_optimizer_step_bytes") == 8 * 162112 / 4
    assert median(metrics, "memory_grads_bytes") == 845056 + 648448 / 4 + 196608 / 2  # 1105472
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="zero1", grad_dtype="param")
    assert median(metrics, "memory_optimizer_step_bytes") == 12 * 162112 / 4
    assert median(metrics, "memory_grads_bytes") == 424576 + 326272 / 4 + 98304 / 2  # 555296


def test_small_all_to_all_and_buffers():
    # per MoE block and microbatch: 4 * T 16 * k 2 * D 64 * 2 bytes * (ep-1)/ep 1/2 = 8192; x2 blocks x2 microbatches
    metrics, _ = small_plan(dispatch="sync")
    assert median(metrics, "comm_all_to_all_bytes") == 8192 * 2 * 2
    assert median(metrics, "memory_comm_buffers_bytes") == 2 * 16 * 2 * 64 * 2  # send + receive, 8192
    metrics, _ = small_plan(dispatch="no-sync", capacity_factor=1.25)
    assert median(metrics, "comm_all_to_all_bytes") == 8192 * 1.25 * 2 * 2  # 40960
    assert median(metrics, "memory_comm_buffers_bytes") == 8192 * 1.25
    assert median(metrics, "comm_pipeline_bytes") == 0


def test_small_grad_reduce_bytes():
    dense_params = 2 * 161088 + 4 * 1024  # 326272 bytes (the router fp32)
    expert_params = 2 * 49152  # 98304
    dense_grads, expert_grads = 4 * 162112, 4 * 49152  # fp32 buffers: 648448, 196608
    ddp = 2 * 3 / 4 * dense_grads + 2 * 1 / 2 * expert_grads  # ring all-reduce over dp 4 and edp 2: 1169280
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="none")
    assert median(metrics, "comm_grad_reduce_bytes") == pytest.approx(1169280) == ddp
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="none", grad_dtype="param")  # bf16 buffers
    assert median(metrics, "comm_grad_reduce_bytes") == pytest.approx(2 * 3 / 4 * 326272 + 2 * 1 / 2 * 98304)
    # reduce-scatter of the fp32 gradients + all-gather of the bf16 parameters
    metrics, _ = small_plan(dp_mode="ddp", optimizer_sharding="zero1")
    zero1 = 3 / 4 * (dense_grads + dense_params) + 1 / 2 * (expert_grads + expert_params)  # 878496
    assert median(metrics, "comm_grad_reduce_bytes") == pytest.approx(878496) == pytest.approx(zero1)
    # fsdp: fp32 gradients reduce-scattered once (its reduce dtype, whatever grad_dtype), bf16
    # parameters all-gathered in forward and backward of 2 microbatches
    fsdp = 3 / 4 * (dense_grads + 2 * 2 * dense_params) + 1 / 2 * (expert_grads + 2 * 2 * expert_params)
    for grad_dtype in ("fp32", "param"):
        metrics, _ = small_plan(dp_mode="fsdp", grad_dtype=grad_dtype)
        assert median(metrics, "comm_grad_reduce_bytes") == pytest.approx(1760064) == pytest.approx(fsdp)


def test_small_pipeline():
    # dp 2, ep 2, pp 2: 4 sequences per rank, 2 microbatches -> T = 32; stage 0 = embedding + block 0,
    # stage 1 = block 1 + head. Each stage sends 2 microbatches x 32 x 64 x 2 bytes in one direction.
    metrics, details = small_plan(dp=2, ep=2, pp=2, schedule="1f1b")
    assert [s["layers"] for s in details["stages"]] == [1, 1]
    assert details["stages"][0]["dense_params"] == 64000 + 16512 + 512
    assert details["stages"][1]["dense_params"] == 16512 + 512 + 64064
    assert median(metrics, "comm_pipeline_bytes") == 2 * 32 * 64 * 2  # 8192
    assert details["most_loaded"]["memory"] == 1  # the head's fp32 logits outweigh stage 0's second microbatch
    assert details["per_rank"]["in_flight_microbatches"] == 1


# ---- recompute on the small scenario, vocabulary 100 ---------------------------------------------
#
# With V 100 neither the LM head's backward (cross-entropy 8*16*100 = 12800; logits' and weight
# gradients 2*16*100 + 2*100*64 = 16000) nor the embedding's gradient (12800) outweighs an MoE block's
# expert backward, 59392 (above) less the head's activations 14592 (freed by then): 44800, so the
# recompute shows in the backward workspace. bf16, T 16, R 40 rows:
#   block, none: attention part 16640 (norm 6144 + its output 2048 + attention 8448)
#                + MoE part 25600 (norm 6144 + router 5120 + experts 10240 + combine 4096) = 42240
#   head: 6144 + 2048 + 4*16*100 = 14592
# FLOPs per token (S 16, q 64): attention forward 2*4*64*64 + 2*16*64 = 34816 per block, of which a
# selective recompute runs all but the output projection, 34816 - 2*64*64 = 26624; routed experts
# forward 2*2*3*64*32 = 24576 per block (a full recompute of a block without a shared expert runs
# its whole forward); model FLOPs 6*(2*4*64*64 + 2*2*3*64*32 + 64*100) + 2*6*16*64 = 394752.


def recompute_plan(recompute: dict | None = None, **parallel):
    # The experts' weight gradients made whole (59392 below counts their 49152), so that each
    # recompute's part of the workspace shows.
    spec = small_spec(**{"accumulate_in_gemm": False, **parallel})
    spec["model"]["vocab_size"] = 100
    spec["recompute"] = recompute or {}
    return plan_scenario(scenario_from_dict(spec))


RECOMPUTE_BY_HAND = {
    # mode: (per-microbatch activations, the most one recompute brings back, backward workspace, FLOPs)
    "none": ({}, 2 * 42240 + 14592, 0, 59392 - 14592, 0),
    # Each block keeps its bf16 input 2*16*64; its recompute brings the whole block back, alive while
    # its experts' backward runs.
    "full": ({"mode": "full"}, 2 * 2048 + 14592, 42240, 59392 + 42240 - 14592, 2 * (34816 + 24576)),
    # Only block 0 (index a multiple of 2).
    "full-every-2": ({"mode": "full", "every": 2}, 2048 + 42240 + 14592, 42240, 59392 + 42240 - 14592, 34816 + 24576),
    # The attention's 8448 go; they come back on their own, after the experts' backward.
    "attention": (
        {"mode": "selective", "parts": ["attention"]},
        2 * (42240 - 8448) + 14592,
        8448,
        59392 - 14592,
        2 * 26624,
    ),
    # The experts keep the received rows they gather from, 40*2*64 = 5120, instead of their 10240; the
    # recomputed forward gathers its rows anew, so all 10240 come back during the experts' backward.
    "experts": (
        {"mode": "selective", "parts": ["experts"]},
        2 * (42240 - 5120) + 14592,
        10240,
        59392 + 10240 - 14592,
        2 * 24576,
    ),
    # Each norm keeps its bf16 input 2048 instead of 6144; one norm's 6144 comes back at a time.
    "norms": ({"mode": "selective", "parts": ["norms"]}, 2 * (42240 - 2 * 4096) + 14592, 6144, 59392 - 14592, 0),
    "all-parts": (
        {"mode": "selective", "parts": ["attention", "experts", "norms"]},
        2 * (42240 - 8448 - 5120 - 2 * 4096) + 14592,
        10240,
        59392 + 10240 - 14592,
        2 * (26624 + 24576),
    ),
}


@pytest.mark.parametrize("mode", sorted(RECOMPUTE_BY_HAND))
def test_small_recompute_by_hand(mode):
    recompute, activations, peak, workspace, extra_flops = RECOMPUTE_BY_HAND[mode]
    metrics, details = recompute_plan(recompute)
    memory = details["per_rank"]["memory_bytes"]
    assert median(metrics, "memory_activations_bytes") == activations  # pp 1: one microbatch in flight
    assert memory["recompute_peak"] == peak
    assert median(metrics, "memory_backward_workspace_bytes") == workspace
    assert median(metrics, "flops_per_token") == 394752  # model FLOPs never count the recompute
    assert median(metrics, "recompute_flops_per_token") == extra_flops
    assert median(metrics, "hardware_flops_per_token") == 394752 + extra_flops
    assert details["recompute"]["flops_fraction_of_model"] == pytest.approx(extra_flops / 394752)
    # Recompute moves nothing but activations, the backward workspace and (full) the all-to-all.
    none, _ = recompute_plan()
    for key in ("params", "grads", "optimizer", "comm_buffers", "optimizer_step"):
        assert median(metrics, f"memory_{key}_bytes") == median(none, f"memory_{key}_bytes"), key


def test_full_recompute_runs_the_all_to_alls_again():
    # Per MoE block and microbatch 4 messages of T 16 * k 2 * D 64 * 2 bytes * 1/2 (ep 2) * cf 1.25 = 10240;
    # a fully recomputed block sends its forward dispatch and combine again: 6 messages.
    for recompute, messages in (
        ({}, 4),
        ({"mode": "selective", "parts": ["attention", "experts", "norms"]}, 4),
        ({"mode": "full"}, 6),
    ):
        metrics, _ = recompute_plan(recompute)
        assert median(metrics, "comm_all_to_all_bytes") == messages * 2560 * 2 * 2  # 2 blocks x 2 microbatches
    metrics, _ = recompute_plan({"mode": "full", "every": 2})  # block 0 only
    assert median(metrics, "comm_all_to_all_bytes") == (6 + 4) * 2560 * 2


def test_recomputed_blocks_are_chosen_over_the_chunks():
    # 4 blocks, pp 2 x 2 virtual stages: chunks [0], [1], [2], [3]; rank 0 runs chunks 0 and 2.
    spec = small_spec(dp=2, ep=2, pp=2, virtual_stages=2, schedule="interleaved1f1b")
    spec["model"]["n_layers"] = 4
    spec["recompute"] = {"mode": "full", "first_per_stage": 1}
    _, details = plan_scenario(scenario_from_dict(spec))
    assert details["recompute"]["blocks"] == 4  # the first block of each of the 4 chunks
    assert [s["layers"] for s in details["stages"]] == [2, 2]
    assert details["per_rank"]["recomputed_layers"] == details["per_rank"]["layers"]
    spec["recompute"] = {"mode": "full", "every": 2}
    _, details = plan_scenario(scenario_from_dict(spec))
    assert details["recompute"]["blocks"] == 2  # blocks 0 and 2, whatever their chunk
    assert details["per_rank"]["recomputed_layers"] == [i for i in details["per_rank"]["layers"] if i % 2 == 0]


def test_fp32_recompute_by_hand():
    # fp32 (a = 4), T 16, R 40: norm 16*64*8 = 8192 (its input itself, the normalised values);
    # attention part 8192 + its output 4096 + 4*16*256 + 256 = 28928; MoE part 8192 + router (its
    # input is the norm's output) 4096 + 1024 + experts 40*4*128 = 20480 + combine 8192 = 41984.
    spec = small_spec()
    spec["model"]["vocab_size"] = 100
    spec["precision"] = "fp32"
    none, _ = plan_scenario(scenario_from_dict(spec))
    head = 8192 + 4096 + 4 * 16 * 100  # 18688
    assert median(none, "memory_activations_bytes") == 2 * (28928 + 41984) + head
    # Full: the block's input is kept (4096); in fp32 it is what the first norm saved, so the
    # recompute brings back the rest, 70912 - 4096.
    spec["recompute"] = {"mode": "full"}
    metrics, details = plan_scenario(scenario_from_dict(spec))
    assert median(metrics, "memory_activations_bytes") == 2 * 4096 + head
    assert details["per_rank"]["memory_bytes"]["recompute_peak"] == 70912 - 4096
    # Norms: each keeps its input 4096 (what it saved already) and drops the normalised values 4096,
    # which come back alone.
    spec["recompute"] = {"mode": "selective", "parts": ["norms"]}
    metrics, details = plan_scenario(scenario_from_dict(spec))
    assert median(metrics, "memory_activations_bytes") == 2 * (70912 - 2 * 4096) + head
    assert details["per_rank"]["memory_bytes"]["recompute_peak"] == 4096


def test_stage_split_and_schedules():
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert stage_layers(56, 8) == [list(range(7 * r, 7 * r + 7)) for r in range(8)]
    assert in_flight_microbatches("1f1b", 1, 1, 32, 0) == 1
    assert in_flight_microbatches("gpipe", 4, 1, 8, 3) == 8
    assert in_flight_microbatches("1f1b", 4, 1, 8, 0) == 4
    assert in_flight_microbatches("1f1b", 4, 1, 8, 3) == 1
    assert in_flight_microbatches("1f1b", 4, 1, 2, 0) == 2
    # interleaved, pp 4, v 2, rank 0: 2*3 + 1*4 + 1 = 11 chunk-microbatches = 5.5 whole-rank microbatches
    assert in_flight_microbatches("interleaved1f1b", 4, 2, 8, 0) == 11 / 2
    assert in_flight_microbatches("interleaved1f1b", 4, 2, 8, 3) == 5 / 2


# ---- scaling and comparisons on the reference scenarios ---------------------------------------


def with_layout(name: str, **parallel):
    spec = olmo_dict(name)
    spec = copy.deepcopy(spec)
    spec["parallel"].update(parallel)
    spec["cluster"]["gpus"] = spec["parallel"]["dp"] * spec["parallel"].get("pp", 1)
    return plan_scenario(scenario_from_dict(spec, file=f"{name}.yaml"))


def test_zero1_optimizer_shards_dense_over_dp_and_experts_over_edp():
    rows = {}
    for dp in (8, 16, 32):
        _, details = with_layout("moe-128e-47b", dp=dp, ep=8, optimizer_sharding="zero1", microbatches=1)
        memory = details["per_rank"]["memory_bytes"]
        rows[dp] = (memory["optimizer_dense"], memory["optimizer_experts"], details["layout"]["edp"])
    for dp, (dense, experts, edp) in rows.items():
        assert edp == dp // 8
        assert dense == pytest.approx(rows[8][0] * 8 / dp, rel=1e-9)
        assert experts == pytest.approx(rows[8][1] / edp, rel=1e-9)
    # Without sharding neither part moves with dp.
    _, d8 = with_layout("moe-128e-47b", dp=8, ep=8, optimizer_sharding="none", microbatches=1)
    _, d32 = with_layout("moe-128e-47b", dp=32, ep=8, optimizer_sharding="none", microbatches=1)
    assert d8["per_rank"]["memory_bytes"]["optimizer"] == d32["per_rank"]["memory_bytes"]["optimizer"]
    assert d8["per_rank"]["memory_bytes"]["optimizer_dense"] == 8 * rows[8][0]


def test_mxfp8_saves_activation_memory_only():
    bf16, _ = plan_scenario(olmo("moe-bf16-4gpu"))
    mxfp8, _ = plan_scenario(olmo("moe-mxfp8-4gpu"))
    assert median(mxfp8, "memory_activations_bytes") < median(bf16, "memory_activations_bytes")
    for name in ("memory_params_bytes", "memory_grads_bytes", "memory_optimizer_bytes", "comm_total_bytes"):
        assert median(mxfp8, name) == median(bf16, name)


def test_fsdp_holds_fewer_params_per_rank_than_ddp_for_47b():
    ddp, _ = plan_scenario(olmo("moe-128e-47b"))
    fsdp, details = with_layout("moe-128e-47b", dp_mode="fsdp")
    assert median(fsdp, "memory_params_bytes") < median(ddp, "memory_params_bytes")
    assert median(fsdp, "memory_grads_bytes") < median(ddp, "memory_grads_bytes")
    assert details["per_rank"]["memory_bytes"]["gathered_unit_params"] > 0
    # ...and pays for it in traffic: params are gathered in every microbatch.
    assert median(fsdp, "comm_grad_reduce_bytes") > median(ddp, "comm_grad_reduce_bytes")


def test_fp32_state_costs_4_4_8_bytes():
    metrics, _ = small_plan("fp32")
    params = 161088 + 1024 + 49152
    assert median(metrics, "memory_params_bytes") == 4 * params
    assert median(metrics, "memory_grads_bytes") == 4 * params
    assert median(metrics, "memory_optimizer_bytes") == 8 * params


# ---- multi-head latent attention, interleaved dense blocks, tied embeddings ---------------------


def test_small_mla_activation_and_kv_bytes():
    # The small scenario with MLA: H 4, Q 32, C 24, n 8, r 8, v 12 (qk 16 wider: values padded to W 16).
    # T = 16 tokens per microbatch and rank, a = 2. Per block, attention saves
    #   query latent: norm 16*32*6 = 3072 + its output 2*16*32 = 1024
    #   kv latent:    norm 16*24*6 = 2304 + its output 2*16*24 = 768
    #   q, k, v at W: 3 * 2*16*4*16 = 6144; output 2048 + log-sum-exp 4*16*4 = 256; o_proj's copy 2*16*4*12 = 1536
    #   -> 17152, in place of GQA's q, k, v, o + lse 8192 + 256 = 8448.
    spec = small_spec()
    spec["model"]["mla"] = {
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
    }
    metrics, details = plan_scenario(scenario_from_dict(spec))
    assert median(metrics, "memory_activations_bytes") == 2 * (16640 - 8448 + 17152 + 25600) + 72192
    rank = details["per_rank"]
    # Keys and values as attention runs them: 2 * H * W * a per token and block; an inference cache
    # would hold the latent and the RoPE key, (C + r) * a.
    assert rank["attention_kv_bytes_per_microbatch"] == 2 * 16 * (2 * 4 * 16 * 2)
    assert rank["kv_cache_bytes_per_token"] == 2 * (24 + 8) * 2
    # GQA (4 kv heads of 16): 2 * 64 * 2 bytes, the same either way.
    _, gqa = small_plan()
    assert gqa["per_rank"]["kv_cache_bytes_per_token"] == 2 * 2 * 64 * 2
    assert gqa["per_rank"]["attention_kv_bytes_per_microbatch"] == 2 * 16 * 2 * 64 * 2


def test_small_interleaved_tied_plan():
    # 3 blocks, MoE every second (block 1), dense blocks 0 and 2 of F_d 48; tied embeddings (no LM head
    # matrix: the head is the final norm alone). pp 1.
    spec = small_spec()
    spec["model"].update(n_layers=3, moe_every=2, dense_hidden=48, tie_embeddings=True)
    metrics, details = plan_scenario(scenario_from_dict(spec))
    dense_ffn = 3 * 64 * 48  # 9216
    assert median(metrics, "total_params") == 64000 + 64 + 3 * 16512 + 2 * dense_ffn + 512 + 8 * 6144
    rank = details["per_rank"]
    assert (rank["n_dense_layers"], rank["n_moe_layers"]) == (2, 1)
    assert rank["dense_params"] == 64000 + 64 + 3 * 16512 + 2 * dense_ffn + 512
    assert rank["local_expert_params"] == 4 * 6144
    # Activations: a dense block saves its attention part 16640, its norm 6144, the FFN's input 2048 and
    # SwiGLU 4*2*16*48 = 6144; the MoE block 16640 + 25600 as in the all-MoE plan.
    dense_block = 16640 + 6144 + 2048 + 6144
    assert median(metrics, "memory_activations_bytes") == 2 * dense_block + 16640 + 25600 + 72192
