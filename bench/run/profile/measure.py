"""``moe-bench profile-device``: measure this device's curves and write a device profile (``devices/*.yaml``).

What each curve times and how: docs/proxies-and-projections.md, "What profile-device measures". The sweeps
and their cost are in ``bench.run.profile.sweep``, the timer and each curve's points in
``bench.run.profile.curves``, the document in ``bench.run.profile.document``; this module runs them in order.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.predict.device import DEVICES_DIR, DeviceProfile, load_profile
from bench.run.network import calibrate_network
from bench.run.profile.curves import (
    Timer,
    attention_points,
    free_op_seconds,
    gemm_points,
    grouped_gemm_points,
    host_op_seconds,
    memory_points,
    stream_gbps,
)
from bench.run.profile.document import Measured, cpu_facts, gpu_facts, profile_document, write_profile
from bench.run.profile.sweep import QUICK, Sweep, cpu_sweep, cuda_quick_sweep, cuda_sweep, tiny_sweep
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, Precision
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

__all__ = ["ProfileOptions", "profile_device", "profile_device_command"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileOptions:
    """What ``profile_device`` measures, and how it names and records the profile."""

    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int = 1
    """``torch.set_num_threads`` during the measurement (the threads one rank uses; restored after)."""
    name: str | None = None
    """The profile's name (default ``cpu-<cores>core``, or ``<base>-measured``)."""
    base: str | None = None
    """A profile (name or path) whose network is copied with its sources, on a GPU its peaks and hbm_gbps too;
    required on a GPU; on a CPU it stands in for the gloo calibration."""
    ranks: int = 2
    """Processes one host runs (network.gpus_per_node; the gloo calibration runs that many)."""
    sweep: Sweep | None = None
    """Sizes (default ``cpu_sweep``, on a GPU ``cuda_sweep`` or with ``quick`` ``cuda_quick_sweep``)."""
    network: dict[str, float] | None = None
    """An already measured ``calibrate_network`` result ({"latency_us", "gbps"}) instead of measuring one."""
    command: str | None = None
    """What to record as ``measured.command`` (default: the ``moe-bench profile-device`` line of these options)."""
    load: bool = True
    """On a CPU, measure while ``ranks - 1`` neighbour processes load the host, as a rank of a multi-rank CPU
    run shares it."""
    quick: bool = False
    """``QUICK``'s timing instead of the sweep's; on a GPU the default sweep is then ``cuda_quick_sweep``."""


def _neighbour(threads: int, stop) -> None:
    """Another rank's load on a shared host: training steps of a CPU-sized model of the engine (the
    smoke suite's 8-expert model, 1024 tokens a step), until told to stop."""
    torch.set_num_threads(threads)

    config = ModelConfig(
        vocab_size=1024,
        d_model=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=256,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=128),
        dtype=Precision.BF16,
    )
    parallel = ParallelConfig()
    trainer = ParallelTrainer(build_rank_model(config, parallel, None, torch.device("cpu"), 1), parallel, None)
    tokens = torch.randint(0, 1024, (4, 256))
    while not stop.is_set():
        trainer.step(tokens, tokens)


class _Neighbours:
    """``count`` processes loading the host as the other ranks of a CPU run would, while it is measured."""

    def __init__(self, count: int, threads: int):
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.processes = [
            context.Process(target=_neighbour, args=(threads, self.stop), daemon=True) for _ in range(count)
        ]

    def __enter__(self) -> _Neighbours:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _device(options: ProfileOptions) -> torch.device:
    """The device to measure, a GPU with its index; refuses other devices, and a GPU without a base."""
    dev = torch.device(options.device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"profile-device: device must be cpu or cuda[:N], got {options.device!r}")
    if dev.type == "cuda" and options.base is None:
        raise ValueError("profile-device: on a GPU give base=<profile> (e.g. h200-sxm) for the peaks and network")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _sweep(options: ProfileOptions, dev: torch.device) -> Sweep:
    sweep = options.sweep
    if sweep is None:
        sweep = cpu_sweep() if dev.type == "cpu" else cuda_quick_sweep() if options.quick else cuda_sweep()
    if options.quick:
        sweep = dataclasses.replace(sweep, **QUICK)
    return sweep


