"""Measuring one rank of a proxy: build its share in a fake world, run warm-up and measured steps with
the phase timer and the collective recorder, and read each gradient bucket's overlap window as its
reduction launches (``bench.run.proxy.run``'s docstring, "What is measured")."""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bench.predict.proxy_projection import (
    BLOCK_PHASES,
    EMBEDDING,
    FABRICATION,
    GRAD_BUFFERS,
    WINDOW_CLASSES,
    BucketMeasurement,
)
from bench.run.collective_log import CollectiveCall, CollectiveRecorder
from bench.run.execute import NonFiniteLoss, synchronize
from bench.run.memory import TensorMemoryTracker, rss_peak_bytes
from bench.run.phase_timer import PhaseTimer, instrument_model
from bench.run.proxy.rank.build import build_proxy_rank
from bench.run.proxy.rank.peers import ProxyDispatcher
from bench.run.proxy.rank.pipeline import ProxyPipeline
from bench.run.proxy.scale import ProxyScale
from bench.run.sync_timeline import SyncTimeline
from bench.scenario import Scenario
from moe_engine.model import Block
from moe_engine.parallel.data_parallel import DataParallelOptimizer
from moe_engine.parallel.groups import ProcessGroups, build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer

logger = logging.getLogger(__name__)


def _batches(sequences: int, seq_len: int, vocab: int, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed + 12345)
    while True:
        tokens = torch.randint(0, vocab, (sequences, seq_len + 1), generator=generator).to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def _timed(owner, method: str, timer: PhaseTimer, phase: str) -> None:
    """Time every call of ``owner.method`` as ``phase``."""
    inner = getattr(owner, method)

    def timed(*args, **kwargs):
        with timer.region(phase):
            return inner(*args, **kwargs)

    setattr(owner, method, timed)


def _instrument(trainer: ParallelTrainer, rank_model, timer: PhaseTimer) -> None:
    """Phases of the blocks, plus the work whose size follows the parameters rather than the tokens:
    the optimizer, zeroing the gradient buffers, and the embedding (its backward makes a
    whole vocabulary x d_model gradient per microbatch)."""
    instrument_model(timer, rank_model.module)
    embed = getattr(rank_model.module, "embed", None)
    if embed is not None:
        # Its input (token ids) takes no gradient: its backward phase runs until the pass ends,
        # and the embedding's backward is the last work of the pass.
        timer.instrument(embed, EMBEDDING, open_ended=True)
    _timed(trainer.optimizer, "step", timer, "optimizer")
    _timed(trainer.optimizer, "zero_grad", timer, GRAD_BUFFERS)


def _window_classes(
    clock_s: float, start: dict[str, dict[str, float]], end: dict[str, dict[str, float]]
) -> dict[str, float]:
    """A stretch of ``clock_s`` seconds between two phase-timer readings, by ``WINDOW_CLASSES``, without
    fabrication."""

    def spent(*names: str) -> float:
        return sum(sum(end.get(n, {}).values()) - sum(start.get(n, {}).values()) for n in names)

    classes = {"blocks": spent(*BLOCK_PHASES), "embedding": spent(EMBEDDING), "grad_buffers": spent(GRAD_BUFFERS)}
    classes["rest"] = max(0.0, clock_s - sum(classes.values()) - spent(FABRICATION))
    return classes


class _SyncProbe:
    """Reads the clock and the phase timer as each bucket's reduction is issued and as the backward ends,
    so that each window of the step's ``SyncTimeline`` (which it sets as the optimizer's ``sync_observer``)
    splits by how it scales, without the proxy's fabrication. Each launch (scaling the bucket by 1/dp, then
    the collective) is timed as grad_buffers: its cost follows the bucket's bytes, not the tokens of the
    phase it happens to run in."""

    # Set by ``reset``, and by the wrapped methods as the step runs.
    timeline: SyncTimeline
    issued: dict[int, tuple[float, dict[str, dict[str, float]]]]
    backward_end: tuple[float, dict[str, dict[str, float]]] | None
    updates_start: float | None

    def __init__(self, optimizer: DataParallelOptimizer, timer: PhaseTimer):
        self.optimizer, self.timer = optimizer, timer
        self.reset()
        for index, bucket in enumerate(optimizer.buckets):
            self._wrap_launch(bucket, index)
        finish, clip = optimizer.finish_grad_sync, optimizer.clip_grad_norm

        def finish_grad_sync():
            if self.backward_end is None:
                self.backward_end = self._reading()
            finish()

        def clip_grad_norm():
            norm = clip()
            self.updates_start = time.perf_counter()
            return norm

        # Wraps this optimizer's own methods, so the probe sees the calls the trainer makes.
        optimizer.finish_grad_sync, optimizer.clip_grad_norm = finish_grad_sync, clip_grad_norm  # type: ignore[method-assign]

    def _reading(self) -> tuple[float, dict[str, dict[str, float]]]:
        return time.perf_counter(), self.timer.totals

    def _wrap_launch(self, bucket, index: int) -> None:
        launch = bucket.launch_reduce

        def launch_reduce():
            with self.timer.region(GRAD_BUFFERS):
                launch()
            self.issued[index] = self._reading()

        bucket.launch_reduce = launch_reduce

    def reset(self) -> None:
        """Forget the last step's readings (call before each step)."""
        self.timeline = self.optimizer.sync_observer = SyncTimeline()
        self.issued = {}
        self.backward_end = None
        self.updates_start = None

    def record(self) -> list[dict[str, Any]]:
        """Per bucket, of the step just run: its windows (``SyncTimeline``'s and split by class) and its update."""
        timeline = self.timeline
        if self.backward_end is None:
            raise RuntimeError("record() before a step's finish_grad_sync: no end of backward to split windows at")
        end_s, end_totals = self.backward_end
        # Without clipping the updates start as soon as the reductions have been waited for.
        previous = self.updates_start if self.updates_start is not None else timeline.reduce_waited_s
        if previous is None:
            raise RuntimeError("record() before the step's reductions were waited for: no start of the updates")
        reduce_windows, gather_windows = timeline.reduce_windows_s(), timeline.gather_windows_s()
        rows = []
        for index in range(len(self.optimizer.buckets)):
            issued_s, totals = self.issued[index]
            classes = _window_classes(end_s - issued_s, totals, end_totals) if issued_s < end_s else {}
            launch = timeline.gather_launch_s[index]
            rows.append(
                {
                    "reduce_window_s": reduce_windows[index],
                    "reduce_window_compute_s": {name: classes.get(name, 0.0) for name in WINDOW_CLASSES},
                    "update_s": launch - previous,
                    "gather_window_s": gather_windows[index],
                }
            )
            previous = launch
        return rows


