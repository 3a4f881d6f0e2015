"""Execute a scenario for real in this process: build, warm up, measure, report.

One module on purpose: ``execute`` and its helpers (the trainer, the checkpoint session, the measured
work, memory and routing) are one pass over a scenario's run in the worker, sharing its trainer and records.

This is what the worker process runs; ``bench.run.runner`` launches it with a timeout, so a hang or a
crash costs one scenario, not the suite.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from bench.machine import Peaks
from bench.metrics import entry
from bench.run.checkpointing import (
    Checkpointer,
    CheckpointRun,
    append_journal,
    checkpoint_metrics,
    history,
    model_dict,
)
from bench.run.memory import TensorMemoryTracker, rss_peak_bytes
from bench.run.work import count_step_work, work_metrics
from bench.scenario import Scenario
from moe_engine import checkpoint, kernels
from moe_engine.flops import recompute_flops_per_token, training_flops_per_token
from moe_engine.modules.norm import RMSNorm
from moe_engine.moe.layer import MoELayer
from moe_engine.parallel.groups import ProcessGroups
from moe_engine.parallel.layout import stage_blocks
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.precision.cpu_bf16 import bf16_gemms_in_fp32, gemm_details

logger = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf: the run is marked failed."""


@dataclass
class ExecuteResult:
    metrics: dict[str, dict] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PEAK_MATMUL_SIZES = (256, 512, 1024, 2048, 4096)
"""Square matmul sizes a peak measurement may use, smallest first."""


def peak_matmul_size(seconds_of: Callable[[int], float], call_seconds: float = 0.1) -> int:
    """The first size of ``PEAK_MATMUL_SIZES`` whose product takes ``call_seconds`` or more (the
    largest if none does). A CPU without units for the dtype runs a bf16 product near 1 GFLOP/s: one
    4096 product would take over two minutes there, while a core with them runs it in half a second."""
    for n in PEAK_MATMUL_SIZES:
        if seconds_of(n) >= call_seconds:
            return n
    return PEAK_MATMUL_SIZES[-1]


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Achieved TFLOP/s of a large square matmul (sized by ``peak_matmul_size``), run as the timed steps
    run theirs (``bf16_gemms_in_fp32``): the practical peak for MFU."""

    def operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def seconds_of(n: int) -> float:
        a, b = operands(n)
        a @ b  # the first product of a shape builds its kernel
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        return time.perf_counter() - start

    with bf16_gemms_in_fp32(device, dtype):  # as the timed steps run their GEMMs
        n = peak_matmul_size(seconds_of)
        a, b = operands(n)
        for _ in range(2):
            a @ b
        synchronize(device)
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            runs += 1
        synchronize(device)
        return 2 * n**3 * runs / (time.perf_counter() - start) / 1e12


class TokenBatches:
    """Seeded random token batches, a fresh global batch every step; this rank's data-parallel share.

    Every rank draws the same global batch, so every layout trains on the same data. ``state`` is the
    stream's position (a checkpoint keeps it), ``restore`` goes back to one.
    """

    def __init__(self, scenario: Scenario, device: torch.device, dp_rank: int = 0):
        model, dp = scenario.model, scenario.parallel_config.dp
        self.sequences, self.seq_len, self.vocab = (
            scenario.run.tokens_per_step // model.seq_len,
            model.seq_len,
            model.vocab_size,
        )
        self.rows = slice(dp_rank * (self.sequences // dp), (dp_rank + 1) * (self.sequences // dp))
        self.device = device
        self.generator = torch.Generator().manual_seed(scenario.spec["routing"]["seed"] + 12345)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.sequences, self.seq_len + 1), generator=self.generator)
        tokens = tokens[self.rows].to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


@dataclass
class _RankRecord:
    """What one rank measured; rank 0 gathers every rank's record."""

    rank: int
    step_times: list[float] = field(default_factory=list)
    counts: dict[int, list[list[int]]] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    optimizer_state_bytes: int = 0
    work: dict[str, Any] = field(default_factory=dict)
    """What the work step did on this rank (``bench.run.work.StepWork.to_dict`` and the formula's FLOPs)."""


def _block_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("blocks") + 1])


