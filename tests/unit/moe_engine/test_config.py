import re

import pytest

from moe_engine.config import ExpertBackendKind, ModelConfig, MoEConfig, RoutingMode


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(moe=dict(num_experts=4, top_k=5)), "moe.top_k"),
        (dict(d_model=100, n_heads=3), "d_model"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(n_layers=2, n_dense_layers=3, dense_hidden=8), "n_dense_layers"),
        (dict(n_dense_layers=1), "dense_hidden"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(moe=dict(routing="uniform")), "moe.routing"),
        (dict(dtype="fp16"), "dtype"),
        (dict(moe=dict(aux_loss_weight=-1.0)), "moe.aux_loss_weight"),
        (dict(moe=dict(expert_hidden=0)), "moe.expert_hidden"),
        # head_dim, interleave, groups, MLA
        (dict(head_dim=7), "head_dim"),
        (dict(n_layers=4, n_dense_layers=1, moe_every=4, dense_hidden=8), "moe_every"),
        (dict(n_layers=4, moe_every=0), "moe_every"),
        (dict(n_layers=4, moe_every=2), "dense_hidden"),
        (dict(moe=dict(num_experts=8, n_groups=3)), "moe.n_groups"),
        (dict(moe=dict(num_experts=8, n_groups=4, top_groups=5)), "moe.top_groups"),
        (dict(moe=dict(num_experts=8, n_groups=4, top_groups=0)), "moe.top_groups"),
        (dict(moe=dict(num_experts=8, top_k=5, n_groups=4, top_groups=2)), "moe.top_k"),
        (dict(moe=dict(routed_scaling_factor=0)), "moe.routed_scaling_factor"),
        (dict(mla=dict(qk_rope_head_dim=5)), "mla.qk_rope_head_dim"),
        (dict(mla=dict(kv_lora_rank=0)), "mla.kv_lora_rank"),
        (dict(mla=dict(q_lora_rank=0)), "mla.q_lora_rank"),
        (dict(mla=dict(v_head_dim=0)), "mla.v_head_dim"),
        (dict(mla=dict(rank=4)), "mla.rank"),
        (dict(n_heads=4, n_kv_heads=2, mla=dict()), "n_kv_heads"),
        (dict(head_dim=16, mla=dict()), "head_dim"),
        (dict(qk_norm=True, mla=dict()), "qk_norm"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
        ModelConfig.from_dict(kwargs)


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match=r"^moe\.experts: unknown field"):
        ModelConfig.from_dict({"moe": {"experts": 8}})
    with pytest.raises(ValueError, match=r"^layers: unknown field"):
        ModelConfig.from_dict({"layers": 8})


def test_round_trip_through_plain_data():
    config = ModelConfig(n_layers=3, n_dense_layers=1, dense_hidden=64, moe=MoEConfig(routing="skewed", backend="loop"))
    assert config.moe.routing is RoutingMode.SKEWED
    assert config.moe.backend is ExpertBackendKind.LOOP
    data = config.to_dict()
    assert data["moe"]["routing"] == "skewed"
    assert ModelConfig.from_dict(data) == config


def test_head_dim_defaults_to_the_quotient_and_may_differ_from_it():
    assert ModelConfig(d_model=256, n_heads=4).head_dim == 64
    config = ModelConfig(d_model=96, n_heads=4, n_kv_heads=2, head_dim=10)
    assert config.head_dim == 10
    assert ModelConfig.from_dict(config.to_dict()) == config
    # MLA sets its own widths: head_dim stays unset, and the round trip keeps it so.
    mla = ModelConfig.from_dict({"n_heads": 4, "n_kv_heads": 4, "mla": {"q_lora_rank": None, "kv_lora_rank": 32}})
    assert mla.head_dim is None and mla.mla.q_lora_rank is None
    assert ModelConfig.from_dict(mla.to_dict()) == mla


def test_moe_every_places_moe_blocks_after_the_dense_ones():
    config = ModelConfig(n_layers=7, n_dense_layers=1, moe_every=3, dense_hidden=8)
    assert config.moe_layer_indices == [3, 6]
    assert (config.n_moe_layers, config.n_dense_ffn_layers) == (2, 5)
    assert ModelConfig(n_layers=3).moe_layer_indices == [0, 1, 2]
    # The step may equal the blocks after the dense ones: exactly one MoE block, the last.
    assert ModelConfig(n_layers=4, n_dense_layers=1, moe_every=3, dense_hidden=8).moe_layer_indices == [3]


def test_tied_embeddings_refuse_pipeline_stages():
    from moe_engine.config import ParallelConfig

    tied = ModelConfig(n_layers=4, tie_embeddings=True)
    ParallelConfig(pp=1, dp=2).validate(tied)
    with pytest.raises(ValueError, match=r"^model\.tie_embeddings: tied embeddings need the embedding and the LM head"):
        ParallelConfig(pp=2).validate(tied)
