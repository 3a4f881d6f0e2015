"""Device profiles: what one accelerator (or this CPU) can do, from data files under ``devices/``.

A profile holds the memory capacity, the dense peak rates per dtype, the memory bandwidth, the
network of a typical node and cluster, the declared efficiencies used when nothing was measured,
and a source for every number. ``moe-bench profile-device`` adds measured curves (``curves``):
seconds of GEMMs, grouped GEMMs, memory-bound passes and attention against their size, on the
device it runs on. ``bench.predict.pricing`` prices a traced op on a profile. Standard library and
PyYAML only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEVICES_DIR = Path(__file__).resolve().parents[2] / "devices"
"""Where the profiles named by ``--device NAME`` live."""

RATE_DTYPES = ("fp32", "bf16", "fp8", "mxfp8")
CURVE_KINDS = ("gemm", "grouped_gemm", "memory", "attention", "attention_backward")
_EFFICIENCIES = ("gemm", "grouped_gemm", "attention", "memory")
_NETWORK = ("gpus_per_node", "intra_node_gbps", "inter_node_gbps", "latency_us")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class CurvePoint:
    """One measurement: an op of some work, and the seconds it took."""

    work: float
    """FLOPs (gemm, attention; grouped_gemm: of one group) or bytes moved (memory)."""
    seconds: float
    """Median seconds of one op (grouped_gemm: of the whole op divided by its groups)."""
    shape: tuple[int, ...] = ()
    """What was measured (gemm: M, N, K; grouped_gemm: E, rows per group, N, K; attention: B, H, S, d;
    memory: elements)."""


@dataclass(frozen=True)
class Curve:
    """Measured points of one kind and dtype, sorted by work."""

    kind: str
    dtype: str
    points: tuple[CurvePoint, ...]

    def seconds(self, work: float) -> float:
        """Seconds of an op of ``work``: piecewise linear in log(work) -> log(seconds) between points;
        below the smallest point its seconds (overhead-bound); above the largest, its throughput."""
        first, last = self.points[0], self.points[-1]
        if work <= first.work:
            return first.seconds
        if work >= last.work:
            return last.seconds * work / last.work
        for p0, p1 in zip(self.points, self.points[1:]):
            if p0.work <= work <= p1.work:
                if p1.work == p0.work:
                    return p0.seconds
                f = math.log(work / p0.work) / math.log(p1.work / p0.work)
                return math.exp(math.log(p0.seconds) + f * math.log(p1.seconds / p0.seconds))
        raise AssertionError("unreachable: work lies between the first and last points")

    def seconds_at_shape(self, shape: tuple[int, ...], work: float) -> float:
        """Seconds of an op of ``work`` at the throughput of the measured point nearest ``shape`` (distance
        in log sizes, so 64 x 4096 x 256 is near 64 x 4096 x 512, far from 4096 x 64 x 256); by work
        alone (``seconds``) when no point was measured at a shape of that rank."""
        shaped = [p for p in self.points if len(p.shape) == len(shape) and all(s > 0 for s in p.shape)]
        if not shaped or not all(s > 0 for s in shape):
            return self.seconds(work)
        nearest = min(shaped, key=lambda p: sum(math.log(a / b) ** 2 for a, b in zip(p.shape, shape)))
        # Never below the fastest measured GEMM: the smallest ones are overhead-bound.
        return max(nearest.seconds * work / nearest.work, min(p.seconds for p in shaped))


@dataclass(frozen=True)
class DeviceProfile:
    """One device kind, as ``bench.predict.pricing`` uses it."""

    name: str
    """File stem, e.g. ``b300``."""
    description: str
    """What the device is, in words."""
    kind: str
    """gpu or cpu."""
    memory_gb: float
    """Memory capacity, GB (1e9 bytes)."""
    peak_tflops: dict[str, float]
    """Dense peak per dtype (``RATE_DTYPES``), TFLOP/s."""
    hbm_gbps: float
    """Memory bandwidth, GB/s."""
    network: dict[str, float]
    """gpus_per_node, intra_node_gbps, inter_node_gbps (per GPU, one direction), latency_us."""
    efficiency: dict[str, float]
    """Declared fractions of peak for gemm, grouped_gemm, attention, memory; launch_overhead_us; on a CPU,
    free_op_us (what a view or other kernel-less op costs the host) and host_op_us (the host's time
    around each op of a training step)."""
    sources: dict[str, str]
    """A source for every number, by dotted field name."""
    measured: dict[str, Any] | None
    """How the curves were measured (date, command, machine), or None: never measured."""
    curves: dict[tuple[str, str], Curve] = field(default_factory=dict)
    """Measured curves by (kind, dtype)."""
    file: str = ""
    """The file it was read from."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def curve(self, kind: str, dtype: str) -> Curve | None:
        return self.curves.get((kind, dtype))

    def cluster(self) -> dict[str, Any]:
        """The profile's network as a scenario ``cluster:`` mapping (``Network.from_cluster``)."""
        return dict(self.network)


def _fail(file: str, field_name: str, message: str) -> ProfileError:
    return ProfileError(f"{file}: {field_name}: {message}")


def _positive(data: dict, key: str, file: str, prefix: str = "") -> float:
    name = f"{prefix}{key}"
    if key not in data:
        raise _fail(file, name, "missing")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(file, name, f"must be a number > 0, got {value!r}")
    return float(value)