def execute(
    scenario: Scenario,
    device: torch.device,
    peaks: Peaks,
    groups: ProcessGroups | None = None,
    checkpointing: CheckpointRun | None = None,
) -> ExecuteResult | None:
    """Run the scenario on this rank; every rank of a layout calls it. Rank 0 returns the result.

    ``peaks``: the device's dense BF16 peak (``mfu``), its FP8 peak (``mfu_fp8``, reported for MXFP8
    runs) and where they come from (the result records it as given); a peak that is None leaves its
    MFU out.
    ``checkpointing``: the checkpoints to take, and the one to resume from (``bench.run.checkpointing``).
    """
    run, config, parallel = scenario.run, scenario.model, scenario.parallel_config
    rank = groups.coords.rank if groups else 0
    rank_model, trainer = build_trainer(scenario, groups, device)
    moe_layers = {_block_index(name): m for name, m in rank_model.module.named_modules() if isinstance(m, MoELayer)}
    batches = TokenBatches(scenario, device, groups.coords.dp_rank if groups else 0)
    tokens_per_step = run.tokens_per_step
    world = scenario.world_size
    flops_per_token = training_flops_per_token(config, config.seq_len)
    # What activation recompute runs again in backward, apart: MFU counts the model's FLOPs only.
    recompute_flops = recompute_flops_per_token(
        config, scenario.recompute, stage_blocks(config.n_layers, parallel.num_stages), config.seq_len
    )

    record = _RankRecord(rank, counts={i: [] for i in moe_layers})
    dtype = config.dtype.torch_dtype
    total_steps = run.warmup_steps + run.steps * run.repeats
    ckpt = _CheckpointSession(scenario, trainer, groups, batches, checkpointing)
    losses, grad_norms = [], []
    for step in range(ckpt.start_step, total_steps):
        tokens, labels = next(batches)
        measured = step >= run.warmup_steps
        synchronize(device)
        if groups:
            dist.barrier()
        if measured and device.type == "cuda" and step == run.warmup_steps:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with bf16_gemms_in_fp32(device, dtype):
            loss = trainer.step(tokens, labels)
        synchronize(device)
        elapsed = time.perf_counter() - start
        loss_value = _global_loss(loss, groups, parallel.dp)
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(f"loss is {loss_value} at step {step}")
        grad_norm = None
        if measured:
            record.step_times.append(elapsed)
            losses.append(loss_value)
            if trainer.last_grad_norm is not None:
                # Read after the timed region: the norm stays on the device during the step.
                grad_norm = float(trainer.last_grad_norm)
                grad_norms.append(grad_norm)
            dropped = 0
            for index, layer in moe_layers.items():
                if layer.last_counts_E is None or layer.last_dropped is None:
                    raise RuntimeError(f"MoE layer of block {index} kept no routing statistics of the step")
                record.counts[index].append(layer.last_counts_E.tolist())
                dropped += int(layer.last_dropped)
            record.dropped.append(dropped)
        if rank == 0:
            logger.info(
                f"step {step + 1}/{total_steps} {'measured' if measured else 'warm-up'} "
                f"loss {loss_value:.4f} time {elapsed:.3f}s"
            )
        ckpt.step_done(step, measured, loss_value, elapsed, grad_norm)

    saves = ckpt.finish()
    record.memory = _measure_memory(trainer, batches, device, dtype)
    rank_tokens = tokens_per_step // parallel.dp
    record.work = _measure_work(scenario, trainer, rank_model, device, groups, flops_per_token * rank_tokens)
    if rank == 0:
        logger.info(f"work step (counted, untimed) {record.work['seconds']:.3f}s")
    record.optimizer_state_bytes = trainer.state_bytes()
    records = _gather(record, groups)
    if rank != 0:
        return None

    # A step takes as long as its slowest rank; a resumed run's earlier steps come from the journal.
    prior = [e for e in ckpt.prior_steps if e["measured"]]
    step_times = [e["time_s"] for e in prior] + [
        max(r.step_times[i] for r in records) for i in range(len(record.step_times))
    ]
    losses = [e["loss"] for e in prior] + losses
    grad_norms = [e["grad_norm"] for e in prior if e.get("grad_norm") is not None] + grad_norms
    result = ExecuteResult()
    m = result.metrics
    m["step_time_s"] = entry("step_time_s", step_times)
    m["tokens_per_s_per_gpu"] = entry("tokens_per_s_per_gpu", [tokens_per_step / t / world for t in step_times])
    tflops = [flops_per_token * tokens_per_step / t / world / 1e12 for t in step_times]
    m["tflops_per_gpu"] = entry("tflops_per_gpu", tflops)
    # Reported, not gated: the model's FLOPs plus the recompute's, what the devices executed (by the
    # formula's convention); equal to tflops_per_gpu without recompute.
    hardware = [(flops_per_token + recompute_flops) * tokens_per_step / t / world / 1e12 for t in step_times]
    m["hardware_tflops_per_gpu"] = entry("hardware_tflops_per_gpu", hardware)
    # Reported, not gated: each is tflops_per_gpu (gated) over a constant peak (measured on CPUs).
    if peaks.bf16:
        m["mfu"] = entry("mfu", [t / peaks.bf16 for t in tflops])
    if peaks.fp8 and scenario.precision == "mxfp8":
        # The expert GEMMs run MXFP8, the rest bf16: the true bound lies between the two peaks.
        m["mfu_fp8"] = entry("mfu_fp8", [t / peaks.fp8 for t in tflops])
    m["loss"] = entry("loss", losses)
    if grad_norms:
        m["grad_norm"] = entry("grad_norm", grad_norms)
    m.update(_routing_metrics(records))
    for key in ("peak_tensor_bytes", "rss_peak_bytes", "cuda_peak_active_bytes", "cuda_peak_reserved_bytes"):
        if key in record.memory:
            # Per rank, the most loaded rank's figure: what has to fit on one device.
            m[key] = entry(key, [max(r.memory[key] for r in records)])
    m["optimizer_state_bytes"] = entry("optimizer_state_bytes", [max(r.optimizer_state_bytes for r in records)])
    # The work of the whole step: every rank's counts summed (per rank in details.work).
    # work.py annotates formula_flops as int, but the formula's FLOPs are a float (it only divides by them).
    m.update(work_metrics([r.work for r in records], flops_per_token * tokens_per_step))
    for key, samples in checkpoint_metrics(saves, ckpt.load_s).items():
        m[key] = entry(key, samples)
    result.details.update(
        flops_per_token=flops_per_token,
        recompute_flops_per_token=recompute_flops,
        tokens_per_step=tokens_per_step,
        world_size=world,
        layout=parallel.to_dict(),
        peak_tflops=peaks.bf16,
        peak_tflops_fp8=peaks.fp8,
        peak_tflops_source=peaks.source if peaks.bf16 else None,
        expert_backend=config.moe.backend.value,
        expert_backend_path=_backend_path(rank_model),
        fused_kernels=_fused_kernel_paths(rank_model, config),
        gemms=gemm_details(device, dtype),
        losses=losses,
        per_rank=[_rank_details(r, groups) for r in records],
        work={"step": WORK_STEP, "ranks": [{"rank": r.rank, **r.work} for r in records]},
    )
    if ckpt.active:
        result.details["checkpoint"] = ckpt.details(saves)
    return result


