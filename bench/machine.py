"""What machine a result came from, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import contextlib
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

# Dense BF16 peak TFLOP/s per device (vendor datasheets, without sparsity). A GPU not listed here
# gets no MFU rather than a guessed one.
GPU_PEAK_TFLOPS_BF16 = {
    "H100": 989.0,
    "H200": 989.0,
    "B200": 2250.0,
    "B300": 2250.0,
    "A100": 312.0,
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


def peak_tflops(device: torch.device) -> float | None:
    """Dense BF16 peak of the device, from the table above; None when unknown (CPUs included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in GPU_PEAK_TFLOPS_BF16.items():
        if key in name:
            return value
    return None