def _mapping(data: dict, key: str, file: str) -> dict:
    if key not in data:
        raise _fail(file, key, "missing")
    if not isinstance(data[key], dict):
        raise _fail(file, key, f"must be a mapping, got {type(data[key]).__name__}")
    return data[key]


def _curves(raw: Any, file: str) -> dict[tuple[str, str], Curve]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(file, "curves", "must be a mapping of kind -> dtype -> points")
    curves = {}
    for kind, by_dtype in raw.items():
        if kind not in CURVE_KINDS:
            raise _fail(file, f"curves.{kind}", f"unknown kind; expected one of {', '.join(CURVE_KINDS)}")
        for dtype, points in (by_dtype or {}).items():
            name = f"curves.{kind}.{dtype}"
            if not isinstance(points, list) or not points:
                raise _fail(file, name, "must be a non-empty list of points")
            parsed = []
            for i, point in enumerate(points):
                if not isinstance(point, dict):
                    raise _fail(file, f"{name}[{i}]", "must be a mapping")
                work = _positive(point, "work", file, f"{name}[{i}].")
                seconds = _positive(point, "seconds", file, f"{name}[{i}].")
                parsed.append(CurvePoint(work, seconds, tuple(point.get("shape", ()))))
            curves[(kind, dtype)] = Curve(kind, dtype, tuple(sorted(parsed, key=lambda p: p.work)))
    return curves


def profile_from_dict(data: Any, file: str) -> DeviceProfile:
    """Validate and build a profile; every error names ``file`` and the field."""
    if not isinstance(data, dict):
        raise _fail(file, "(top level)", "must be a mapping")
    for key in ("name", "description", "kind"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise _fail(file, key, "missing" if key not in data else "must be a non-empty string")
    if data["kind"] not in ("gpu", "cpu"):
        raise _fail(file, "kind", f"must be gpu or cpu, got {data['kind']!r}")
    memory_gb = _positive(data, "memory_gb", file)
    rates = _mapping(data, "peak_tflops", file)
    peak = {d: _positive(rates, d, file, "peak_tflops.") for d in RATE_DTYPES}
    hbm = _positive(data, "hbm_gbps", file)
    network_raw = _mapping(data, "network", file)
    network = {k: _positive(network_raw, k, file, "network.") for k in _NETWORK if k != "latency_us"}
    if "latency_us" not in network_raw:
        raise _fail(file, "network.latency_us", "missing")
    latency = network_raw["latency_us"]
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
        raise _fail(file, "network.latency_us", f"must be a number >= 0, got {latency!r}")
    network["latency_us"] = float(latency)
    network["gpus_per_node"] = int(network["gpus_per_node"])
    eff_raw = _mapping(data, "efficiency", file)
    efficiency = {}
    for key in _EFFICIENCIES:
        value = _positive(eff_raw, key, file, "efficiency.")
        if value > 1:
            raise _fail(file, f"efficiency.{key}", f"is a fraction of peak, must be <= 1, got {value!r}")
        efficiency[key] = value
    overhead = eff_raw.get("launch_overhead_us")
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or overhead < 0:
        raise _fail(file, "efficiency.launch_overhead_us", f"must be a number >= 0, got {overhead!r}")
    efficiency["launch_overhead_us"] = float(overhead)
    for optional in ("free_op_us", "host_op_us"):
        if optional in eff_raw:
            value = eff_raw[optional]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise _fail(file, f"efficiency.{optional}", f"must be a number >= 0, got {value!r}")
            efficiency[optional] = float(value)
    sources = _mapping(data, "sources", file)
    needed = (
        ["memory_gb", "hbm_gbps"]
        + [f"peak_tflops.{d}" for d in RATE_DTYPES]
        + [f"network.{k}" for k in _NETWORK]
        + [f"efficiency.{k}" for k in (*_EFFICIENCIES, "launch_overhead_us")]
    )
    needed += [f"efficiency.{k}" for k in ("free_op_us", "host_op_us") if k in eff_raw]
    for key in needed:
        if not isinstance(sources.get(key), str) or not sources[key].strip():
            raise _fail(file, f"sources.{key}", "missing: every number needs its source")
    measured = data.get("measured")
    if measured is not None and not isinstance(measured, dict):
        raise _fail(file, "measured", "must be null (never measured) or a mapping (how it was measured)")
    curves = _curves(data.get("curves"), file)
    if curves and measured is None:
        raise _fail(file, "measured", "a profile with curves must say how they were measured")
    return DeviceProfile(
        name=data["name"],
        description=data["description"],
        kind=data["kind"],
        memory_gb=memory_gb,
        peak_tflops=peak,
        hbm_gbps=hbm,
        network=network,
        efficiency=efficiency,
        sources=dict(sources),
        measured=measured,
        curves=curves,
        file=file,
    )


def available_devices() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A profile by name (``devices/<name>.yaml``) or by path."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = DEVICES_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise ProfileError(
                f"--device: unknown device {str(name_or_path)!r}; known: {', '.join(available_devices())} "
                f"(or give a profile file's path)"
            )
    if not path.exists():
        raise ProfileError(f"{path}: no such profile file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ProfileError(f"{path}: not valid YAML: {error}") from None
    return profile_from_dict(data, str(path))
