"""Regional ``torch.compile`` against eager training: the small model and its settings, the recompute
modes, the tolerances (the reasons: tests/integration/toolchains/test_compile.py's docstring), a training run
that records dynamo's graphs and frames after each step, and the graph breaks documented in
docs/compile-and-host-syncs.md."""

from __future__ import annotations

import re

import torch
import torch._dynamo
from tolerances import model_tolerance
from torch._dynamo.utils import counters

import moe_engine.compile as compile_module
from bench.results import REPO_ROOT
from moe_engine.config import ModelConfig, MoEConfig, RecomputeConfig, RecomputePart
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, routing="random", shared_expert_hidden=16),
    # The reference step: the graph-break table below is the unfused model's.
    fused_kernels=False,
)
# lr 1 and eps 1 make the updates nearly proportional to the gradients (as in tests/integration/distributed/test_trainer.py):
# Adam's normalisation would turn the rounding noise of near-zero gradients into full-size updates.
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0)
SEQUENCES, STEPS = 4, 3
# Fixed, so that a failure replays exactly (the model's init and the batches derive from it).
SEED = 1234
RECOMPUTE = {
    "none": RecomputeConfig(),
    "full": RecomputeConfig(mode="full"),
    "selective": RecomputeConfig(mode="selective", parts=list(RecomputePart)),
}
# Every fp32 model compiled here is CONFIG or one of its size (the widest sum: the 96-word vocabulary).
FP32_TOLERANCE = (
    model_tolerance(CONFIG, SEQUENCES * CONFIG.seq_len, gradients=False),
    model_tolerance(CONFIG, SEQUENCES * CONFIG.seq_len),
)
TOLERANCE = {"fp32": FP32_TOLERANCE, "bf16": (1e-3, 2**-4), "mxfp8": (1e-3, 2**-2)}
"""(loss rtol, gradient tolerance relative to the gradient's largest magnitude), see the module docstring."""


def documented_breaks() -> dict[str, tuple[int, list[str]]]:
    """The table of docs/compile-and-host-syncs.md: backend -> (graphs, break sites)."""
    lines = (REPO_ROOT / "docs" / "compile-and-host-syncs.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*backend\s*\|\s*graphs\s*\|\s*breaks", line))
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        backend, graphs, sites = (cell.strip() for cell in line.strip("|").split("|"))
        table[backend] = (int(graphs), [s.strip() for s in sites.split(",")])
    return table


def token_batches(config: ModelConfig, sequences: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, config.vocab_size, (sequences, config.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def train_steps(config, parallel, groups, recompute, compiled, seed=SEED, rows=slice(None)):
    """Losses, every step's gradients, and dynamo's compiled graphs and frames after each step."""
    rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), seed, recompute, compile=compiled)
    trainer = ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)
    params = dict(rank_model.module.named_parameters())
    losses, grads, graphs, frames = [], [], [], []
    for tokens, labels in token_batches(config, SEQUENCES * parallel.dp, seed):
        losses.append(trainer.step(tokens[rows], labels[rows]))
        grads.append({n: trainer.optimizer.grad_view(p).float().clone() for n, p in params.items()})
        graphs.append(counters["stats"]["unique_graphs"])
        frames.append(counters["frames"]["total"])
    return {"losses": torch.stack(losses), "grads": grads, "graphs": graphs, "frames": frames, "rank_model": rank_model}


def assert_close_to_eager(compiled, eager, precision: str) -> None:
    loss_rtol, grad_tol = TOLERANCE[precision]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=loss_rtol, atol=0)
    for step, (got, want) in enumerate(zip(compiled["grads"], eager["grads"])):
        for name, grad in want.items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                got[name],
                grad,
                rtol=0,
                atol=grad_tol * scale,
                msg=lambda m, step=step, name=name: f"step {step}, gradient of {name}: {m}",
            )


# The table's row measured on 2 gloo ranks (tests/integration/distributed/test_compile_ranks.py).
EP_ROW = "expert-parallel no-sync dispatch (ep 2)"


def assert_breaks_as_documented(row: str, run: dict, breaks: list[tuple[str, str]]) -> None:
    """The documented graphs, all compiled on the first step (no frame compiled after it), and breaks."""
    documented_graphs, documented_sites = documented_breaks()[row]
    assert run["graphs"] == [documented_graphs] * STEPS, f"{row}: graphs after each step {run['graphs']}"
    assert run["frames"] == [run["frames"][0]] * STEPS, f"{row}: frames compiled after each step {run['frames']}"
    assert [site for site, _ in breaks] == documented_sites, f"{row}: measured {breaks}"
    assert {reason for _, reason in breaks} == {compile_module.EAGER_REASON}, f"{row}: measured {breaks}"
