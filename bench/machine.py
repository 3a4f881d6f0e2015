"""What machine a result came from, the peak FLOP/s that MFU is measured against, and the memory it has free;
what lscpu and /proc say about this CPU (``cpu_spec``: its peak FLOPs/cycle for ``moe-bench profile-device``)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Peaks:
    """The dense peak TFLOP/s a run's MFU is measured against, and where they come from (GPU rows: vendor
    datasheet figures without sparsity)."""

    bf16: float | None = None
    """BF16 peak (what ``mfu`` is measured against); None: no MFU."""
    fp8: float | None = None
    """FP8 peak (what an MXFP8 run's ``mfu_fp8`` is measured against); None: no FP8 MFU."""
    source: str | None = None
    """Where the peaks come from (the result records it as given)."""


# Keyed by the exact product name ``torch.cuda.get_device_name`` reports: variants of one chip differ
# by 20-25% (an H100 PCIe or NVL is not an H100 SXM), so a name is never matched by a substring. A GPU
# not listed gets no MFU (the result says why) rather than a guessed one. NVIDIA's datasheets print
# the tensor-core figures with 2:4 sparsity; the dense figures below are half of those.
GPU_PEAKS: dict[str, Peaks] = {
    # H100 datasheet (nvidia.com/en-us/data-center/h100), SXM column: BF16 1,979*, FP8 3,958* TFLOPS.
    "NVIDIA H100 80GB HBM3": Peaks(989.5, 1979.0, "NVIDIA H100 datasheet, H100 SXM"),
    # Same datasheet, PCIe column of the first edition: BF16 1,513*, FP8 3,026* TFLOPS.
    "NVIDIA H100 PCIe": Peaks(756.5, 1513.0, "NVIDIA H100 datasheet, H100 PCIe"),
    # Same datasheet, H100 NVL column: BF16 1,671*, FP8 3,341* TFLOPS.
    "NVIDIA H100 NVL": Peaks(835.5, 1670.5, "NVIDIA H100 datasheet, H100 NVL"),
    # H200 datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column: BF16 1,979*, FP8 3,958* TFLOPS.
    "NVIDIA H200": Peaks(989.5, 1979.0, "NVIDIA H200 datasheet, H200 SXM"),
    # Same datasheet, H200 NVL column: BF16 1,671*, FP8 3,341* TFLOPS.
    "NVIDIA H200 NVL": Peaks(835.5, 1670.5, "NVIDIA H200 datasheet, H200 NVL"),
    # GH200 Grace Hopper datasheet, the H100 of a GH200 480GB: BF16 1,979*, FP8 3,958* TFLOPS.
    "NVIDIA GH200 480GB": Peaks(989.5, 1979.0, "NVIDIA GH200 datasheet"),
    # HGX B200 datasheet (nvidia.com/en-us/data-center/hgx), 8 GPUs: BF16 36*, FP8 72* PFLOPS.
    "NVIDIA B200": Peaks(2250.0, 4500.0, "NVIDIA HGX B200 datasheet, per GPU"),
    # A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 624* TFLOPS for the 40GB and 80GB
    # parts, PCIe and SXM alike; Ampere has no FP8 tensor cores.
    "NVIDIA A100-SXM4-80GB": Peaks(312.0, None, "NVIDIA A100 datasheet, A100 80GB SXM"),
    "NVIDIA A100-SXM4-40GB": Peaks(312.0, None, "NVIDIA A100 datasheet, A100 40GB SXM"),
    "NVIDIA A100 80GB PCIe": Peaks(312.0, None, "NVIDIA A100 datasheet, A100 80GB PCIe"),
    "NVIDIA A100-PCIE-40GB": Peaks(312.0, None, "NVIDIA A100 datasheet, A100 40GB PCIe"),
}


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what ``platform`` reports)."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(
            ["lscpu"], check=False, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"), timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            out[key.strip()] = value.strip()
    return out


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if ":" in line:
                key, value = line.split(":", 1)
                out.setdefault(key.strip(), value.strip())
    except OSError:
        return {}  # no /proc here: the caller falls back to what platform reports
    return out


