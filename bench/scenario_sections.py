"""The benchmark's own sections of a scenario, typed: ``run``, ``cluster`` and ``proxy`` (with ``cpu_scale``).

The engine's configs (model, layout, recompute) live in ``moe_engine.config``; these say how the
benchmark runs a scenario and what it projects it on. ``scenarios/schema.json`` is the one place for
their defaults: ``bench.scenario`` validates a file against it, fills the defaults in, and only then
builds these, so the fields take no defaults here. The exceptions are None, "not given": the
cluster's name and device, and the CPU scale-down, which a GPU host runs without (``CpuScale()``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RunConfig:
    """How many steps a scenario runs, of what size, and for how long at most (``run:``)."""

    warmup_steps: int
    """Untimed steps before the timed ones (they pay compilation and allocator warm-up)."""
    steps: int
    """Timed optimizer steps of each repeat."""
    tokens_per_step: int
    """Global tokens per optimizer step; a multiple of seq_len (4 sequences when the file leaves it out)."""
    repeats: int
    """Times the timed steps are run."""
    timeout_s: float
    """Wall-clock limit of the scenario's worker, seconds."""
    max_grad_norm: float
    """Clip gradients to this global 2-norm before each update; 0 disables clipping."""
    compile: bool
    """Compile each transformer block with torch.compile (regional compilation)."""

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> RunConfig:
        return cls(**section)


@dataclass(frozen=True)
class ClusterConfig:
    """The target cluster a plan or proxy scenario is priced on, or an execute scenario's GPU (``cluster:``)."""

    gpus: int
    """GPUs of the cluster (dp * pp of the layout)."""
    gpus_per_node: int
    """GPUs that share a node's intra-node links."""
    gpu_memory_gib: float
    """Memory of one GPU, GiB (the device profile's when ``device`` is given)."""
    peak_tflops: float
    """Dense BF16 peak per GPU, TFLOP/s (the device profile's when ``device`` is given)."""
    intra_node_gbps: float
    """Per-GPU intra-node bandwidth, GB/s."""
    inter_node_gbps: float
    """Per-GPU inter-node bandwidth, GB/s."""
    latency_us: float
    """Fixed cost of one message or ring step of a collective, microseconds (the projection's alpha)."""
    name: str | None = None
    """The cluster's name, for reports; None when the file gives none."""
    device: str | None = None
    """Device profile (devices/NAME.yaml) that filled memory, peak and network; None when given by hand."""

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> ClusterConfig:
        return cls(**section)

    def to_dict(self) -> dict[str, Any]:
        """The section as a scenario file writes it: the fields that are set (``Network.from_cluster``)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class CpuScale:
    """Scale-down of a proxy run on a CPU host (``proxy.cpu_scale:``); each None keeps the scenario's size,
    so ``CpuScale()`` is the run a GPU host makes."""

    blocks: int | None = None
    """Transformer blocks of the rank's stage to build (None: all)."""
    seq_len: int | None = None
    """Tokens per sequence (None: the model's)."""
    sequences_per_microbatch: int | None = None
    """Sequences per microbatch (None: the scenario's)."""
    microbatches: int | None = None
    """Microbatches per step (None: as a GPU host runs them)."""
    precision: str | None = None
    """Precision of the CPU run, fp32 or None (the scenario's)."""

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> CpuScale:
        return cls(**section)


@dataclass(frozen=True)
class ProxyConfig:
    """Which rank of the layout a proxy scenario replays, and how (``proxy:``)."""

    rank: int
    """Global rank of the layout to replay."""
    microbatches: int | None
    """Microbatches the proxy runs per step (None: those the schedule keeps in flight on the rank, 2 to the scenario's)."""
    threads: int | None
    """CPU threads of the proxy process (None: every core)."""
    cpu_scale: CpuScale
    """Scale-down applied when the proxy runs on a CPU."""

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> ProxyConfig:
        section = dict(section)
        cpu_scale = CpuScale.from_dict(section.pop("cpu_scale"))
        return cls(**section, cpu_scale=cpu_scale)
