"""``moe-bench profile-device``'s document: what was measured (``Measured``) turned into a device profile,
its peaks and clock (CPU: from ``bench.machine.cpu_spec``; GPU: a base profile's), network, efficiencies and
a source for every figure, and the YAML file it is written to (``write_profile``).
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.machine import CpuSpec, cpu_spec
from bench.predict.device import DeviceProfile, profile_from_dict
from bench.run.profile.curves import round_significant
from bench.run.profile.sweep import Sweep

__all__ = ["DeviceFacts", "Measured", "cpu_facts", "efficiency", "gpu_facts", "profile_document", "write_profile"]


@dataclass
class Measured:
    """What ``profile_device`` measured on the device, before any of it becomes a profile."""

    device: torch.device
    """The device measured (a GPU with its index)."""
    threads: int
    """``torch.set_num_threads`` during the measurement."""
    sweep: Sweep
    """The sizes and timing budget measured."""
    curves: dict[str, dict[str, list[dict[str, Any]]]]
    """Points by curve kind and dtype; a curve the sweep's fp32 cap left without points is absent."""
    stream_gbps: float
    """The better DRAM bandwidth of ``torch.add(a, b, out=c)`` at the two largest memory sizes."""
    stream_numel: int
    """Elements per operand of that better stream point."""
    neighbours: int
    """Processes that loaded the host meanwhile, as a CPU run's other ranks do."""
    free_op_us: float | None = None
    """CPU: microseconds of a kernel-less ``x.view(-1)``; None on a GPU."""
    host_op_seconds: float | None = None
    """CPU: a tiny training step's seconds per dispatched op; None on a GPU."""
    host_ops: int | None = None
    """CPU: the ops that step dispatches; None on a GPU."""


@dataclass
class DeviceFacts:
    """What a profile states of the device besides its curves and efficiencies."""

    kind: str
    """``cpu`` or ``gpu``."""
    default_name: str
    """The profile's name when none is given."""
    description: str
    """One line on the device and how it was measured."""
    machine: dict[str, Any]
    """``measured.machine``: the host's CPU, GPU and software."""
    memory_gb: float
    """The device's memory."""
    peak_tflops: dict[str, float]
    """Dense peak by dtype."""
    peak_scale: float
    """The share of the peak the measurement ran on (a CPU: its threads' cores of all cores)."""
    hbm_gbps: float
    """Memory bandwidth."""
    network: dict[str, float]
    """``network``: ranks per host, link bandwidths and latency."""


def _rate(point: dict[str, Any]) -> float:
    return point["work"] / point["seconds"]


def _largest(points: list[dict[str, Any]]) -> dict[str, Any]:
    return max(points, key=lambda p: (p["work"], -p["seconds"]))


def _fraction(value: float) -> float:
    return round_significant(min(1.0, max(value, 1e-6)), 3)


def _base_network(base: DeviceProfile, sources: dict[str, str]) -> dict[str, float]:
    """The network of the ``base`` profile, its sources added to ``sources``."""
    for k in base.network:
        sources[f"network.{k}"] = f"copied from {base.name}: {base.sources[f'network.{k}']}"
    return dict(base.network)


def _cpu_clock(spec: CpuSpec, measured: Measured, used: int) -> tuple[float, str]:
    """GHz the peaks are computed at, and its source: lscpu's, unless the measured GEMMs need a faster
    one (a guest that shows only its nominal clock); then the lowest clock that explains them."""
    dtypes, curves = measured.sweep.dtypes, measured.curves
    best = {d: max((p for k in ("gemm", "grouped_gemm") for p in curves[k].get(d, [])), key=_rate) for d in dtypes}
    needed = {d: _rate(best[d]) / (used * spec.flops_per_cycle[d] * 1e9) for d in dtypes}
    fastest = max(needed, key=needed.__getitem__)
    if needed[fastest] <= spec.ghz:
        return spec.ghz, spec.ghz_source
    ghz = needed[fastest]
    return ghz, (
        f"{spec.ghz_source}, raised to {ghz:.3f} GHz: the fastest measured {fastest} GEMM point "
        f"(shape {best[fastest]['shape']}, {_rate(best[fastest]) / 1e12:.4f} TFLOP/s on {used} "
        f"thread(s)) needs at least that clock at {spec.flops_per_cycle[fastest]} FLOPs/cycle/core, "
        f"so this is a lower bound of the running (turbo) clock"
    )


