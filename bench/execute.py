"""Execute a scenario for real in this process: build, warm up, measure, report.

This is what the worker process runs; ``bench.runner`` launches it with a timeout, so a hang or a
crash costs one scenario, not the suite.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from bench.memory import TensorMemoryTracker, rss_peak_bytes
from bench.results import metric
from bench.scenario import Scenario
from moe_engine import build_model
from moe_engine.flops import training_flops_per_token
from moe_engine.train import Trainer


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf: the run is marked failed."""


@dataclass
class ExecuteResult:
    metrics: dict[str, dict] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Achieved TFLOP/s of a large square matmul: the CPU's practical peak for MFU."""
    n = 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    synchronize(device)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
    synchronize(device)
    return 2 * n**3 * runs / (time.perf_counter() - start) / 1e12


def _batches(scenario: Scenario, device: torch.device):
    """Seeded random token batches, a fresh batch every step."""
    model = scenario.model
    sequences = scenario.run["tokens_per_step"] // model.seq_len
    generator = torch.Generator().manual_seed(scenario.spec["routing"]["seed"] + 12345)
    while True:
        tokens = torch.randint(0, model.vocab_size, (sequences, model.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def execute(
    scenario: Scenario,
    device: torch.device,
    peak_tflops: float | None,
    progress: Callable[[str], None] = lambda line: None,
) -> ExecuteResult:
    run = scenario.run
    config = scenario.model
    model = build_model(config, device=device, seed=scenario.spec["routing"]["seed"])
    trainer = Trainer(model)
    batches = _batches(scenario, device)
    tokens_per_step = run["tokens_per_step"]
    world = scenario.world_size
    flops_per_token = training_flops_per_token(config, config.seq_len)

    total_steps = run["warmup_steps"] + run["steps"] * run["repeats"]
    step_times, losses, counts = [], [], []
    for step in range(total_steps):
        tokens, labels = next(batches)
        measured = step >= run["warmup_steps"]
        synchronize(device)
        if measured and device.type == "cuda" and step == run["warmup_steps"]:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = trainer.step(tokens, labels)
        synchronize(device)
        elapsed = time.perf_counter() - start
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(f"loss is {loss_value} at step {step}")
        if measured:
            step_times.append(elapsed)
            losses.append(loss_value)
            counts.extend(layer.last_counts_E for layer in model.moe_layers())
        progress(f"step {step + 1}/{total_steps} {'measured' if measured else 'warm-up'} loss {loss_value:.4f} time {elapsed:.3f}s")

    result = ExecuteResult()
    m = result.metrics
    m["step_time_s"] = metric(step_times, "s", "lower")
    m["tokens_per_s_per_gpu"] = metric([tokens_per_step / t / world for t in step_times], "tokens/s", "higher")
    tflops = [flops_per_token * tokens_per_step / t / world / 1e12 for t in step_times]
    m["tflops_per_gpu"] = metric(tflops, "TFLOP/s", "higher")
    if peak_tflops:
        # Reported, not gated: it is tflops_per_gpu (gated) over a peak that is itself measured on CPUs.
        m["mfu"] = metric([t / peak_tflops for t in tflops], "ratio", None)
    m["loss"] = metric(losses, "nats", None)
    m.update(_routing_metrics(counts))
    m.update(_memory_metrics(scenario, model, trainer, batches, device))
    result.details.update(
        flops_per_token=flops_per_token,
        tokens_per_step=tokens_per_step,
        world_size=world,
        peak_tflops=peak_tflops,
        peak_tflops_source="measured dense matmul" if device.type == "cpu" else "datasheet table",
        expert_backend=config.moe.backend.value,
        losses=losses,
    )
    return result


def _routing_metrics(counts: list[torch.Tensor]) -> dict[str, dict]:
    """Tokens per expert over every MoE layer and measured step: min, max, coefficient of variation."""
    if not counts:
        return {}
    stacked = torch.stack([c.float().cpu() for c in counts])
    mins = stacked.min(dim=1).values.tolist()
    maxs = stacked.max(dim=1).values.tolist()
    cvs = (stacked.std(dim=1, unbiased=False) / stacked.mean(dim=1)).tolist()
    return {
        "tokens_per_expert_min": metric(mins, "tokens", None),
        "tokens_per_expert_max": metric(maxs, "tokens", None),
        "tokens_per_expert_cv": metric(cvs, "ratio", None),
        # Single-device dispatch is dropless; capacity-limited dispatch reports its drops here.
        "dropped_tokens": metric([0.0] * len(counts), "tokens", "lower"),
    }


def _memory_metrics(scenario, model, trainer, batches, device) -> dict[str, dict]:
    if device.type == "cuda":
        return {
            "cuda_peak_active_bytes": metric([torch.cuda.max_memory_allocated(device)], "bytes", "lower"),
            "cuda_peak_reserved_bytes": metric([torch.cuda.max_memory_reserved(device)], "bytes", "lower"),
        }
    # One extra step under the tracker (it slows ops, so it is not one of the timed steps).
    resident = list(model.parameters()) + list(model.buffers())
    resident += [m for m in trainer.optimizer.masters]
    resident += [t for s in trainer.optimizer.inner.state.values() for t in s.values() if torch.is_tensor(t)]
    tokens, labels = next(batches)
    with TensorMemoryTracker(resident) as tracker:
        trainer.step(tokens, labels)
    return {
        "peak_tensor_bytes": metric([tracker.peak], "bytes", "lower"),
        "rss_peak_bytes": metric([rss_peak_bytes()], "bytes", "lower"),
    }