def _bucket_layout(
    optimizer: DataParallelOptimizer, module: torch.nn.Module, bucket_elements: int
) -> list[dict[str, Any]]:
    """Per bucket: its family, the collectives it issues (as the recorder logs them), its block share and
    whether it filled up (``BucketMeasurement``)."""
    in_blocks = {id(p) for m in module.modules() if isinstance(m, Block) for p in m.parameters()}
    layout = []
    for bucket, grad_bytes in zip(optimizer.buckets, optimizer.bucket_bytes()):
        group = bucket.comm.group
        reduce = gather = None
        if group is not None:
            ranks, name = tuple(dist.get_process_group_ranks(group)), group.group_name
            reduce = CollectiveCall("reduce_scatter" if bucket.shard else "all_reduce", ranks, grad_bytes, name)
            if bucket.shard:
                param_bytes = bucket.param_N.numel() * bucket.param_N.element_size()
                gather = CollectiveCall("all_gather", ranks, param_bytes, name)
        elements = sum(p.numel() for p in bucket.params)
        block_elements = sum(p.numel() for p in bucket.params if id(p) in in_blocks)
        layout.append(
            {
                "family": bucket.family.value,
                "reduce": reduce,
                "gather": gather,
                "block_share": block_elements / elements if elements else 0.0,
                "filled": elements >= bucket_elements,
            }
        )
    return layout