def _cpu_peaks(spec: CpuSpec, measured: Measured, sources: dict[str, str]) -> dict[str, float]:
    """Cores x clock x FLOPs/cycle by dtype (fp8 and mxfp8: the bf16 figure), their sources added."""
    ghz, ghz_note = _cpu_clock(spec, measured, min(measured.threads, spec.cores))
    peak = {d: spec.cores * ghz * spec.flops_per_cycle[d] / 1e3 for d in ("fp32", "bf16")}
    peak_tflops = {
        "fp32": round_significant(peak["fp32"]),
        "bf16": round_significant(peak["bf16"]),
        "fp8": round_significant(peak["bf16"]),
        "mxfp8": round_significant(peak["bf16"]),
    }
    for d in ("fp32", "bf16"):
        sources[f"peak_tflops.{d}"] = (
            f"lscpu: {spec.cores} cores x {ghz:.3f} GHz x {spec.flops_per_cycle[d]} {d} FLOPs/cycle/core "
            f"({spec.units[d]}); clock: {ghz_note}"
            + (
                ". The FMA-unit count is not in the flags; 2 is assumed (server Xeon/EPYC cores)"
                if spec.flops_per_cycle[d] == spec.flops_per_cycle["fp32"]
                else ""
            )
        )
    for d in ("fp8", "mxfp8"):
        sources[f"peak_tflops.{d}"] = (
            "lscpu: this CPU has no FP8 units (no FP8 AMX/AVX flags); FP8/MXFP8 "
            "GEMMs run dequantized, so the bf16 figure is given"
        )
    return peak_tflops


def _calibrated_network(
    network: dict[str, float], ranks: int, network_source: str, stamp: str, sources: dict[str, str]
) -> dict[str, float]:
    """The profile's network from a gloo calibration between ``ranks`` local processes, its sources added."""
    sources["network.gpus_per_node"] = f"the ranks one host runs here ({ranks}, one process per rank)"
    sources["network.intra_node_gbps"] = (
        f"{stamp}: {network_source}: bandwidth from the slope between 1 KB and 16 MB all-reduces and all-to-alls"
    )
    sources["network.inter_node_gbps"] = f"no second host: the same gloo figure as intra_node_gbps ({stamp})"
    sources["network.latency_us"] = f"{stamp}: {network_source}: alpha from 1 KB all-reduces and all-to-alls"
    return {
        "gpus_per_node": int(ranks),
        "intra_node_gbps": round_significant(network["gbps"]),
        "inter_node_gbps": round_significant(network["gbps"]),
        "latency_us": round_significant(network["latency_us"]),
    }


def cpu_facts(
    measured: Measured,
    ranks: int,
    network: dict[str, float] | None,
    network_source: str,
    base: DeviceProfile | None,
    stamp: str,
    sources: dict[str, str],
) -> DeviceFacts:
    """A CPU's facts: peaks from lscpu, RAM, the measured DRAM bandwidth, and the gloo ``network`` (None:
    ``base``'s network); their sources added to ``sources``."""
    spec = cpu_spec()
    peak_tflops = _cpu_peaks(spec, measured, sources)
    memory_gb = round_significant(spec.memory_gb)
    sources["memory_gb"] = (
        f"/proc/meminfo: MemTotal {spec.memory_gb * 1e9 / 1024:.0f} kB x 1024 bytes / 1e9, the "
        "physical RAM the kernel sees"
    )
    sources["hbm_gbps"] = (
        f"{stamp}: DRAM bandwidth of torch.add(a, b, out=c) into a preallocated fp32 "
        f"output, {measured.stream_numel} elements per operand (the best of the two largest memory "
        f"sizes), 3 x numel x 4 bytes / median seconds, {measured.threads} thread(s)"
    )
    if network is None:  # a base was given and no calibration: its network, as on a GPU
        if base is None:
            raise ValueError("cpu_facts: no network calibration and no base profile to copy the network from")
        net = _base_network(base, sources)
    else:
        net = _calibrated_network(network, ranks, network_source, stamp, sources)
    return DeviceFacts(
        kind="cpu",
        default_name=f"cpu-{spec.cores}core",
        description=(
            f"{spec.model}, {spec.cores} cores, {memory_gb} GB RAM (measured with {measured.threads} "
            f"thread(s) per rank, {ranks} ranks per host)"
        ),
        machine={
            "cpu": spec.model,
            "cores": spec.cores,
            "torch": str(torch.__version__),
            "platform": platform.platform(),
        },
        memory_gb=memory_gb,
        peak_tflops=peak_tflops,
        peak_scale=min(measured.threads, spec.cores) / spec.cores,  # the measurement ran on these cores
        hbm_gbps=round_significant(measured.stream_gbps),
        network=net,
    )


