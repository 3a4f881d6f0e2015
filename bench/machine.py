"""What machine a result came from, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from bench.results import REPO_ROOT

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


# Data, not code: recording a release or writing results never makes a checkout "dirty".
DATA_PATHS = ("results", "releases.json")
RELEASE_TAGS = "v[0-9]*"
"""``git describe`` considers tags of this form (``v0.1.0``) as releases."""
BAKED_ENGINE_FILE = Path("bench") / "engine.json"
"""Written by the image build from the checkout it was built from (images carry no ``.git``)."""


def engine_info(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Engine version, commit and dirtiness; the version names the folder under ``results/``.

    In a git checkout (see ``format_version``): ``0.1.0`` at a clean release commit,
    ``0.1.0+3.gabc1234`` three commits after release 0.1.0, ``...dirty`` with uncommitted changes
    to tracked code, ``0.1.0+gabc1234`` before any release (the package version). Outside a
    checkout: what the image build recorded in ``bench/engine.json``, else the package metadata.
    """
    from moe_engine import __version__

    with contextlib.suppress(OSError, subprocess.SubprocessError):  # not a checkout, or no git
        return checkout_info(root, __version__)
    with contextlib.suppress(OSError, ValueError, KeyError):
        baked = json.loads((root / BAKED_ENGINE_FILE).read_text())
        return {key: baked[key] for key in ("version", "git_commit", "git_dirty")}
    return {"version": __version__, "git_commit": None, "git_dirty": None}


def checkout_info(root: Path, package_version: str) -> dict[str, Any]:
    """``engine_info`` of the git checkout at ``root``; raises SubprocessError outside one."""
    if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
        raise subprocess.SubprocessError(f"{root} is inside another repository, not a checkout of its own")
    commit = _git(root, "rev-parse", "HEAD")
    excluded = [f":(exclude){path}" for path in DATA_PATHS]
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded))
    release = nearest_release(root, commit)
    version = format_version(package_version, release, commit, dirty)
    return {"version": version, "git_commit": commit, "git_dirty": dirty}


def format_version(package_version: str, release: tuple[str, int] | None, commit: str, dirty: bool) -> str:
    """A PEP 440 version that sorts between releases and is safe as a folder name.

    ``release`` is (version, commits since it) of the nearest release at or before ``commit``.
    """
    if release is None:
        return f"{package_version}+g{commit[:7]}" + (".dirty" if dirty else "")
    version, distance = release
    if distance == 0 and not dirty:
        return version
    return f"{version}+{distance}.g{commit[:7]}" + (".dirty" if dirty else "")


def nearest_release(root: Path, commit: str) -> tuple[str, int] | None:
    """(version, distance) of the closest release that ``commit`` descends from.

    ``git describe`` over the release tags when they were fetched, else the release record
    (``releases.json``), which does not depend on tags.
    """
    with contextlib.suppress(subprocess.CalledProcessError):
        described = _git(root, "describe", "--tags", "--long", "--match", RELEASE_TAGS, commit)
        match = re.fullmatch(r"v(.+)-(\d+)-g[0-9a-f]+", described)
        if match:
            return match[1], int(match[2])
    from bench.releases import ReleaseError, load_releases

    try:
        releases = load_releases(root / "releases.json")
    except ReleaseError:
        return None
    best = None
    for release in releases:
        with contextlib.suppress(subprocess.CalledProcessError):  # not an ancestor, or not in this clone
            _git(root, "merge-base", "--is-ancestor", release.commit, commit)
            distance = int(_git(root, "rev-list", "--count", f"{release.commit}..{commit}"))
            if best is None or distance < best[1]:
                best = (release.version, distance)
    return best


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()


if __name__ == "__main__":  # the image build bakes the version of the checkout it was built from
    print(json.dumps(engine_info()))
