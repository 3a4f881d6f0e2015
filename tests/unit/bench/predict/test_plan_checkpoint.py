"""``bench.predict.plan``'s checkpoint bytes against a real model counted by hand.

The reference builds the engine's model (``moe_engine.build_model``) and counts what the DCP
checkpoint of ``moe_engine.checkpoint`` holds from its ``named_parameters()`` and persistent buffers:
every parameter in its own dtype, an fp32 master of each parameter that is not fp32, two fp32 Adam
moments of every parameter, and the persistent buffers (the routers' fp32 ``expert_bias``). FSDP
layouts hold fp32 parameter shards and the two moments instead. Nothing here reuses the plan's
parameter counting.
"""

from __future__ import annotations

import pytest
import torch

from bench.predict.plan import plan_scenario
from bench.scenario import scenario_from_dict
from moe_engine import build_model
from moe_engine.config import ModelConfig, MoEConfig
from moe_engine.parallel.layout import stage_blocks

SIZES = dict(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, seq_len=8)
MOE = dict(num_experts=4, top_k=2, expert_hidden=24)


def spec(precision: str, n_layers: int = 4, **parallel) -> dict:
    dp, pp = parallel.setdefault("dp", 1), parallel.setdefault("pp", 1)
    return {
        "schema_version": 1,
        "name": "tiny-checkpoint",
        "mode": "plan",
        "model": {**SIZES, "n_layers": n_layers, "moe": dict(MOE)},
        "routing": {"mode": "random", "seed": 0},
        "precision": precision,
        "parallel": {"ep": 1, "microbatches": 2, **parallel},
        "run": {"tokens_per_step": 128},
        "cluster": {"gpus": dp * pp, "gpu_memory_gib": 1, "peak_tflops": 1},
    }


def plan(precision: str, n_layers: int = 4, **parallel):
    metrics, details = plan_scenario(scenario_from_dict(spec(precision, n_layers, **parallel)))
    return metrics["checkpoint_bytes_per_rank"]["median"], metrics["checkpoint_bytes_total"]["median"], details


def model_tensors(precision: str, n_layers: int = 4) -> list[tuple[str, torch.Tensor, bool]]:
    """(fqn, tensor, is a parameter) of everything the model's state dict holds."""
    dtype = "bf16" if precision == "mxfp8" else precision  # mxfp8: bf16 parameters, fp32 masters
    model = build_model(ModelConfig(**SIZES, n_layers=n_layers, dtype=dtype, moe=MoEConfig(**MOE)))
    params = dict(model.named_parameters())
    return [(fqn, t, fqn in params) for fqn, t in model.state_dict().items()]


def reference_bytes(tensors, fsdp: bool = False) -> int:
    total = 0
    for _, t, is_param in tensors:
        n = t.numel()
        if not is_param:
            total += n * t.element_size()  # a persistent buffer (expert_bias), saved as it is
        elif fsdp:
            total += 4 * n + 2 * 4 * n  # fp32 shard + exp_avg + exp_avg_sq
        else:
            master = 4 * n if t.dtype != torch.float32 else 0
            total += n * t.element_size() + master + 2 * 4 * n
    return total


def stage_tensors(tensors, n_layers: int, pp: int) -> list[list]:
    """The state-dict entries of each pipeline stage: its blocks, the embedding first, norm and head last."""
    stages = [[] for _ in range(pp)]
    owner = {i: s for s, blocks in enumerate(stage_blocks(n_layers, pp)) for i in blocks}
    for entry in tensors:
        fqn = entry[0]
        if fqn.startswith("blocks."):
            s = owner[int(fqn.split(".")[1])]
        elif fqn.startswith("embed."):
            s = 0
        else:
            assert fqn.startswith(("norm.", "lm_head.")), fqn
            s = pp - 1
        stages[s].append(entry)
    return stages