def gpu_facts(measured: Measured, base: DeviceProfile, stamp: str, sources: dict[str, str]) -> DeviceFacts:
    """A GPU's facts: peaks, bandwidth and network copied from ``base`` with its sources; memory from torch."""
    dev = measured.device
    props = torch.cuda.get_device_properties(dev)
    peak_tflops = dict(base.peak_tflops)
    for key, text in base.sources.items():
        sources[key] = text
    for d in peak_tflops:
        sources[f"peak_tflops.{d}"] = f"copied from {base.name}: {base.sources[f'peak_tflops.{d}']}"
    memory_gb = round_significant(props.total_memory / 1e9)
    sources["memory_gb"] = f"{stamp}: torch.cuda.get_device_properties({dev}).total_memory / 1e9"
    sources["hbm_gbps"] = (
        f"copied from {base.name}: {base.sources['hbm_gbps']} (measured here: "
        f"{measured.stream_gbps:.0f} GB/s by torch.add out= at {measured.stream_numel} elements)"
    )
    net = _base_network(base, sources)
    return DeviceFacts(
        kind="gpu",
        default_name=f"{base.name}-measured",
        description=f"{props.name}, {memory_gb} GB (curves measured; peaks and network from {base.name})",
        machine={
            "gpu": props.name,
            "cpu": cpu_spec().model,
            "cores": os.cpu_count(),
            "torch": str(torch.__version__),
            "cuda": torch.version.cuda,
        },
        memory_gb=memory_gb,
        peak_tflops=peak_tflops,
        peak_scale=1.0,
        hbm_gbps=base.hbm_gbps,
        network=net,
    )


def efficiency(measured: Measured, facts: DeviceFacts, stamp: str, sources: dict[str, str]) -> dict[str, float]:
    """The profile's ``efficiency``: each compute curve's largest point against the peak, the memory curve's
    against ``hbm_gbps``, the smallest op's time, and on a CPU the free op's and host's time per op; their
    sources added to ``sources``."""
    sweep, curves, threads = measured.sweep, measured.curves, measured.threads
    peak_tflops, scale = facts.peak_tflops, facts.peak_scale
    main_dtype = "bf16" if "bf16" in sweep.dtypes else sweep.dtypes[0]
    out: dict[str, float] = {}
    for curve_kind in ("gemm", "grouped_gemm", "attention"):
        top = _largest(curves[curve_kind][main_dtype])
        reference = peak_tflops[main_dtype] * 1e12 * scale
        fraction = _rate(top) / reference
        out[curve_kind] = _fraction(fraction)
        others = ", ".join(
            f"{d} {_rate(_largest(curves[curve_kind][d])) / (peak_tflops[d] * 1e12 * scale):.3f}"
            for d in sweep.dtypes
            if d != main_dtype and d in curves[curve_kind]
        )
        capped = " (capped at 1)" if fraction > 1 else ""
        sources[f"efficiency.{curve_kind}"] = (
            f"{stamp}: the {main_dtype} {curve_kind} curve's largest point, shape {top['shape']}, "
            f"{_rate(top) / 1e12:.4f} TFLOP/s against peak_tflops.{main_dtype} x {scale:g} (the cores the "
            f"{threads} thread(s) ran on) = {fraction:.3f}{capped}" + (f"; other dtypes: {others}" if others else "")
        )
    top_mem = _largest(curves["memory"]["fp32"])
    mem_fraction = _rate(top_mem) / (facts.hbm_gbps * 1e9)
    out["memory"] = _fraction(mem_fraction)
    sources["efficiency.memory"] = (
        f"{stamp}: out-of-place torch.mul at the fp32 memory curve's largest point ({top_mem['shape'][0]} fp32 elements "
        f"per operand, {_rate(top_mem) / 1e9:.2f} GB/s, including the first touch of its fresh output) against "
        f"hbm_gbps = {mem_fraction:.3f}" + (" (capped at 1)" if mem_fraction > 1 else "")
    )
    smallest_mem = min(curves["memory"]["fp32"], key=lambda p: p["work"])
    out["launch_overhead_us"] = round_significant(smallest_mem["seconds"] * 1e6)
    sources["efficiency.launch_overhead_us"] = (
        f"{stamp}: the smallest memory op, out-of-place torch.mul of {smallest_mem['shape'][0]} fp32 elements "
        f"per operand ({smallest_mem['work']} bytes moved), median over batches of calls"
    )
    if facts.kind == "cpu":
        if measured.free_op_us is None or measured.host_op_seconds is None:
            raise ValueError("a CPU profile needs the measured free_op_us and host_op_seconds")
        out["free_op_us"] = round_significant(measured.free_op_us)
        sources["efficiency.free_op_us"] = (
            f"{stamp}: x.view(-1) (no kernel) dispatched from Python, median "
            f"over batches of {max(1, sweep.free_op_calls // 10)} calls"
        )
        out["host_op_us"] = round_significant(measured.host_op_seconds * 1e6)
        sources["efficiency.host_op_us"] = (
            f"{stamp}: median wall time of a training step of a tiny model of the engine (d_model 32, 2 MoE "
            f"layers of 8 experts, 32 tokens, one process) divided by the {measured.host_ops} ops it dispatches"
        )
    return out


