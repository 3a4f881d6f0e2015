"""Regional ``torch.compile`` (``run.compile``): compiled blocks train as the eager ones do, with every
recompute mode and on the expert-parallel no-sync path (on gloo ranks:
tests/integration/distributed/test_compile_ranks.py), and break where ``moe_engine.compile`` says.

Compiled and eager start from the same weights and see the same batches and routes (random routing:
the routers' streams stay eager in both, so the variants route alike). Tolerances:

- fp32: losses and every gradient entry (relative to that gradient's largest magnitude) to the fp32
  rounding of the model's sums (``tolerances.model_tolerance``: 3.4e-5 and 4.9e-5 here). Inductor fuses
  ops and reorders reductions, so sums round differently: measured up to 9e-7 on the gradients, 0 on
  the losses.
- bf16: losses to rtol 1e-3, gradients to 2^-4 (6.2e-2) of their largest magnitude. Eager rounds
  every op's output to bf16; inductor keeps a fused chain's intermediates in fp32 and rounds once.
  Each variant is then off the fp32 model by bf16 rounding, in its own way: measured, eager bf16
  against eager fp32 up to 2.8e-2 on the gradients and 1.7e-4 on the losses, and compiled bf16 no
  further from fp32 than that, so the two differ by up to twice that bound (measured 2.3e-2 and
  8.7e-5). These bounds catch a wrong term or scale; the fp32 ones are the tight check.
- MXFP8 experts (bf16 elsewhere): losses to rtol 1e-3, gradients to 2^-2 of their largest magnitude.
  The experts run the same eager code in both variants, on inputs that differ by bf16 rounding;
  where that moves a value across an E4M3 rounding boundary (3 mantissa bits, steps of 2^-3 of the
  value) or changes a block's shared scale, the quantized GEMMs' outputs jump, and the saved h is
  quantized again in backward: measured up to 0.11 on the experts' gradients, 1.8e-5 on the losses.

Each test starts from a fresh dynamo (``torch._dynamo.reset``): graphs compiled by an earlier test
would otherwise be reused, or compiled again with dynamic shapes for another model's sizes, and the
graphs and frames counted here would depend on the order of the tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from compile_cases import (
    CONFIG,
    EP_ROW,
    RECOMPUTE,
    SEED,
    STEPS,
    assert_breaks_as_documented,
    assert_close_to_eager,
    documented_breaks,
    train_steps,
)
from torch._dynamo.utils import counters

from moe_engine.compile import graph_breaks
from moe_engine.config import MLAConfig, ParallelConfig
from moe_engine.parallel.trainer import build_rank_model
from moe_engine.recompute import is_recomputed


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _worst(compiled, eager) -> tuple[float, float]:
    loss = ((compiled["losses"] - eager["losses"]).abs() / eager["losses"].abs()).max().item()
    grad = max(
        ((c[n] - e[n]).abs().max() / e[n].abs().max()).item()
        for c, e in zip(compiled["grads"], eager["grads"])
        for n in e
    )
    return loss, grad


def test_compile_keeps_the_modules_and_their_names():
    """Compiling is lazy and leaves every module where it was: same parameter names, same classes,
    the recompute wrappers still in place."""
    for mode, recompute in RECOMPUTE.items():
        eager = build_rank_model(CONFIG, ParallelConfig(), None, torch.device("cpu"), SEED, recompute)
        compiled = build_rank_model(CONFIG, ParallelConfig(), None, torch.device("cpu"), SEED, recompute, compile=True)
        assert list(dict(compiled.module.named_parameters())) == list(dict(eager.module.named_parameters()))
        assert [type(m) for m in compiled.module.modules()] == [type(m) for m in eager.module.modules()]
        assert [n for n, m in compiled.module.named_modules() if is_recomputed(m)] == [
            n for n, m in eager.module.named_modules() if is_recomputed(m)
        ], mode
    assert counters["stats"]["unique_graphs"] == 0


# Every recompute mode in fp32 (tight tolerance); bf16 once (its tolerance is about rounding, which
# the recompute mode does not change), to keep this file's cold-cache time down.
TRAINING_CASES = [(mode, "fp32") for mode in RECOMPUTE] + [("none", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("mode, dtype", TRAINING_CASES, ids=[f"{m}-{d}" for m, d in TRAINING_CASES])
def test_compiled_training_matches_eager(mode, dtype):
    config = dataclasses.replace(CONFIG, dtype=dtype)
    eager = train_steps(config, ParallelConfig(), None, RECOMPUTE[mode], compiled=False)
    assert counters["stats"]["unique_graphs"] == 0
    compiled = train_steps(config, ParallelConfig(), None, RECOMPUTE[mode], compiled=True)
    print(f"{mode} {dtype}: worst loss, gradient deviation {_worst(compiled, eager)}")
    assert_close_to_eager(compiled, eager, dtype)
    # Compiled for real, and as docs/compile-and-host-syncs.md says, whatever the recompute mode.
    assert_breaks_as_documented("torch grouped-mm", compiled, graph_breaks())


GRAPH_BREAK_MODELS = {
    "torch grouped-mm": CONFIG,
    "mxfp8 (emulated on CPU)": dataclasses.replace(
        CONFIG, dtype="bf16", moe=dataclasses.replace(CONFIG.moe, backend="mxfp8")
    ),
    "torch grouped-mm, learned routing": dataclasses.replace(
        CONFIG, moe=dataclasses.replace(CONFIG.moe, routing="learned")
    ),
}
"""The single-process rows of the docs page's table; the expert-parallel row (``EP_ROW``) is measured on 2
gloo ranks: tests/integration/distributed/test_compile_ranks.py."""


def test_the_table_has_a_test_for_every_row():
    assert set(documented_breaks()) == {*GRAPH_BREAK_MODELS, EP_ROW}


@pytest.mark.slow
@pytest.mark.parametrize("row", list(GRAPH_BREAK_MODELS))
def test_graph_breaks_are_the_documented_ones(row):
    config = GRAPH_BREAK_MODELS[row]
    eager = train_steps(config, ParallelConfig(), None, RECOMPUTE["none"], compiled=False)
    compiled = train_steps(config, ParallelConfig(), None, RECOMPUTE["none"], compiled=True)
    assert_breaks_as_documented(row, compiled, graph_breaks())
    assert_close_to_eager(compiled, eager, "mxfp8" if config.moe.backend.value == "mxfp8" else config.dtype.value)


@pytest.mark.slow
def test_blocks_of_a_class_share_their_compiled_code():
    """Four blocks compile what one block compiles, all on the first step: as many frames (a
    recompilation is one more) and graphs."""
    one = train_steps(dataclasses.replace(CONFIG, n_layers=1), ParallelConfig(), None, RECOMPUTE["none"], compiled=True)
    torch._dynamo.reset()
    counters.clear()
    four = train_steps(
        dataclasses.replace(CONFIG, n_layers=4), ParallelConfig(), None, RECOMPUTE["none"], compiled=True
    )
    assert four["frames"] == one["frames"]
    assert_breaks_as_documented("torch grouped-mm", four, graph_breaks())


@pytest.mark.slow
def test_compiled_mla_interleaved_tied_model_matches_eager():
    """Multi-head latent attention (its padded SDPA included), a dense block next to an MoE block and
    tied embeddings compile into the same regions, break only where the MoE blocks do, and train as
    eager does."""
    config = dataclasses.replace(
        CONFIG,
        n_kv_heads=4,
        head_dim=None,
        moe_every=2,
        dense_hidden=40,
        tie_embeddings=True,
        mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    )
    eager = train_steps(config, ParallelConfig(), None, RECOMPUTE["none"], compiled=False)
    compiled = train_steps(config, ParallelConfig(), None, RECOMPUTE["none"], compiled=True)
    assert_close_to_eager(compiled, eager, "fp32")
    _, documented_sites = documented_breaks()["torch grouped-mm"]
    assert [site for site, _ in graph_breaks()] == documented_sites
    assert compiled["frames"] == [compiled["frames"][0]] * STEPS, "nothing compiled after the first step"