@dataclass
class CpuSpec:
    """What lscpu says about this CPU, and the FLOPs/cycle per core its flags imply."""

    model: str
    """The model name (lscpu, else /proc/cpuinfo, else ``platform``)."""
    cores: int
    """Physical cores: lscpu's cores per socket x sockets (else ``os.cpu_count``)."""
    ghz: float
    """The clock the peaks are computed at."""
    ghz_source: str
    """Where ``ghz`` comes from, as a profile's sources say it."""
    flops_per_cycle: dict[str, int]
    """FLOPs per cycle per core by dtype ("fp32", "bf16"), from the widest units the flags show."""
    units: dict[str, str]
    """The units behind each ``flops_per_cycle`` figure, in words."""
    memory_gb: float
    """Physical RAM: /proc/meminfo's MemTotal (else sysconf), in GB."""


def cpu_spec() -> CpuSpec:
    """This CPU's model, physical cores, clock, FLOPs/cycle/core by dtype and RAM (lscpu, /proc, flags)."""
    info, proc = _lscpu(), _cpuinfo()
    model = info.get("Model name") or proc.get("model name") or platform.processor() or platform.machine()
    try:
        cores = int(info["Core(s) per socket"]) * int(info.get("Socket(s)", "1"))
    except (KeyError, ValueError):
        cores = os.cpu_count() or 1
    flags = set((info.get("Flags") or proc.get("flags") or "").split())
    ghz, ghz_source = _clock(info, proc, model)
    fp32, fp32_unit = _fp32_flops_per_cycle(flags)
    if "amx_bf16" in flags:
        bf16, bf16_unit = 1024, "amx_bf16: one AMX TMUL per core, TDPBF16PS 16x16x32 (16384 FLOPs) every 16 cycles"
    elif "avx512_bf16" in flags:
        bf16, bf16_unit = 128, "avx512_bf16: 2 units x VDPBF16PS 16 lanes x 2 pairs x 2 FLOPs"
    else:
        bf16, bf16_unit = fp32, "no bf16 units in the flags: bf16 runs at the fp32 rate"
    return CpuSpec(
        model,
        cores,
        ghz,
        ghz_source,
        {"fp32": fp32, "bf16": bf16},
        {"fp32": fp32_unit, "bf16": bf16_unit},
        _memory_gb(),
    )


def _clock(info: dict[str, str], proc: dict[str, str], model: str) -> tuple[float, str]:
    """GHz and where it comes from: lscpu's max clock, else the model name's, else /proc/cpuinfo's."""
    if info.get("CPU max MHz"):
        return float(info["CPU max MHz"]) / 1000, f"lscpu 'CPU max MHz' {info['CPU max MHz']}"
    if m := re.search(r"@\s*([\d.]+)\s*GHz", model):
        return float(m.group(1)), f"the model name's '@ {m.group(1)}GHz' (lscpu shows no 'CPU max MHz')"
    if proc.get("cpu MHz"):
        return float(proc["cpu MHz"]) / 1000, (
            f"/proc/cpuinfo 'cpu MHz' {proc['cpu MHz']} (lscpu shows no 'CPU max MHz'; likely the nominal/TSC clock)"
        )
    return 1.0, "no clock found (lscpu, /proc/cpuinfo); 1 GHz assumed"


def _fp32_flops_per_cycle(flags: set[str]) -> tuple[int, str]:
    if "avx512f" in flags:
        return 64, "avx512f: 2 FMA units x 16 fp32 lanes x 2 FLOPs"
    if "avx2" in flags and "fma" in flags:
        return 32, "avx2+fma: 2 FMA units x 8 fp32 lanes x 2 FLOPs"
    if "avx" in flags:
        return 16, "avx: 8 fp32 lanes x (1 add + 1 mul)"
    return 8, "sse: 4 fp32 lanes x (1 add + 1 mul)"


def _memory_gb() -> float:
    memory_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gb = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        memory_gb = 0.0  # no /proc/meminfo: sysconf below
    if memory_gb <= 0:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return memory_gb