class _CheckpointSession:
    """One run's checkpoints: the load it starts from, the saves it takes, its journal lines (rank 0)."""

    def __init__(
        self,
        scenario: Scenario,
        trainer: ParallelTrainer,
        groups,
        batches: TokenBatches,
        run: CheckpointRun | None,
    ):
        self.run, self.trainer, self.batches = run, trainer, batches
        self.rank = groups.coords.rank if groups else 0
        self.active = run is not None and (run.policy is not None or run.resume is not None)
        self.start_step = 0
        self.load_s: float | None = None
        self.prior_steps: list[dict] = []
        self.earlier_attempts: list[dict] = []
        self.checkpointer: Checkpointer | None = None
        self.stalls: list[float] = []
        if not self.active:
            return
        assert run is not None  # active needs a run
        # A group of its own: an async save's thread runs DCP's collectives while training runs its own.
        self.group = dist.new_group(backend="gloo") if groups else None
        barrier = (lambda: dist.barrier(group=self.group)) if groups else (lambda: None)
        if run.resume is not None:
            start = time.perf_counter()
            extra = checkpoint.load(trainer, run.resume, extra_keys=("step", "data"), process_group=self.group)
            self.load_s = time.perf_counter() - start
            self.start_step = extra["step"]
            batches.restore(extra["data"])
            if self.rank == 0:
                logger.info(f"resumed from {run.resume} at step {self.start_step} (loaded in {self.load_s:.2f}s)")
        if run.policy is not None:
            root = run.policy.root
        else:
            assert run.resume is not None  # active without a policy: it resumes
            root = Path(run.resume).parent
        self.journal_root = root if (run.policy is not None and self.rank == 0) else None
        if run.policy is not None:
            if self.rank == 0:
                self.prior_steps, self.earlier_attempts = history(root, self.start_step, run.attempt)
            self.checkpointer = Checkpointer(
                run.policy,
                save=lambda path, extra: checkpoint.save(trainer, path, extra, self.group),
                async_save=lambda path, extra: checkpoint.async_save(trainer, path, extra, self.group),
                rank=self.rank,
                world=scenario.world_size,
                barrier=barrier,
                sidecar_fields={
                    "scenario": scenario.name,
                    "model": model_dict(scenario.model),
                    "layout": scenario.parallel_config.to_dict(),
                    "format": checkpoint.checkpoint_format(trainer),
                },
            )
        if self.journal_root is not None:
            append_journal(
                self.journal_root,
                {
                    "event": "start",
                    "attempt": run.attempt,
                    "resumed_from_step": self.start_step if run.resume else None,
                },
            )
        self.groups = groups

    def step_done(self, step: int, measured: bool, loss: float, elapsed: float, grad_norm: float | None) -> None:
        if self.checkpointer is None:
            return
        assert self.run is not None  # the checkpointer is the run's policy's
        if self.groups:
            # The journal keeps the step's time: the slowest rank's.
            slowest = torch.tensor(elapsed, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            elapsed = slowest.item()
        if self.journal_root is not None:
            append_journal(
                self.journal_root,
                {
                    "event": "step",
                    "attempt": self.run.attempt,
                    "step": step,
                    "measured": measured,
                    "loss": loss,
                    "time_s": elapsed,
                    "grad_norm": grad_norm,
                },
            )
        self.checkpointer.poll()
        if self.checkpointer.due(step + 1):
            stall = self.checkpointer.save(step + 1, {"step": step + 1, "data": self.batches.state()})
            self.stalls.append(stall)
            if self.journal_root is not None:
                append_journal(
                    self.journal_root, {"event": "checkpoint", "attempt": self.run.attempt, "step": step + 1}
                )
                logger.info(f"checkpoint after step {step + 1}: training stalled {stall:.3f}s")

    def finish(self):
        return self.checkpointer.finish() if self.checkpointer else []

    def details(self, saves) -> dict[str, Any]:
        assert self.run is not None  # asked of an active session only
        return {
            "attempt": self.run.attempt,
            "resumed_from": str(self.run.resume) if self.run.resume else None,
            "resumed_from_step": self.start_step if self.run.resume else None,
            "earlier_attempts": self.earlier_attempts,
            "steps_from_earlier_attempts": len(self.prior_steps),
            "saves": [dataclasses.asdict(r) for r in saves],
            "folder": str(self.run.policy.root) if self.run.policy else None,
        }


def build_trainer(scenario: Scenario, groups: ProcessGroups | None, device: torch.device):
    """This rank's model share and its trainer, as the scenario asks: layout, recompute, compile, clipping."""
    rank_model = build_rank_model(
        scenario.model,
        scenario.parallel_config,
        groups,
        device,
        seed=scenario.spec["routing"]["seed"],
        recompute=scenario.recompute,
        compile=scenario.run.compile,
    )
    return rank_model, ParallelTrainer(rank_model, scenario.parallel_config, groups, scenario.optimizer)


def _backend_path(rank_model) -> str:
    """Which implementation the experts ran (the MXFP8 backend picks one by hardware)."""
    layers = rank_model.moe_layers()
    if not layers:
        return "none"
    backend = layers[0].experts.backend
    return getattr(backend, "path", type(backend).__name__)


def _fused_kernel_paths(rank_model, config) -> str:
    """Where each fused op ran (``model.fused_kernels``), a fallback with its reason: "op: path; ...",
    or "off". The compute dtype is the norms' weights' (the model's, not the fp32 router's)."""
    if not config.fused_kernels:
        return "off"
    weight = next(m.weight for m in rank_model.module.modules() if isinstance(m, RMSNorm))
    return kernels.paths_details(kernels.kernel_paths(weight.device, weight.dtype))


def _global_loss(loss: torch.Tensor | None, groups: ProcessGroups | None, dp: int) -> float:
    """The step's loss over the global batch: the mean of the last pipeline stages' local losses."""
    if groups is None:
        assert loss is not None  # one process runs the whole model, its last stage included
        return loss.item()
    total = torch.zeros((), dtype=torch.float64) if loss is None else loss.detach().double().cpu()
    dist.all_reduce(total)
    return total.item() / dp


def _gather(record: _RankRecord, groups: ProcessGroups | None) -> list[_RankRecord]:
    if groups is None:
        return [record]
    records: list[_RankRecord | None] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return cast(list[_RankRecord], records)  # every rank's record filled in


def _rank_details(record: _RankRecord, groups: ProcessGroups | None) -> dict[str, Any]:
    coords = dataclasses.asdict(groups.layout.coords(record.rank)) if groups else {"rank": 0}
    return {
        **coords,
        "step_time_s_median": statistics.median(record.step_times),
        "optimizer_state_bytes": record.optimizer_state_bytes,
        **record.memory,
        "dropped_assignments": sum(record.dropped),
    }


def _routing_metrics(records: list[_RankRecord]) -> dict[str, dict]:
    """Tokens per expert of every MoE layer and measured step over the global batch, and drops."""
    per_layer_step: dict[tuple[int, int], torch.Tensor] = {}
    for record in records:
        for index, steps in record.counts.items():
            for step, counts in enumerate(steps):
                key = (index, step)
                per_layer_step[key] = per_layer_step.get(key, 0) + torch.tensor(counts, dtype=torch.float64)
    if not per_layer_step:
        return {}
    stacked = torch.stack(list(per_layer_step.values()))
    mins = stacked.min(dim=1).values.tolist()
    maxs = stacked.max(dim=1).values.tolist()
    cvs = (stacked.std(dim=1, unbiased=False) / stacked.mean(dim=1)).tolist()
    measured_steps = len(records[0].step_times)
    dropped = [float(sum(r.dropped[i] for r in records)) for i in range(measured_steps)]
    return {
        "tokens_per_expert_min": entry("tokens_per_expert_min", mins),
        "tokens_per_expert_max": entry("tokens_per_expert_max", maxs),
        "tokens_per_expert_cv": entry("tokens_per_expert_cv", cvs),
        # Assignments over a no-sync dispatch's capacity, over all layers and ranks per step.
        "dropped_tokens": entry("dropped_tokens", dropped),
    }


WORK_STEP = (
    "one untimed training step after the measured ones and the memory step, on the first batch of the "
    "seeded stream with the routing generators restarted; per rank"
)


def _measure_work(
    scenario: Scenario, trainer: ParallelTrainer, rank_model, device, groups, formula_flops: float
) -> dict[str, Any]:
    """The exact work of one more step (``bench.run.work``), every rank together, next to the FLOPs
    formula's for the rank's tokens (``formula_flops``; a pipeline stage runs a share of the model).

    The same inputs every run: the first batch of the seeded stream, and random or skewed routing
    restarted from its seed, so the counts depend on the code alone (learned routing depends on
    the weights as well: the same after the same steps).
    """
    tokens, labels = next(TokenBatches(scenario, device, groups.coords.dp_rank if groups else 0))
    for layer in rank_model.moe_layers():
        layer.router.reset_routing_generator()
    group_labels: dict[str, str] = {}
    if groups is not None:
        world = dist.group.WORLD
        assert world is not None  # the launch's default group, which groups were made in
        group_labels[world.group_name] = "world"
        group_labels.update({getattr(groups, kind).group_name: kind for kind in ("dp", "ep", "edp", "pp")})
        dist.barrier()
    synchronize(device)
    # The counters sit above the bf16 GEMMs' mode (entered first): they count the program's bf16 ops.
    with bf16_gemms_in_fp32(device, scenario.model.dtype.torch_dtype):
        work = count_step_work(lambda: trainer.step(tokens, labels), device, trainer.resident_tensors(), group_labels)
    ratio = work.matmul_flops / formula_flops if formula_flops else 0.0
    return {**work.to_dict(), "formula_flops": formula_flops, "flops_ratio": ratio}


def _measure_memory(trainer: ParallelTrainer, batches, device, dtype: torch.dtype) -> dict[str, int]:
    if device.type == "cuda":
        return {
            "cuda_peak_active_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    # One extra step under the tracker (it slows ops, so it is not one of the timed steps).
    tokens, labels = next(batches)
    # The tracker sits above the bf16 GEMMs' mode (entered first): the fp32 copies inside a GEMM are
    # not the program's tensors.
    with bf16_gemms_in_fp32(device, dtype), TensorMemoryTracker(trainer.resident_tensors()) as tracker:
        trainer.step(tokens, labels)
    return {"peak_tensor_bytes": tracker.peak, "rss_peak_bytes": rss_peak_bytes()}
