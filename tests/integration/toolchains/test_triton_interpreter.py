"""The Triton kernels, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, in a child
process: Triton decides between compiling and interpreting when a kernel is defined), equal the eager
compositions they replace, forward and backward, in fp32 and in bf16.

bf16 is exact in the interpreter here because the kernels never let Triton convert to bf16 (its
interpreter truncates instead of rounding to nearest even): they read and write bf16 as int16 bit
patterns and round with integer operations (``moe_engine.kernels.storage``), which the first test
checks bit for bit against torch's conversion."""

import pytest
import torch
from fused_cases import DTYPES, MODEL_CONFIG, SEED, assert_matches_eager, case_id, cases, model_batch, run_eager
from interpreted_kernels import run_interpreted
from tolerances import assert_close_to_scale, model_tolerance

from moe_engine import ModelConfig, build_model

MODEL_SEED = 3


def storage_inputs() -> torch.Tensor:
    """fp32 values whose bf16 rounding is delicate, then random bit patterns of every kind."""
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
            -(1.0 + 2**-8),
            1.0 + 2**-8 + 2**-20,  # ties and near-ties
            3.389e38,
            3.4e38,
            -3.4e38,
            float("inf"),
            float("-inf"),
            float("nan"),
            -float("nan"),  # overflow to inf
            1e-40,
            -1e-40,
            2**-126,
            2**-133 * 3,  # subnormals
        ]
    )
    bits = torch.randint(-(2**31), 2**31, (4096,), generator=torch.Generator().manual_seed(SEED), dtype=torch.int64)
    return torch.cat([special, bits.to(torch.int32).view(torch.float32)])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case of every op, and the storage helpers, through the interpreted kernels."""
    folder = tmp_path_factory.mktemp("kernels_interpreter")
    return run_interpreted(folder, {"cases": cases(), "storage": storage_inputs()})


def test_storage_helpers_round_bf16_as_torch_does(interpreted):
    x = storage_inputs()
    want = x.to(torch.bfloat16)
    got = interpreted["storage"]
    nan = x.isnan()
    assert torch.equal(got["bits"][~nan], want.view(torch.int16)[~nan]), f"seed {SEED}"
    assert (got["bits"][nan] == 0x7FC0).all()  # torch's quiet NaN
    assert torch.equal(got["rounded"][~nan].view(torch.int32), want.float()[~nan].view(torch.int32)), f"seed {SEED}"
    assert got["rounded"][nan].isnan().all()
    widened = got["bits"].view(torch.bfloat16).float()
    assert torch.equal(got["widened"].view(torch.int32)[~nan], widened.view(torch.int32)[~nan])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_op_ran_its_triton_kernel(interpreted, dtype):
    assert set(interpreted["paths"][dtype].values()) == {"triton"}, interpreted["paths"][dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_interpreted_kernel_equals_eager_composition(interpreted, case, dtype):
    got = interpreted["ops"][case_id(case), dtype]
    assert_matches_eager(got, run_eager(case, DTYPES[dtype]), case, DTYPES[dtype], "Triton interpreter")


@pytest.mark.slow
def test_interpreted_fused_model_equals_unfused_model(tmp_path):
    """A model with every fused op on its Triton kernels (loss, every parameter's gradient) against the
    same model unfused, in fp32, within the model's error-analysis tolerance."""
    tokens, labels = model_batch()
    interpreted = run_interpreted(
        tmp_path, {"model_config": MODEL_CONFIG, "model_seed": MODEL_SEED, "tokens": tokens, "labels": labels}
    )
    assert set(interpreted["paths"]["fp32"].values()) == {"triton"}
    config = ModelConfig(**{**MODEL_CONFIG, "fused_kernels": False})
    model = build_model(config, seed=MODEL_SEED)
    loss = model.loss(tokens, labels)
    loss.backward()
    got = interpreted["model"]
    assert_close_to_scale(
        got["loss"], loss.detach(), model_tolerance(config, tokens.numel(), gradients=False), msg=f"loss, seed {SEED}"
    )
    tol = model_tolerance(config, tokens.numel())
    for name, param in model.named_parameters():
        assert_close_to_scale(got[name], param.grad, tol, msg=f"{name}, seed {SEED}")