def machine_info() -> dict[str, Any]:
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_name = torch.cuda.get_device_name(0) if gpu_count else None
    try:  # optional and heavy: triton, only for its version
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {
        "cpu_model": cpu_model(),
        "cpu_cores": cpu_cores(),
        "gpu_name": gpu_name,
        "gpu_count": gpu_count,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    info["name"] = machine_name(info)
    return info


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_name(info: dict[str, Any]) -> str:
    """A stable folder name: ``<n>x<gpu>`` on GPU hosts, ``cpu-<cores>c-<vendor family>`` elsewhere."""
    if info["gpu_count"]:
        return f"{info['gpu_count']}x{_slug(info['gpu_name'])}"
    words = _slug(info["cpu_model"]).split("-")[:3]
    return f"cpu-{info['cpu_cores']}c-{'-'.join(words)}"


def device_peak(device: torch.device) -> tuple[Peaks | None, str]:
    """The datasheet peaks of a CUDA device and where they come from, or None and why there are none."""
    if device.type != "cuda":
        return None, f"no datasheet peak for a {device.type} device"
    name = torch.cuda.get_device_name(device)
    peak = GPU_PEAKS.get(name)
    if peak is None:
        return None, (
            f"no datasheet peak for {name!r} (bench/machine.py lists GPUs by the exact name the driver "
            "reports); MFU is left out rather than guessed"
        )
    return peak, f"{peak.source} (dense, without sparsity), for {name!r}"


def available_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Memory a new process could use on ``device`` now, and what the figure is.

    CPU: ``MemAvailable`` of /proc/meminfo (free memory plus what the kernel can reclaim without
    swapping), shared by every process of the host. CUDA: the device's free memory
    (``torch.cuda.mem_get_info``; asking creates this process's CUDA context on that device).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}, torch.cuda.mem_get_info"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    raise OSError("/proc/meminfo has no MemAvailable line")


# Machine identity -----------------------------------------------------------------------------------
# A folder name (``cpu-2c-intel-r-xeon``) names a kind of machine, not a machine: two virtual machines
# with that name measured the same code 15-20% apart. A result therefore also records what tells two
# machines apart, and results are compared only where these agree.

ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "asimd", "sve")
"""The CPU flags that change which kernels run (and how fast); the others (microcode, mitigations,
what a hypervisor passes through) differ between hosts of one machine kind without changing a timing."""

CALIBRATION_SIZE = 512
"""Side of the calibration's fp32 square matmul: about 0.27 GFLOP a product, 2 ms on two cores,
large enough to use every core of the run, small enough to stay in cache."""
CALIBRATION_KERNEL = f"fp32 {CALIBRATION_SIZE}x{CALIBRATION_SIZE} matmul on every core, median of 9 timed blocks"


def calibrate(blocks: int = 9, products: int = 8) -> dict[str, Any]:
    """The calibration figure: GFLOP/s of a fixed fp32 matmul on every core this process may use.

    The median of ``blocks`` timed blocks of ``products`` products each; the blocks' samples are kept
    so that a reader can see how steady the machine was while it was measured. About 0.2 s on a quiet
    2-core machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_cores())
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(CALIBRATION_SIZE, CALIBRATION_SIZE, generator=generator)
        b = torch.randn(CALIBRATION_SIZE, CALIBRATION_SIZE, generator=generator)
        for _ in range(2):
            a @ b  # the first products fault the pages in and start the thread pool
        samples = []
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(products):
                a @ b
            samples.append(2 * CALIBRATION_SIZE**3 * products / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(threads)
    samples.sort()
    return {"kernel": CALIBRATION_KERNEL, "gflops": samples[len(samples) // 2], "samples": samples}


def _gpu_identity(count: int) -> dict[str, Any] | None:
    """Model, driver, maximum clocks and memory of the GPUs, as nvidia-smi reports them (no CUDA
    context in this process); None without GPUs."""
    if not count:
        return None
    fields = "name,driver_version,clocks.max.sm,clocks.max.memory,memory.total"
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    rows = [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.count(",") == 4]
    if not rows:
        return {"name": torch.cuda.get_device_name(0), "count": count, "source": "torch (no nvidia-smi answer)"}
    name, driver, sm_mhz, mem_mhz, memory_mib = rows[0]
    return {
        "name": name,
        "count": count,
        "driver": driver,
        "max_sm_clock_mhz": _number(sm_mhz),
        "max_memory_clock_mhz": _number(mem_mhz),
        "memory_gib": round(_number(memory_mib) / 1024, 1) if _number(memory_mib) else None,
        "source": "nvidia-smi",
    }


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def machine_identity(info: dict[str, Any], calibration: dict[str, Any] | None) -> dict[str, Any]:
    """What tells this machine apart from another of the same name: CPU model and ISA flags, cores,
    memory, the GPUs, and a measured calibration figure (``calibrate``; None for a plan, which measures nothing)."""
    proc = _cpuinfo()
    flags = set((_lscpu().get("Flags") or proc.get("flags") or proc.get("Features") or "").split())
    return {
        "cpu_model": info["cpu_model"],
        "cpu_cores": info["cpu_cores"],
        "isa_flags": sorted(flags & set(ISA_FLAGS)),
        "memory_gib": round(_memory_gb() * 1e9 / 2**30, 1),
        "gpu": _gpu_identity(info["gpu_count"]),
        "calibration": calibration,
    }
