"""What machine a result came from, the peak FLOP/s that MFU is measured against, and the memory it has free."""

from __future__ import annotations

import contextlib
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak TFLOP/s of one GPU model: vendor datasheet figures without sparsity."""

    bf16: float
    """BF16 tensor-core peak (what ``mfu`` is measured against)."""
    fp8: float | None
    """FP8 tensor-core peak (what an MXFP8 run's ``mfu_fp8`` is measured against); None without FP8."""
    source: str
    """The datasheet the row comes from."""


# Keyed by the exact product name ``torch.cuda.get_device_name`` reports: variants of one chip differ
# by 20-25% (an H100 PCIe or NVL is not an H100 SXM), so a name is never matched by a substring. A GPU
# not listed gets no MFU (the result says why) rather than a guessed one. NVIDIA's datasheets print
# the tensor-core figures with 2:4 sparsity; the dense figures below are half of those.
GPU_PEAKS: dict[str, DevicePeak] = {
    # H100 datasheet (nvidia.com/en-us/data-center/h100), SXM column: BF16 1,979*, FP8 3,958* TFLOPS.
    "NVIDIA H100 80GB HBM3": DevicePeak(989.5, 1979.0, "NVIDIA H100 datasheet, H100 SXM"),
    # Same datasheet, PCIe column of the first edition: BF16 1,513*, FP8 3,026* TFLOPS.
    "NVIDIA H100 PCIe": DevicePeak(756.5, 1513.0, "NVIDIA H100 datasheet, H100 PCIe"),
    # Same datasheet, H100 NVL column: BF16 1,671*, FP8 3,341* TFLOPS.
    "NVIDIA H100 NVL": DevicePeak(835.5, 1670.5, "NVIDIA H100 datasheet, H100 NVL"),
    # H200 datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column: BF16 1,979*, FP8 3,958* TFLOPS.
    "NVIDIA H200": DevicePeak(989.5, 1979.0, "NVIDIA H200 datasheet, H200 SXM"),
    # Same datasheet, H200 NVL column: BF16 1,671*, FP8 3,341* TFLOPS.
    "NVIDIA H200 NVL": DevicePeak(835.5, 1670.5, "NVIDIA H200 datasheet, H200 NVL"),
    # GH200 Grace Hopper datasheet, the H100 of a GH200 480GB: BF16 1,979*, FP8 3,958* TFLOPS.
    "NVIDIA GH200 480GB": DevicePeak(989.5, 1979.0, "NVIDIA GH200 datasheet"),
    # HGX B200 datasheet (nvidia.com/en-us/data-center/hgx), 8 GPUs: BF16 36*, FP8 72* PFLOPS.
    "NVIDIA B200": DevicePeak(2250.0, 4500.0, "NVIDIA HGX B200 datasheet, per GPU"),
    # A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 624* TFLOPS for the 40GB and 80GB
    # parts, PCIe and SXM alike; Ampere has no FP8 tensor cores.
    "NVIDIA A100-SXM4-80GB": DevicePeak(312.0, None, "NVIDIA A100 datasheet, A100 80GB SXM"),
    "NVIDIA A100-SXM4-40GB": DevicePeak(312.0, None, "NVIDIA A100 datasheet, A100 40GB SXM"),
    "NVIDIA A100 80GB PCIe": DevicePeak(312.0, None, "NVIDIA A100 datasheet, A100 80GB PCIe"),
    "NVIDIA A100-PCIE-40GB": DevicePeak(312.0, None, "NVIDIA A100 datasheet, A100 40GB PCIe"),
}


def cpu_model() -> str:
    with contextlib.suppress(OSError):  # no /proc on this platform
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_name = torch.cuda.get_device_name(0) if gpu_count else None
    try:
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


def device_peak(device: torch.device) -> tuple[DevicePeak | None, str]:
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