def test_reference_counts_what_the_checkpoint_holds():
    # The reference sees bf16 weights, fp32 routers and one fp32 expert_bias of 4 floats per block.
    tensors = model_tensors("bf16")
    dtypes = {fqn: t.dtype for fqn, t, _ in tensors}
    assert dtypes["blocks.0.ffn.router.weight"] == torch.float32
    assert dtypes["blocks.0.attn.q_proj.weight"] == torch.bfloat16
    biases = [t for fqn, t, is_param in tensors if not is_param]
    assert len(biases) == 4 and all(t.dtype == torch.float32 and t.numel() == 4 for t in biases)
    assert {fqn for fqn, _, is_param in tensors if not is_param} == {
        f"blocks.{i}.ffn.router.expert_bias" for i in range(4)
    }


@pytest.mark.parametrize("precision", ["bf16", "fp32", "mxfp8"])
def test_total_is_the_models_params_masters_moments_and_biases(precision):
    expected = reference_bytes(model_tensors(precision))
    per_rank, total, details = plan(precision)
    assert total == expected
    assert per_rank == expected  # dp 1, pp 1: one rank writes everything
    assert details["checkpoint"]["stage_bytes"] == [expected]
    assert isinstance(details["checkpoint"]["counted"], str) and "\n" not in details["checkpoint"]["counted"]


def test_fp32_has_no_masters_bf16_does():
    # fp32: 4 + 8 bytes per parameter; bf16: 2 + 4 + 8 for all but the routers (4 + 8).
    fp32, bf16 = model_tensors("fp32"), model_tensors("bf16")
    n = sum(t.numel() for _, t, p in fp32 if p)
    router = sum(t.numel() for fqn, t, p in bf16 if p and t.dtype == torch.float32)
    assert router == 4 * 4 * 32
    assert plan("fp32")[1] == 12 * n + 4 * 16
    assert plan("bf16")[1] == 14 * (n - router) + 12 * router + 4 * 16


@pytest.mark.parametrize(
    "parallel",
    [
        dict(dp=2),
        dict(dp=2, optimizer_sharding="zero1"),
        dict(dp=2, ep=2),
        dict(dp=4, ep=2, optimizer_sharding="zero1"),
    ],
)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_data_parallel_ranks_share_the_checkpoint(precision, parallel):
    expected = reference_bytes(model_tensors(precision))
    per_rank, total, _ = plan(precision, **parallel)
    assert total == expected  # the layout does not change what is written
    assert per_rank == -(-expected // parallel["dp"])


@pytest.mark.parametrize("n_layers", [4, 5])
@pytest.mark.parametrize("parallel", [dict(pp=2), dict(pp=2, dp=2, ep=2, optimizer_sharding="zero1")])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_pipeline_ranks_write_their_stage(precision, parallel, n_layers):
    tensors = model_tensors(precision, n_layers)
    stages = [reference_bytes(s) for s in stage_tensors(tensors, n_layers, parallel["pp"])]
    per_rank, total, details = plan(precision, n_layers, **parallel)
    assert details["checkpoint"]["stage_bytes"] == stages
    assert total == sum(stages) == reference_bytes(tensors)
    assert per_rank == -(-max(stages) // parallel.get("dp", 1))
    # The stages differ (embedding vs. final norm + head, and 3 vs. 2 blocks with 5 layers).
    assert len(set(stages)) == 2


@pytest.mark.parametrize("parallel", [dict(dp=2), dict(dp=4, ep=2), dict(dp=2, pp=2)])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp_holds_fp32_shards_and_moments(precision, parallel):
    tensors = model_tensors(precision)
    pp = parallel.get("pp", 1)
    stages = [reference_bytes(s, fsdp=True) for s in stage_tensors(tensors, 4, pp)]
    per_rank, total, details = plan(precision, dp_mode="fsdp", **parallel)
    assert total == sum(stages) == reference_bytes(tensors, fsdp=True)
    assert details["checkpoint"]["stage_bytes"] == stages
    assert per_rank == -(-max(stages) // parallel.get("dp", 1))
    assert "fsdp2" in details["checkpoint"]["counted"]