@dataclass
class RankMeasurement:
    compute_s: list[float]
    phases: list[dict[str, dict[str, float]]]
    calls: list[CollectiveCall]
    memory: dict[str, int]
    losses: list[float]
    buckets: list[dict[str, Any]] = field(default_factory=list)
    """Per bucket (``_bucket_layout``): family, collectives, block share, filled."""
    syncs: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per measured step, per bucket: ``_SyncProbe.record``."""


def measure_rank(scenario: Scenario, scale: ProxyScale, device: torch.device) -> tuple[RankMeasurement, ProcessGroups]:
    parallel, config, run = scenario.parallel_config, scenario.model, scenario.run
    groups = build_process_groups(Layout(parallel))
    seed = scenario.spec["routing"]["seed"]
    logger.info(
        f"building rank {scale.rank}'s share ({scale.blocks_run} of {scale.blocks_full} blocks of stage {scale.pp_rank})"
    )
    rank_model = build_proxy_rank(
        config, parallel, groups, device, seed, recompute=scenario.recompute, compile=run.compile
    )
    trainer = ParallelTrainer(rank_model, parallel, groups, scenario.optimizer)
    optimizer = trainer.optimizer
    if not isinstance(optimizer, DataParallelOptimizer):
        raise ValueError("a proxy rank replays ddp layouts (its optimizer is the engine's), not fsdp")
    sync = functools.partial(synchronize, device)
    timer = PhaseTimer(synchronize=sync)
    _instrument(trainer, rank_model, timer)
    probe = _SyncProbe(optimizer, timer)
    fabrication = functools.partial(timer.region, FABRICATION)
    for layer in rank_model.moe_layers():
        if isinstance(layer.dispatcher, ProxyDispatcher):
            layer.dispatcher.fabrication = fabrication
    if rank_model.pipeline is not None:
        assert isinstance(rank_model.pipeline, ProxyPipeline)  # build_proxy_rank builds only proxy pipelines
        rank_model.pipeline.fabrication = fabrication

    sequences = scale.microbatches_run * scale.tokens_per_microbatch_run // scale.seq_len_run
    batches = _batches(sequences, scale.seq_len_run, config.vocab_size, device, seed)
    layout = _bucket_layout(optimizer, rank_model.module, parallel.bucket_elements)
    measured = RankMeasurement([], [], [], {}, [], layout)
    total = run.warmup_steps + run.steps
    for step in range(max(total, 1 + run.steps)):
        tokens, labels = next(batches)
        census = step == 0
        is_measured = step >= max(run.warmup_steps, 1)
        if is_measured and device.type == "cuda" and not measured.compute_s:
            torch.cuda.reset_peak_memory_stats(device)
        timer.reset()
        probe.reset()
        sync()
        start = time.perf_counter()
        if census:
            with CollectiveRecorder() as recorder:
                loss = trainer.step(tokens, labels)
            measured.calls = recorder.calls
        else:
            loss = trainer.step(tokens, labels)
        sync()
        wall = time.perf_counter() - start
        totals = timer.totals
        fabricated = sum(totals.get(FABRICATION, {}).values())
        if loss is not None and not math.isfinite(float(loss)):
            raise NonFiniteLoss(f"the proxy's loss is {float(loss)} at step {step}")
        if is_measured:
            measured.compute_s.append(wall - fabricated)
            measured.phases.append(totals)
            measured.syncs.append(probe.record())
            if loss is not None:
                measured.losses.append(float(loss))
        logger.info(
            f"step {step + 1}: {'measured' if is_measured else 'warm-up'} {wall - fabricated:.3f}s compute"
            f" (+{fabricated:.3f}s fabricating peers)"
        )
    if device.type == "cuda":
        measured.memory = {
            "cuda_peak_active_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    else:
        logger.info("memory step (tracked tensors)")
        tokens, labels = next(batches)
        optimizer_step, peaks = optimizer.step, {}
        with TensorMemoryTracker(trainer.resident_tensors()) as tracker:

            def split_peaks():
                # The forward/backward peak and the optimizer step's, each against its plan term.
                peaks["forward_backward"] = tracker.peak
                tracker.peak = tracker.current
                optimizer_step()

            # Splits this optimizer's step out of the trainer's, which calls it.
            optimizer.step = split_peaks  # type: ignore[method-assign]
            trainer.step(tokens, labels)
        optimizer.step = optimizer_step  # type: ignore[method-assign]
        measured.memory = {
            "peak_tensor_bytes": max(peaks["forward_backward"], tracker.peak),
            "peak_forward_backward_bytes": peaks["forward_backward"],
            "peak_optimizer_step_bytes": tracker.peak,
            "resident_tensor_bytes": tracker.baseline,
            "rss_peak_bytes": rss_peak_bytes(),
        }
    return measured, groups


def phase_table(measured: RankMeasurement) -> dict[str, dict[str, float]]:
    """Median seconds per phase and direction over the measured steps, plus other and optimizer."""
    names = sorted({name for totals in measured.phases for name in totals})
    table = {
        name: {
            d: statistics.median([t.get(name, {}).get(d, 0.0) for t in measured.phases])
            for d in ("forward", "backward")
        }
        for name in names
    }
    compute = statistics.median(measured.compute_s)
    accounted = sum(sum(v.values()) for k, v in table.items() if k != FABRICATION)
    table["other"] = {"forward": max(0.0, compute - accounted), "backward": 0.0}
    return table


def sync_table(measured: RankMeasurement) -> list[dict[str, Any]]:
    """Per bucket, in launch order: its bytes and the medians of its windows over the measured steps."""
    rows = []
    for index, layout in enumerate(measured.buckets):
        steps = [step[index] for step in measured.syncs]
        reduce, gather = layout["reduce"], layout["gather"]
        rows.append(
            {
                "family": layout["family"],
                "reduce_op": reduce.op if reduce else None,
                "group_size": len(reduce.ranks) if reduce else 1,
                "grad_bytes": reduce.nbytes if reduce else 0,
                "param_gather_bytes": gather.nbytes if gather else 0,
                "block_share": layout["block_share"],
                "filled": layout["filled"],
                "reduce_window_s": statistics.median([s["reduce_window_s"] for s in steps]),
                "reduce_window_compute_s": {
                    name: statistics.median([s["reduce_window_compute_s"][name] for s in steps])
                    for name in WINDOW_CLASSES
                },
                "update_s": statistics.median([s["update_s"] for s in steps]),
                "gather_window_s": statistics.median([s["gather_window_s"] for s in steps]),
            }
        )
    return rows


def bucket_measurements(measured: RankMeasurement, table: list[dict[str, Any]]) -> list[BucketMeasurement]:
    return [
        BucketMeasurement(
            layout["reduce"],
            layout["gather"],
            layout["block_share"],
            layout["filled"],
            row["reduce_window_compute_s"],
            row["update_s"],
        )
        for layout, row in zip(measured.buckets, table)
    ]