def curves_source(measured: Measured, stamp: str) -> str:
    """``sources.curves``: how the points were timed."""
    dev, sweep = measured.device, measured.sweep
    text = (
        f"{stamp} on {dev}, {measured.threads} thread(s): medians of time.perf_counter around batches of calls after 2 "
        "warm-up calls (docs/proxies-and-projections.md: what each kind's work and seconds are)"
    )
    if dev.type == "cuda":
        text += (
            f"; fp32 GEMMs with torch.backends.cuda.matmul.allow_tf32 = "
            f"{torch.backends.cuda.matmul.allow_tf32}, as the engine runs them (it leaves torch's "
            "default, off)"
        )
    if math.isfinite(sweep.fp32_max_flops):
        text += (
            f"; fp32 gemm, grouped_gemm and attention points above {sweep.fp32_max_flops:.4g} "
            "FLOPs a call not timed (a larger fp32 op is priced at the throughput of the nearest "
            "measured one)"
        )
    return text


def profile_document(
    measured: Measured,
    facts: DeviceFacts,
    sources: dict[str, str],
    *,
    name: str,
    command: str,
    date: str,
    seconds: float,
) -> dict[str, Any]:
    """The profile as a dict (``bench.predict.device.profile_from_dict`` form); ``sources`` holds the facts'
    sources, the efficiencies' and ``curves``' are added here."""
    stamp = f"measured by moe-bench profile-device on {date}"
    efficiencies = efficiency(measured, facts, stamp, sources)
    sources["curves"] = curves_source(measured, stamp)
    sweep = measured.sweep
    return {
        "schema_version": 1,
        "name": name,
        "description": facts.description,
        "kind": facts.kind,
        "memory_gb": facts.memory_gb,
        "peak_tflops": facts.peak_tflops,
        "hbm_gbps": facts.hbm_gbps,
        "network": facts.network,
        "efficiency": efficiencies,
        "measured": {
            "date": date,
            "command": command,
            "machine": facts.machine,
            "threads": measured.threads,
            "neighbours": measured.neighbours,
            "device": str(measured.device),
            "seconds": round(seconds, 1),
            "method": (
                "median seconds over repeated batches of calls (time.perf_counter, device synchronized "
                "around each batch), after 2 warm-up calls; per-point budget "
                f"{sweep.point_seconds} s, {sweep.min_repeats}-{sweep.max_repeats} repeats; operands cold "
                f"(rotating copies of {sweep.pool_bytes >> 20} MiB); {measured.neighbours} neighbour "
                "process(es) loading the host meanwhile with training steps of the engine's CPU-sized "
                "8-expert model, as the other ranks of a CPU run do"
            ),
        },
        "sources": sources,
        "curves": measured.curves,
    }


class _FlowMap(dict):
    """A curve point, written on one line."""


class _Dumper(yaml.SafeDumper):
    """A SafeDumper of its own, so that the one-line representer below does not change PyYAML's."""


_Dumper.add_representer(
    _FlowMap, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", dict(data), flow_style=True)
)


def write_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """Validate ``profile`` (``profile_from_dict``) and write it as YAML to ``path``; returns the path."""
    path = Path(path)
    profile_from_dict(profile, str(path))
    data = dict(profile)
    if data.get("curves"):
        data["curves"] = {
            kind: {dtype: [_FlowMap(p) for p in points] for dtype, points in by_dtype.items()}
            for kind, by_dtype in data["curves"].items()
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Written by moe-bench profile-device ({profile.get('measured', {}).get('command', '')}).\n"
    path.write_text(header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True))
    return path
