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
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(kwargs)
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="^moe.experts: unknown field"):
        ModelConfig.from_dict({"moe": {"experts": 8}})
    with pytest.raises(ValueError, match="^layers: unknown field"):
        ModelConfig.from_dict({"layers": 8})


def test_round_trip_through_plain_data():
    config = ModelConfig(n_layers=3, n_dense_layers=1, dense_hidden=64, moe=MoEConfig(routing="skewed", backend="loop"))
    assert config.moe.routing is RoutingMode.SKEWED
    assert config.moe.backend is ExpertBackendKind.LOOP
    data = config.to_dict()
    assert data["moe"]["routing"] == "skewed"
    assert ModelConfig.from_dict(data) == config
