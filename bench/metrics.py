"""Every metric a result document can hold, described once: its unit, which way is better, what it is
called for people, whether the gate compares it, and how noisy it is.
More: docs/results.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from bench.results import metric


@dataclass(frozen=True)
class MetricSpec:
    """One metric as every reader of result documents understands it."""

    name: str
    """The key in a result document's ``metrics``."""
    unit: str
    """The unit string the document records (``bytes``, ``s``, ``tokens/s``, ``TFLOP/s``, ``ratio``, ...)."""
    better: str | None
    """``"higher"`` or ``"lower"``; None for a figure reported and never gated (a loss, a projection)."""
    title: str
    """What it is, for people (chart titles, the report's tables)."""
    gated: bool = False
    """The gate compares it between versions (``better`` must be set)."""
    kind: str = "other"
    """``throughput``, ``memory``, ``work`` or ``other``: which of the report's groups it belongs to."""
    acceptable_increase: bool = False
    """A regression ``moe-bench ab --accept-increase`` may accept: memory a change costs on purpose."""
    noise_floor: float = 0.0
    """Relative run-to-run noise the gate assumes at least, for a one-sample metric that is not exact."""


def _spec(name: str, unit: str, better: str | None, title: str = "", **fields: Any) -> MetricSpec:
    return MetricSpec(name, unit, better, title or name.replace("_", " "), **fields)


def _memory(name: str, title: str, **fields: Any) -> MetricSpec:
    return _spec(name, "bytes", "lower", title, gated=True, kind="memory", **fields)


PLAN_MEMORY_PARTS = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "comm_buffers",
    "backward_workspace",
    "optimizer_step",
    "total",
)
COMM_PARTS = ("all_to_all", "grad_reduce", "pipeline", "total")
"""The plan's memory pieces per rank and traffic kinds per step, in report order (``memory_<part>_bytes``,
``comm_<part>_bytes``)."""

WORK_METRIC_NAMES = (
    "work_matmul_flops",
    "work_allocated_bytes",
    "work_aten_ops",
    "work_host_syncs",
    "work_collective_calls",
    "work_collective_bytes",
)
"""The gated work counters (``bench.run.work``), in report order; ``work_flops_ratio`` is reported,
never gated (the FLOPs are)."""

_WORK_UNITS = {
    "work_matmul_flops": "FLOP",
    "work_allocated_bytes": "bytes",
    "work_aten_ops": "ops",
    "work_host_syncs": "syncs",
    "work_collective_calls": "calls",
    "work_collective_bytes": "bytes",
}

# Run-to-run noise of the RSS high-water mark: it includes the interpreter, the libraries and the
# allocator's caches. Six runs of identical code of each ci-suite scenario on a 2-core CPU machine
# spanned 1.9-5.4% (the tracked peak_tensor_bytes of the same runs was identical), and A/B runs
# against a release have moved it by -4.6% to +3.1% with no change of the tensors: a large leak
# fails the gate and the allocator's mood does not.
_RSS_NOISE_FLOOR = 0.10

_SPECS = (
    # Execute runs: the measured step.
    _spec("step_time_s", "s", "lower", "step time", gated=True),
    _spec("tokens_per_s_per_gpu", "tokens/s", "higher", "tokens/s per GPU", gated=True, kind="throughput"),
    _spec("tflops_per_gpu", "TFLOP/s", "higher", "TFLOP/s per GPU", gated=True, kind="throughput"),
    _spec("hardware_tflops_per_gpu", "TFLOP/s", None, "hardware TFLOP/s per GPU (with recompute)"),
    _spec("mfu", "ratio", None, "model FLOPs utilisation"),
    _spec("mfu_fp8", "ratio", None, "model FLOPs utilisation against the FP8 peak"),
    _spec("loss", "nats", None),
    _spec("grad_norm", "norm", None, "gradient norm"),
    _spec("tokens_per_expert_min", "tokens", None, "tokens of the least loaded expert"),
    _spec("tokens_per_expert_max", "tokens", None, "tokens of the most loaded expert"),
    _spec("tokens_per_expert_cv", "ratio", None, "coefficient of variation of the experts' tokens"),
    _spec("dropped_tokens", "tokens", "lower", "dropped tokens", gated=True),
    _memory("peak_tensor_bytes", "peak tensor memory", acceptable_increase=True),
    _memory("rss_peak_bytes", "peak resident memory", acceptable_increase=True, noise_floor=_RSS_NOISE_FLOOR),
    _memory("cuda_peak_active_bytes", "peak active memory", acceptable_increase=True),
    _memory("cuda_peak_reserved_bytes", "peak reserved memory", acceptable_increase=True),
    _memory("optimizer_state_bytes", "optimizer state", acceptable_increase=True),
    _spec("checkpoint_save_s", "s", "lower", "checkpoint save time", gated=True),
    _spec("checkpoint_stall_s", "s", "lower", "training stalled by checkpoint saves", gated=True),
    _spec("checkpoint_load_s", "s", "lower", "checkpoint load time", gated=True),
    _spec("checkpoint_bytes_per_rank", "bytes", "lower", "checkpoint bytes per rank", gated=True),
    _spec("checkpoint_bytes_total", "bytes", "lower", "checkpoint bytes", gated=True),
    *(_spec(name, _WORK_UNITS[name], "lower", gated=True, kind="work") for name in WORK_METRIC_NAMES),
    _spec("work_flops_ratio", "ratio", None, "counted matmul FLOPs over the model's formula", kind="work"),
    # Plan runs: the arithmetic of the layout.
    _spec("total_params", "params", None, "parameters"),
    _spec("active_params", "params", None, "active parameters per token"),
    _spec("flops_per_token", "FLOP", None, "model FLOPs per token"),
    _spec("recompute_flops_per_token", "FLOP", None, "recompute FLOPs per token"),
    _spec("hardware_flops_per_token", "FLOP", None, "hardware FLOPs per token (with recompute)"),
    *(
        _memory(f"memory_{part}_bytes", "plan memory per rank" if part == "total" else f"plan {part} memory")
        for part in PLAN_MEMORY_PARTS
    ),
    *(_spec(f"comm_{part}_bytes", "bytes", "lower", f"{part} bytes per step", gated=True) for part in COMM_PARTS),
    _spec("memory_fraction_of_gpu", "ratio", "lower", "plan memory over the GPU's", gated=True, kind="memory"),
    # Proxy runs: one rank measured, the cluster projected.
    _spec("rank_tokens_per_s", "tokens/s", "higher", "tokens/s of the proxied rank", gated=True, kind="throughput"),
    _spec("plan_memory_total_bytes", "bytes", None, "plan memory of the proxied rank at run scale"),
    _spec("plan_memory_gap", "ratio", None, "measured peak over the plan, less one"),
    *(
        spec
        for prefix, scale in (("projected_run", " at run scale"), ("projected", ""))
        for spec in (
            _spec(f"{prefix}_step_time_s", "s", None, f"projected step time{scale}"),
            _spec(
                f"{prefix}_tokens_per_s_per_gpu",
                "tokens/s",
                None,
                f"projected tokens/s per GPU{scale}",
                kind="throughput",
            ),
            _spec(f"{prefix}_tflops_per_gpu", "TFLOP/s", None, f"projected TFLOP/s per GPU{scale}"),
        )
    ),
    _spec("projected_memory_total_bytes", "bytes", None, "projected memory per rank", kind="memory"),
)

METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}
"""Every metric with a fixed name, by name."""

FAMILIES: tuple[tuple[re.Pattern[str], MetricSpec], ...] = (
    (re.compile(r".+_time_s"), _spec("<benchmark>_time_s", "s", "lower", "microbenchmark time")),
    (re.compile(r".+_gflops"), _spec("<benchmark>_gflops", "GFLOP/s", "higher", "microbenchmark GFLOP/s")),
    (
        re.compile(r".+_(?:vs|over)_.+"),
        _spec("<numerator>_vs_<denominator>", "ratio", "higher", "microbenchmark ratio"),
    ),
)
"""Metrics named by a run (``bench/micro``): a pattern and the spec its members share."""

HEADLINE_ORDER = (
    "tokens_per_s_per_gpu",
    "projected_tokens_per_s_per_gpu",
    "rank_tokens_per_s",
    "tflops_per_gpu",
    "step_time_s",
    "cuda_peak_active_bytes",
    "peak_tensor_bytes",
    "memory_total_bytes",
    "rss_peak_bytes",
)
"""The rows a comparison shows first, in this order."""

THROUGHPUT_PREFERENCE = ("tokens_per_s_per_gpu", "projected_tokens_per_s_per_gpu", "rank_tokens_per_s")
"""A run's headline throughput: the first of these it has (measured, projected, the proxied rank's)."""

MEMORY_PREFERENCE = (
    "cuda_peak_active_bytes",
    "peak_tensor_bytes",
    "memory_total_bytes",
    "projected_memory_total_bytes",
)
"""A run's headline memory figure: the first of these it has (measured on a GPU, measured tensors, the
plan, the proxy's projection)."""


class UnknownMetric(KeyError):
    """A metric name the registry does not describe."""

    def __str__(self) -> str:
        return f"unknown metric {self.args[0]!r}: describe it in bench/metrics.py"


def spec_of(name: str) -> MetricSpec:
    """The spec of a metric, by its exact name or else by the family its name belongs to."""
    if name in METRICS:
        return METRICS[name]
    for pattern, family in FAMILIES:
        if pattern.fullmatch(name):
            return replace(family, name=name)
    raise UnknownMetric(name)


def entry(name: str, samples: Iterable[float]) -> dict[str, Any]:
    """The result document's entry for ``name``: its samples with the registry's unit and direction."""
    spec = spec_of(name)
    return metric(samples, spec.unit, spec.better)


def title(name: str) -> str:
    """What a metric is, for people (its own name when the registry does not know it)."""
    try:
        return spec_of(name).title
    except UnknownMetric:
        return name


def names(
    *, gated: bool | None = None, kind: str | None = None, acceptable_increase: bool | None = None
) -> tuple[str, ...]:
    """Fixed metric names with the given properties, in registry order."""
    return tuple(
        spec.name
        for spec in _SPECS
        if (gated is None or spec.gated == gated)
        and (kind is None or spec.kind == kind)
        and (acceptable_increase is None or spec.acceptable_increase == acceptable_increase)
    )


def noise_floor(name: str) -> float:
    """The relative noise the gate assumes at least for ``name`` (0 for an exact or unknown metric)."""
    spec = METRICS.get(name)
    return spec.noise_floor if spec else 0.0


def headline_memory(available: Iterable[str]) -> str | None:
    """The run's headline memory metric among the names it has (``MEMORY_PREFERENCE``)."""
    have = set(available)
    return next((name for name in MEMORY_PREFERENCE if name in have), None)