def _time_curves(timer: Timer) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every curve of the sweep by kind and dtype; a curve the fp32 cap left without points is left out."""
    dtypes = timer.sweep.dtypes
    curves: dict[str, dict[str, list]] = {
        "gemm": {},
        "grouped_gemm": {},
        "attention": {},
        "attention_backward": {},
        "memory": {},
    }
    for dtype in dtypes:
        logger.info(f"gemm {dtype}")
        curves["gemm"][dtype] = gemm_points(timer, dtype)
    for dtype in dtypes:
        logger.info(f"grouped_gemm {dtype}")
        curves["grouped_gemm"][dtype] = grouped_gemm_points(timer, dtype)
    for dtype in dtypes:
        logger.info(f"attention {dtype}")
        curves["attention"][dtype], curves["attention_backward"][dtype] = attention_points(timer, dtype)
    logger.info("memory")
    for dtype in dtypes:
        curves["memory"][dtype] = memory_points(timer, dtype)
    return {kind: {d: points for d, points in by_dtype.items() if points} for kind, by_dtype in curves.items()}


def _measure(dev: torch.device, sweep: Sweep, options: ProfileOptions) -> Measured:
    """Time the curves, the stream bandwidth and (CPU) the free op and the host's time per op, with
    ``options.threads`` threads (restored after) under the neighbours' load."""
    timer = Timer(dev, sweep)
    threads = options.threads
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # On a CPU host the other ranks share the cores' caches and memory bandwidth: measure under their load.
    neighbours = _Neighbours(options.ranks - 1 if dev.type == "cpu" and options.load else 0, threads)
    try:
        neighbours.__enter__()
        logger.info(
            f"profile-device: {dev}, {threads} thread(s), {len(neighbours.processes)} neighbour rank(s) loading the host"
        )
        curves = _time_curves(timer)
        stream, stream_numel = stream_gbps(timer)
        measured = Measured(dev, threads, sweep, curves, stream, stream_numel, len(neighbours.processes))
        if dev.type == "cpu":  # a GPU profile prices neither: its host queues kernels ahead of the device
            measured.free_op_us = free_op_seconds(timer) * 1e6
            logger.info(f"free op x.view(-1): {measured.free_op_us:.3f} us")
            measured.host_op_seconds, measured.host_ops = host_op_seconds(timer)
            logger.info(
                f"host time per op of a tiny training step ({measured.host_ops} ops): "
                f"{measured.host_op_seconds * 1e6:.2f} us"
            )
    finally:
        neighbours.__exit__()
        torch.set_num_threads(old_threads)
    return measured


def _network(options: ProfileOptions, base: DeviceProfile | None) -> tuple[dict[str, float] | None, str]:
    """The gloo calibration (given, or measured when there is no base either) and where it comes from."""
    if options.network is not None or base is not None:
        return options.network, "the gloo calibration passed in (a bench.validate.netcal result)"
    ranks = options.ranks
    logger.info(f"network: gloo between {ranks} local processes")
    network = calibrate_network(ranks)
    return network, f"gloo between {ranks} local processes (bench.validate.netcal via calibrate_network)"


def _command(options: ProfileOptions, kind: str, name: str) -> str:
    """The ``moe-bench profile-device`` line that measures this profile again."""
    threads_flag = f" --threads {options.threads}" if kind == "cpu" else ""
    return (
        f"moe-bench profile-device --device {options.device}{threads_flag} --name {name}"
        + (f" --base {options.base}" if options.base else "")
        + (f" --ranks {options.ranks}" if kind == "cpu" else "")
        + (" --quick" if options.quick else "")
    )


def profile_device(options: ProfileOptions | None = None) -> dict[str, Any]:
    """Measure ``options.device`` and return its profile as a dict (``bench.predict.device.profile_from_dict``
    form): its curves timed, then the network calibrated (or taken), then the document assembled."""
    options = options or ProfileOptions()
    dev = _device(options)
    base = load_profile(options.base) if options.base else None
    sweep = _sweep(options, dev)
    started = time.perf_counter()
    measured = _measure(dev, sweep, options)
    network, network_source = _network(options, base)
    seconds = time.perf_counter() - started

    date = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    stamp = f"measured by moe-bench profile-device on {date}"
    sources: dict[str, str] = {}
    if dev.type == "cpu":
        facts = cpu_facts(measured, options.ranks, network, network_source, base, stamp, sources)
    else:
        assert base is not None  # _device refuses a GPU without options.base
        facts = gpu_facts(measured, base, stamp, sources)
    name = options.name or facts.default_name
    command = options.command or _command(options, facts.kind, name)
    return profile_document(measured, facts, sources, name=name, command=command, date=date, seconds=seconds)


def profile_device_command(
    options: ProfileOptions,
    out: str | Path | None = None,
    tiny: bool = False,
) -> Path:
    """What ``moe-bench profile-device`` runs: measure, then write ``out`` (default ``devices/<name>.yaml``).
    ``tiny``: time ``tiny_sweep`` (seconds on a CPU: bench/gpu-check.sh --dry-run)."""
    if tiny:
        options = dataclasses.replace(options, sweep=tiny_sweep())
    profile = profile_device(options)
    if tiny:
        profile["measured"]["command"] += " --tiny"
    path = write_profile(profile, out or DEVICES_DIR / f"{profile['name']}.yaml")
    logger.info(f"profile-device: wrote {path} in {profile['measured']['seconds']} s")
    return path
