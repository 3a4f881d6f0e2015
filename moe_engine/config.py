"""Configuration dataclasses for the model and its MoE layers: the one place for defaults.

Every field carries a one-line docstring. Validation runs in ``__post_init__`` and raises a
``ValueError`` whose message starts with the offending field's path (``moe.top_k: ...``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ScoreFunc(str, Enum):
    """How router logits become expert scores."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class RoutingMode(str, Enum):
    """Which experts a token goes to. Every mode still runs the router's compute."""

    LEARNED = "learned"
    """Top-k of the router scores (what a real model trains with)."""
    RANDOM = "random"
    """k distinct experts drawn uniformly at random per token (seeded, on the device)."""
    BALANCED = "balanced"
    """Exact round-robin: assignment j of token t goes to expert (t*k + j) mod E."""
    SKEWED = "skewed"
    """Expert popularity follows a Zipf law with exponent ``zipf_exponent``."""


class ExpertBackendKind(str, Enum):
    """Implementation of the experts' grouped SwiGLU."""

    LOOP = "loop"
    """Plain per-expert matmuls with ordinary autograd: the reference (syncs with the host)."""
    TORCH = "torch"
    """``torch._grouped_mm`` with device-side offsets (the default)."""
    MXFP8 = "mxfp8"
    """MXFP8 grouped GEMMs (Triton ``tl.dot_scaled`` on GPUs, a torch emulation elsewhere)."""
    FP8 = "fp8"
    """Rowwise-scaled FP8 (e4m3) fprop/dgrad GEMMs: ``scaled_grouped_mm`` on sm90, else emulated
    (``moe_engine.precision.fp8_experts``)."""


class Precision(str, Enum):
    """Numerical precision of parameters and compute."""

    FP32 = "fp32"
    """fp32 parameters and compute."""
    BF16 = "bf16"
    """bf16 parameters and compute, fp32 master weights in the optimizer, fp32 router."""

    @property
    def torch_dtype(self):
        import torch

        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}[self]


class PipelineSchedule(str, Enum):
    """Order of microbatch forwards and backwards across pipeline stages."""

    GPIPE = "gpipe"
    """Every forward, then every backward."""
    ONE_F_ONE_B = "1f1b"
    """One forward, one backward in steady state (fewer microbatches in flight)."""
    INTERLEAVED_1F1B = "interleaved1f1b"
    """1F1B over several stages per rank (smaller bubble)."""
    INTERLEAVED_ZB = "interleaved-zb"
    """Interleaved 1F1B with each backward split into input and weight gradients, the weight
    gradients run in the bubble (``ScheduleInterleavedZeroBubble``)."""
    ZBV = "zbv"
    """Zero bubble over two stages per rank in a V (rank r holds stages r and 2pp-1-r;
    ``ScheduleZBVZeroBubble``)."""
    DUALPIPEV = "dualpipev"
    """DualPipeV: the V placement, and one microbatch's forward run beside another's backward
    (``ScheduleDualPipeV``; see ``ExpertOverlap``)."""

    @property
    def v_shaped(self) -> bool:
        """Two stages per rank in a V: the first pp stages down the ranks, the next pp back up."""
        return self in (PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV)

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs weight gradients apart from input gradients (torch's
        ``stage_backward_weight``, through ``autograd.grad``)."""
        return self in (PipelineSchedule.INTERLEAVED_ZB, PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV)

    @property
    def pairs_microbatches(self) -> bool:
        """Whether the microbatches overlap pairs this schedule's plan, under pp > 1
        (``moe_engine.parallel.paired_plan``)."""
        return self in (PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.DUALPIPEV)

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule runs several stages per rank (``virtual_stages``)."""
        return self.v_shaped or self in (PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.INTERLEAVED_ZB)


class ExpertOverlap(str, Enum):
    """What hides the expert all-to-alls (ep > 1)."""

    NONE = "none"
    """Every all-to-all exposed: each waits before anything else runs (the reference)."""
    CHUNKS = "chunks"
    """Only the layer's own chunked dispatch (``a2a_chunks``): chunk k+1 moves while chunk k computes."""
    MICROBATCHES = "microbatches"
    """One microbatch's all-to-alls in flight while another microbatch computes: the pipeline plan's
    neighbours paired (pp > 1, interleaved1f1b or dualpipev; ``moe_engine.parallel.paired_plan``), or the
    overlapped data-parallel step (pp = 1, two or more microbatches)."""
    AUTO = "auto"
    """Chosen by the layout (``ParallelConfig.resolved_overlap``)."""


class DataParallelMode(str, Enum):
    """How parameters are replicated across data-parallel ranks."""

    DDP = "ddp"
    """Replicated dense parameters, resident experts, gradients all-reduced (the new design)."""
    FSDP = "fsdp"
    """Every parameter sharded and gathered per block with FSDP2 (the old design, for comparison)."""


class OptimizerSharding(str, Enum):
    """Whether optimizer state is sharded across data-parallel ranks."""

    NONE = "none"
    """Every rank holds the full optimizer state of its parameters."""
    ZERO1 = "zero1"
    """Master weights and Adam moments sharded; gradients reduce-scattered, parameters all-gathered."""


class DispatchKind(str, Enum):
    """How expert-parallel dispatch sizes its all-to-all."""

    SYNC = "sync"
    """Split sizes brought to the host, uneven all-to-all (dropless)."""
    NO_SYNC = "no-sync"
    """Fixed-capacity buffers per destination rank, no host synchronisation, tail drop over capacity."""


class DispatchRows(str, Enum):
    """What one expert-parallel all-to-all row carries."""

    PER_EXPERT = "per-expert"
    """One row per (token, expert), outputs back one row per expert (the reference)."""
    PER_RANK = "per-rank"
    """One row per (token, destination rank); the destination sums its experts' weighted outputs into one row back."""
    PER_NODE = "per-node"
    """One inter-node row per (token, destination node), to the rank with the same local index there,
    spread inside the node per rank; combine reduces inside the node first (needs ranks_per_node < ep)."""
    AUTO = "auto"
    """per-node when the expert-parallel group spans nodes (ranks_per_node < ep), else per-rank."""


class GradDtype(str, Enum):
    """Precision gradients are accumulated over microbatches and reduced over data-parallel ranks in."""

    FP32 = "fp32"
    """fp32 gradient buffers whatever the parameters' dtype (each microbatch's gradient is added in)."""
    PARAM = "param"
    """The parameters' dtype: bf16 runs accumulate and reduce bf16 gradients (half the bytes)."""


class RecomputeMode(str, Enum):
    """Which activations backward recomputes instead of keeping them from forward."""

    NONE = "none"
    """Keep every activation."""
    FULL = "full"
    """Keep only each chosen block's input; its whole forward (expert-parallel all-to-alls included)
    runs again in backward."""
    SELECTIVE = "selective"
    """Recompute only the named parts of each chosen block (``RecomputeConfig.parts``)."""


class RecomputePart(str, Enum):
    """A part of a block that selective recompute can recompute. None of them contains a collective, so
    no selective mode runs an expert-parallel all-to-all again."""

    ATTENTION = "attention"
    """Q/K/V projections, RoPE, SDPA and the output projection (keeps the attention's input only)."""
    EXPERTS = "experts"
    """The routed experts' SwiGLU on the tokens already dispatched to them (keeps their input rows)."""
    NORMS = "norms"
    """The block's two RMSNorms (keeps their inputs)."""


def _require(ok: bool, path: str, reason: str) -> None:
    if not ok:
        raise ValueError(f"{path}: {reason}")


@dataclass
class MoEConfig:
    """The mixture-of-experts feed-forward layer."""

    num_experts: int = 8
    """Number of routed experts E."""
    top_k: int = 2
    """Experts each token is routed to (k)."""
    expert_hidden: int = 512
    """Hidden size F of each routed expert's SwiGLU."""
    shared_expert_hidden: int = 0
    """Hidden size of the always-on shared expert; 0 means no shared expert."""
    score_func: ScoreFunc = ScoreFunc.SOFTMAX
    """Router score function."""
    normalize_top_k: bool = False
    """Renormalise the k selected weights of a token to sum to one."""
    routing: RoutingMode = RoutingMode.LEARNED
    """How experts are selected (benchmarks use random, balanced or skewed)."""
    zipf_exponent: float = 1.0
    """Exponent s of the Zipf popularity p_e ~ 1/(e+1)^s in skewed routing."""
    routing_seed: int = 0
    """Seed of the random and skewed routing generators (offset per layer)."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss E * sum_e f_e * P_e."""
    z_loss_weight: float = 0.001
    """Weight of the router z-loss mean_t logsumexp(logits_t)^2."""
    expert_bias_rate: float = 0.0
    """Update rate of the aux-loss-free expert bias (selection only); 0 disables it."""
    n_groups: int = 1
    """Groups the experts are split into for group-limited routing (contiguous blocks of E / n_groups)."""
    top_groups: int | None = None
    """Groups a token's experts may come from under learned routing (None: every group, no limit)."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' combine weights, after any top-k renormalisation (DeepSeek-V3: 2.5)."""
    backend: ExpertBackendKind = ExpertBackendKind.TORCH
    """Grouped-GEMM implementation of the experts."""
    mxfp8_wgrad: bool = True
    """With backend mxfp8: the weight-gradient GEMMs in MXFP8 too (blocks of 32 tokens per expert); False: bf16."""

    def __post_init__(self) -> None:
        _coerce_enums(self, "moe.")
        self.validate("moe")

    def validate(self, prefix: str = "moe") -> None:
        _require(self.num_experts >= 1, f"{prefix}.num_experts", f"must be >= 1, got {self.num_experts}")
        _require(self.top_k >= 1, f"{prefix}.top_k", f"must be >= 1, got {self.top_k}")
        _require(
            self.top_k <= self.num_experts,
            f"{prefix}.top_k",
            f"{self.top_k} exceeds {prefix}.num_experts={self.num_experts}",
        )
        _require(self.expert_hidden >= 1, f"{prefix}.expert_hidden", f"must be >= 1, got {self.expert_hidden}")
        _require(
            self.shared_expert_hidden >= 0,
            f"{prefix}.shared_expert_hidden",
            f"must be >= 0, got {self.shared_expert_hidden}",
        )
        _require(self.zipf_exponent >= 0, f"{prefix}.zipf_exponent", f"must be >= 0, got {self.zipf_exponent}")
        for name in ("aux_loss_weight", "z_loss_weight", "expert_bias_rate"):
            value = getattr(self, name)
            _require(value >= 0, f"{prefix}.{name}", f"must be >= 0, got {value}")
        _require(
            self.routed_scaling_factor > 0,
            f"{prefix}.routed_scaling_factor",
            f"must be > 0, got {self.routed_scaling_factor}",
        )
        _require(self.n_groups >= 1, f"{prefix}.n_groups", f"must be >= 1, got {self.n_groups}")
        _require(
            self.num_experts % self.n_groups == 0,
            f"{prefix}.n_groups",
            f"{self.n_groups} groups do not divide {prefix}.num_experts={self.num_experts}",
        )
        if self.top_groups is not None:
            _require(
                1 <= self.top_groups <= self.n_groups,
                f"{prefix}.top_groups",
                f"must be between 1 and {prefix}.n_groups={self.n_groups}, got {self.top_groups}",
            )
        reachable = self.groups_per_token * (self.num_experts // self.n_groups)
        _require(
            self.top_k <= reachable,
            f"{prefix}.top_k",
            f"{self.top_k} exceeds the {reachable} experts of the {self.groups_per_token} chosen groups "
            f"({prefix}.top_groups of {prefix}.n_groups={self.n_groups})",
        )

    @property
    def groups_per_token(self) -> int:
        """Groups learned routing picks a token's experts from (every group without a limit)."""
        return self.n_groups if self.top_groups is None else self.top_groups

    @property
    def group_limited(self) -> bool:
        """Whether learned routing first chooses groups (fewer chosen than there are)."""
        return self.groups_per_token < self.n_groups


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries, keys and values up-projected from low-rank
    latents, with a RoPE key of its own shared by every head."""

    kv_lora_rank: int = 64
    """Width of the key-value latent (what an inference cache would hold per token, with the RoPE key)."""
    q_lora_rank: int | None = None
    """Width of the query latent; None projects queries straight from the model width (DeepSeek-V2-Lite)."""
    qk_nope_head_dim: int = 32
    """Per-head query/key dimensions without RoPE (up-projected from the key-value latent)."""
    qk_rope_head_dim: int = 16
    """Per-head query/key dimensions with RoPE; the key's are one vector shared by every head (even)."""
    v_head_dim: int = 32
    """Per-head value dimension (the output projection reads n_heads * v_head_dim)."""

    def __post_init__(self) -> None:
        self.validate("mla")

    @property
    def qk_head_dim(self) -> int:
        """Query/key dimension of a head: the no-RoPE and RoPE parts together."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, prefix: str = "mla") -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            _require(value >= 1, f"{prefix}.{name}", f"must be >= 1, got {value}")
        _require(
            self.q_lora_rank is None or self.q_lora_rank >= 1,
            f"{prefix}.q_lora_rank",
            f"must be >= 1 (or null: no query latent), got {self.q_lora_rank}",
        )
        _require(
            self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
            f"{prefix}.qk_rope_head_dim",
            f"must be even and >= 2 for RoPE (it rotates pairs of dimensions), got {self.qk_rope_head_dim}",
        )


@dataclass
class ModelConfig:
    """A decoder-only transformer with MoE (or leading dense) feed-forward layers."""

    vocab_size: int = 1024
    """Vocabulary size V."""
    d_model: int = 256
    """Model (residual stream) width D."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention query heads."""
    n_kv_heads: int = 4
    """Attention key/value heads (grouped-query attention when fewer than n_heads)."""
    seq_len: int = 128
    """Maximum sequence length (RoPE tables are built for it)."""
    head_dim: int | None = None
    """Query/key/value width of each attention head; None: d_model / n_heads (unused, and must stay None, with mla)."""
    n_dense_layers: int = 0
    """Leading blocks whose feed-forward is a dense SwiGLU instead of an MoE layer."""
    moe_every: int = 1
    """After the leading dense blocks, every moe_every-th block is an MoE block, the others dense (1: all MoE)."""
    dense_hidden: int = 0
    """Hidden size of the dense SwiGLU of every dense block (required when there are any)."""
    tie_embeddings: bool = False
    """The LM head multiplies by the input embedding's weight (one V x D matrix) instead of its own."""
    mla: MLAConfig | None = None
    """Multi-head latent attention in every block instead of grouped-query attention (None: GQA)."""
    qk_norm: bool = False
    """RMSNorm over the full query and key projections before RoPE (as OLMoE does)."""
    qk_norm_per_head: bool = False
    """With qk_norm: normalise each head's query and key instead (one weight of head_dim each, as Qwen3 does)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""
    dtype: Precision = Precision.BF16
    """Parameter and compute precision (the router always computes in fp32)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """The MoE feed-forward layers."""
    fused_kernels: bool = True
    """Fused ops (moe_engine.kernels) for RMSNorm and the residual add, SwiGLU, RoPE, the LM head's loss
    (Triton on CUDA, the eager composition elsewhere); False: the reference path the tests compare against."""

    def __post_init__(self) -> None:
        _coerce_enums(self, "")
        if isinstance(self.moe, Mapping):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, Mapping):
            self.mla = MLAConfig(**self.mla)
        if self.head_dim is None and self.mla is None and self.n_heads >= 1:
            # Resolved here, so that every reader sees the width the model is built with (and a
            # ``dataclasses.replace`` of d_model or n_heads keeps it: pass head_dim=None as well).
            _require(
                self.d_model % self.n_heads == 0,
                "d_model",
                f"{self.d_model} is not divisible by n_heads={self.n_heads} (or set head_dim)",
            )
            self.head_dim = self.d_model // self.n_heads
        self.validate()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` has an MoE feed-forward (else a dense SwiGLU of dense_hidden)."""
        after_dense = layer_idx - self.n_dense_layers
        return after_dense >= 0 and (after_dense + 1) % self.moe_every == 0

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def n_dense_ffn_layers(self) -> int:
        """Blocks with a dense SwiGLU: the leading ones and the dense blocks between MoE blocks."""
        return self.n_layers - self.n_moe_layers

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len", "moe_every"):
            value = getattr(self, name)
            _require(value >= 1, name, f"must be >= 1, got {value}")
        if self.mla is None:
            # __post_init__ resolved it (n_heads >= 1 was checked just above).
            assert self.head_dim is not None
            _require(self.head_dim >= 2, "head_dim", f"must be >= 2, got {self.head_dim}")
            _require(self.head_dim % 2 == 0, "head_dim", f"{self.head_dim} must be even for RoPE")
            _require(
                self.n_heads % self.n_kv_heads == 0,
                "n_kv_heads",
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}",
            )
        else:
            self.mla.validate("mla")
            _require(
                self.head_dim is None,
                "head_dim",
                f"multi-head latent attention sets its own head widths (mla.*_head_dim); leave it unset, got {self.head_dim}",
            )
            _require(
                self.n_kv_heads == self.n_heads,
                "n_kv_heads",
                f"multi-head latent attention up-projects keys and values for every head: needs n_kv_heads = "
                f"n_heads={self.n_heads}, got {self.n_kv_heads}",
            )
            _require(not self.qk_norm, "qk_norm", "multi-head latent attention normalises its latents (mla) instead")
        _require(not self.qk_norm_per_head or self.qk_norm, "qk_norm_per_head", "needs qk_norm: true")
        _require(
            0 <= self.n_dense_layers <= self.n_layers,
            "n_dense_layers",
            f"must be between 0 and n_layers={self.n_layers}, got {self.n_dense_layers}",
        )
        after_dense = self.n_layers - self.n_dense_layers
        _require(
            self.moe_every == 1 or self.moe_every <= after_dense,
            "moe_every",
            f"{self.moe_every} exceeds the {after_dense} blocks after the n_dense_layers={self.n_dense_layers} "
            "leading dense ones (no block would be MoE)",
        )
        dense = self.n_dense_ffn_layers
        _require(
            dense == 0 or self.dense_hidden >= 1,
            "dense_hidden",
            f"must be >= 1 when the model has dense blocks (n_dense_layers={self.n_dense_layers}, "
            f"moe_every={self.moe_every}: {dense}), got {self.dense_hidden}",
        )
        _require(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        self.moe.validate("moe")

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from plain data (a scenario file); unknown keys are an error, not ignored."""
        data = dict(data)
        moe = data.pop("moe", {})
        mla = data.pop("mla", None)
        _reject_unknown(cls, data, "")
        _reject_unknown(MoEConfig, moe, "moe.")
        if mla is not None:
            _reject_unknown(MLAConfig, mla, "mla.")
            mla = MLAConfig(**mla)
        return cls(**data, moe=MoEConfig(**moe), mla=mla)


@dataclass
class RecomputeConfig:
    """Activation recompute: which blocks, and what of them, backward recomputes."""

    mode: RecomputeMode = RecomputeMode.NONE
    """none, full (whole blocks) or selective (the named parts)."""
    parts: list[RecomputePart] = field(default_factory=list)
    """Parts a selective mode recomputes (at least one); must be empty for the other modes."""
    every: int = 1
    """Recompute blocks whose index is a multiple of this (1: every block)."""
    first_per_stage: int = 0
    """If > 0: recompute only the first n blocks of each pipeline stage (``every`` must then be 1)."""

    def __post_init__(self) -> None:
        _coerce_enums(self, "recompute.")
        choices = ", ".join(e.value for e in RecomputePart)
        for part in self.parts:
            _require(part in {e.value for e in RecomputePart}, "recompute.parts", f"{part!r} is not one of {choices}")
        self.parts = [RecomputePart(p) for p in self.parts]
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.mode is not RecomputeMode.NONE

    def validate(self, n_layers: int | None = None, smallest_stage: int | None = None) -> None:
        """Checks of the config alone, and (given the model's and the layout's sizes) of the block subset."""
        if self.mode is RecomputeMode.SELECTIVE:
            _require(bool(self.parts), "recompute.parts", "selective recompute needs at least one part")
            _require(len(set(self.parts)) == len(self.parts), "recompute.parts", "a part is named twice")
        else:
            _require(
                not self.parts, "recompute.parts", f"only selective recompute takes parts, not mode {self.mode.value}"
            )
        _require(self.every >= 1, "recompute.every", f"must be >= 1, got {self.every}")
        _require(self.first_per_stage >= 0, "recompute.first_per_stage", f"must be >= 0, got {self.first_per_stage}")
        _require(
            self.first_per_stage == 0 or self.every == 1,
            "recompute.first_per_stage",
            f"choose one block subset: every={self.every} or first_per_stage={self.first_per_stage}",
        )
        if n_layers is not None:
            _require(self.every <= n_layers, "recompute.every", f"{self.every} exceeds model.n_layers={n_layers}")
        if smallest_stage is not None:
            _require(
                self.first_per_stage <= smallest_stage,
                "recompute.first_per_stage",
                f"{self.first_per_stage} exceeds the {smallest_stage} blocks of the smallest pipeline stage",
            )

    def blocks(self, stages: list[range]) -> list[int]:
        """The recomputed block indices, given every pipeline stage's blocks."""
        if not self.enabled:
            return []
        if self.first_per_stage:
            return [i for stage in stages for i in list(stage)[: self.first_per_stage]]
        return [i for stage in stages for i in stage if i % self.every == 0]

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecomputeConfig:
        _reject_unknown(cls, data, "recompute.")
        return cls(**data)


@dataclass
class ParallelConfig:
    """The parallel layout: world = dp * pp, expert parallelism of degree ep inside dp."""

    dp: int = 1
    """Data-parallel degree (ranks per pipeline stage)."""
    ep: int = 1
    """Expert-parallel degree inside each data-parallel group; divides dp and the expert count."""
    pp: int = 1
    """Pipeline-parallel degree."""
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule (used when pp > 1)."""
    microbatches: int | None = None
    """Microbatches per optimizer step on each data-parallel rank. None (the default) means pp, one per
    pipeline stage (1 without pipelining): the fewest 1f1b runs, and a count every schedule runs
    (``validate_executable`` lists what each schedule needs)."""
    virtual_stages: int = 1
    """Pipeline stages per rank: any for interleaved1f1b and interleaved-zb, exactly 2 (a V) for zbv and dualpipev."""
    dp_mode: DataParallelMode = DataParallelMode.DDP
    """Replicated parameters with gradient all-reduce, or FSDP2 sharding."""
    optimizer_sharding: OptimizerSharding = OptimizerSharding.NONE
    """ZeRO-1 sharding of master weights and optimizer state (DDP mode only)."""
    dispatch: DispatchKind = DispatchKind.NO_SYNC
    """Expert-parallel all-to-all variant (used when ep > 1)."""
    capacity_factor: float = 1.25
    """No-sync buffer size per destination rank, as a multiple of the balanced load."""
    bucket_elements: int = 2**22
    """Gradient elements per all-reduce bucket (buckets launch as soon as they fill in backward)."""
    grad_dtype: GradDtype = GradDtype.FP32
    """Precision of gradient accumulation and reduction (fp32 by default, also for bf16 parameters)."""
    accumulate_in_gemm: bool = True
    """The experts' and dense projections' weight-gradient GEMMs add into the ddp gradient buffer themselves (no extra pass)."""
    a2a_chunks: int = 1
    """Chunks of each MoE layer's expert all-to-alls (ep > 1): chunk k+1 moves while chunk k's experts compute."""
    overlap: ExpertOverlap = ExpertOverlap.AUTO
    """What hides the expert all-to-alls: none, the layer's chunks, or another microbatch's compute."""
    dispatch_rows: DispatchRows = DispatchRows.AUTO
    """What an expert all-to-all row carries: a (token, expert), a (token, rank) or a (token, node) pair."""
    ranks_per_node: int | None = None
    """Consecutive global ranks per node (divides ep where smaller); None: every rank on one node."""

    def __post_init__(self) -> None:
        _coerce_enums(self, "parallel.")
        if self.microbatches is None:
            self.microbatches = self.pp
        self.validate()

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert."""
        return self.dp // self.ep

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def validate(self, model: ModelConfig | None = None) -> None:
        for name in ("dp", "ep", "pp", "microbatches", "virtual_stages", "bucket_elements"):
            value = getattr(self, name)
            _require(value >= 1, f"parallel.{name}", f"must be >= 1, got {value}")
        _require(self.capacity_factor > 0, "parallel.capacity_factor", f"must be > 0, got {self.capacity_factor}")
        _require(self.dp % self.ep == 0, "parallel.ep", f"ep={self.ep} does not divide dp={self.dp}")
        _require(
            self.virtual_stages == 1 or self.schedule.multi_stage,
            "parallel.virtual_stages",
            "more than one stage per rank needs schedule interleaved1f1b, interleaved-zb, zbv or dualpipev",
        )
        _require(
            self.pp == 1 or not self.schedule.v_shaped or self.virtual_stages == 2,
            "parallel.virtual_stages",
            f"schedule {self.schedule.value} runs exactly two stages per rank (a V); got {self.virtual_stages}",
        )
        _require(
            self.overlap is not ExpertOverlap.MICROBATCHES
            or (self.pp == 1 and (self.microbatches or 1) >= 2)
            or (self.pp > 1 and self.schedule.pairs_microbatches),
            "parallel.overlap",
            "microbatches overlap needs two or more microbatches (pp = 1) or schedule interleaved1f1b or dualpipev "
            "(pp > 1); got "
            f"pp={self.pp}, microbatches={self.microbatches}, schedule={self.schedule.value}",
        )
        _require(
            self.overlap is not ExpertOverlap.MICROBATCHES or self.dp_mode is DataParallelMode.DDP,
            "parallel.overlap",
            "microbatches overlap runs with dp_mode ddp (fsdp's per-block gathers are not interleaved)",
        )
        if self.ranks_per_node is not None:
            _require(self.ranks_per_node >= 1, "parallel.ranks_per_node", f"must be >= 1, got {self.ranks_per_node}")
            _require(
                self.ranks_per_node >= self.ep or self.ep % self.ranks_per_node == 0,
                "parallel.ranks_per_node",
                f"ranks_per_node={self.ranks_per_node} does not divide ep={self.ep}",
            )
        _require(
            self.dispatch_rows is not DispatchRows.PER_NODE or self.ep == 1 or self.spans_nodes,
            "parallel.dispatch_rows",
            f"per-node needs an expert-parallel group that spans nodes (ranks_per_node < ep={self.ep}); "
            f"got ranks_per_node={self.ranks_per_node}",
        )
        if self.dp_mode is DataParallelMode.FSDP:
            _require(
                self.optimizer_sharding is OptimizerSharding.NONE,
                "parallel.optimizer_sharding",
                "fsdp already shards the optimizer state; use none",
            )
        if model is None:
            return
        experts = model.moe.num_experts
        _require(experts % self.ep == 0, "parallel.ep", f"ep={self.ep} does not divide model.moe.num_experts={experts}")
        _require(
            self.num_stages <= model.n_layers,
            "parallel.pp",
            f"pp * virtual_stages = {self.num_stages} exceeds model.n_layers={model.n_layers}",
        )
        # The embedding sits on the first pipeline rank and the LM head on the last: one shared weight
        # would need its gradients summed across them, which the pipeline does not do.
        _require(
            not model.tie_embeddings or self.pp == 1,
            "model.tie_embeddings",
            f"tied embeddings need the embedding and the LM head on one pipeline rank; pp={self.pp} puts them on "
            f"ranks 0 and {self.pp - 1} (untie them or use pp=1)",
        )

    @property
    def spans_nodes(self) -> bool:
        """Whether an expert-parallel group spans nodes (ranks_per_node < ep)."""
        return self.ranks_per_node is not None and self.ranks_per_node < self.ep

    @property
    def resolved_dispatch_rows(self) -> DispatchRows:
        """The rows that travel (never AUTO): per-node where the expert-parallel group spans nodes, else per-rank."""
        if self.dispatch_rows is not DispatchRows.AUTO:
            return self.dispatch_rows
        return DispatchRows.PER_NODE if self.spans_nodes else DispatchRows.PER_RANK

    @property
    def resolved_overlap(self) -> ExpertOverlap:
        """The overlap that runs (never AUTO). AUTO: none without expert parallelism; else microbatches
        where the layout has two microbatches to pair (pp = 1 with two or more microbatches, or pp > 1
        under interleaved1f1b or dualpipev); else chunks where a2a_chunks > 1; else none."""
        if self.overlap is not ExpertOverlap.AUTO:
            return self.overlap
        if self.ep == 1:
            return ExpertOverlap.NONE
        assert self.microbatches is not None  # __post_init__ resolves None to pp
        if (self.pp == 1 and self.microbatches >= 2) or (self.pp > 1 and self.schedule.pairs_microbatches):
            return ExpertOverlap.MICROBATCHES
        return ExpertOverlap.CHUNKS if self.a2a_chunks > 1 else ExpertOverlap.NONE

    def validate_batch(self, sequences: int, field: str = "sequences") -> None:
        """A step of ``sequences`` sequences splits over dp, and each rank's share into equal microbatches
        (the mean of the microbatch losses is the batch mean only when they are equal). ``field`` names
        the batch size in the message."""
        _require(sequences % self.dp == 0, field, f"{sequences} sequences do not split over dp={self.dp}")
        per_rank = sequences // self.dp
        assert self.microbatches is not None  # __post_init__ resolves None to pp
        _require(
            per_rank % self.microbatches == 0,
            "parallel.microbatches",
            f"{per_rank} sequences per rank do not split into {self.microbatches} microbatches",
        )

    def validate_executable(self) -> None:
        """Layouts the plan can price but the engine does not run.

        With pp > 1 the engine runs torch.distributed.pipelining's schedules, whose constructors
        (torch 2.13) refuse: for 1f1b, fewer microbatches m than stages (``Schedule1F1B``: m >= pp);
        for interleaved1f1b and interleaved-zb, a count that does not split into its rounds of pp
        microbatches (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``: m % max(1, m // pp)
        == 0, so any m <= pp and e.g. 2pp, 3pp); for dualpipev fewer than 2pp (``ScheduleDualPipeV``); for
        zbv fewer than 2pp - 1 (``ScheduleZBVZeroBubble`` plans that many at least). gpipe takes any m. A proxy rank replays its stage without these schedules, and the plan's
        arithmetic covers any m, so ``validate`` does not refuse them.
        """
        _require(
            self.dp_mode is not DataParallelMode.FSDP or self.ep == 1,
            "parallel.dp_mode",
            f"the engine's fsdp mode shards experts over dp (no expert parallelism); needs ep=1, got {self.ep}",
        )
        if self.pp == 1:
            return
        m, pp = self.microbatches, self.pp
        assert m is not None  # __post_init__ resolves None to pp
        if self.schedule is PipelineSchedule.ONE_F_ONE_B:
            _require(
                m >= pp,
                "parallel.microbatches",
                f"schedule 1f1b needs at least one microbatch per stage, pp={pp}; got {m}",
            )
        elif self.schedule.v_shaped:
            # ScheduleDualPipeV refuses m < 2pp; ScheduleZBVZeroBubble plans 2pp - 1 microbatches at least.
            least = 2 * pp if self.schedule is PipelineSchedule.DUALPIPEV else 2 * pp - 1
            _require(
                m >= least,
                "parallel.microbatches",
                f"schedule {self.schedule.value} needs at least {least} microbatches with pp={pp}; got {m}",
            )
        elif self.schedule.multi_stage and m % _interleaved_rounds(m, pp):
            # m > pp here (up to pp microbatches make one round); every multiple of pp splits evenly.
            lower = next(n for n in range(m - 1, 0, -1) if n % _interleaved_rounds(n, pp) == 0)
            upper = next(n for n in range(m + 1, m + pp + 1) if n % _interleaved_rounds(n, pp) == 0)
            raise ValueError(
                f"parallel.microbatches: schedule {self.schedule.value} runs microbatches in rounds of about pp={pp}: "
                f"{m} microbatches make {_interleaved_rounds(m, pp)} rounds and do not split into them "
                f"(the nearest counts that do: {lower}, {upper})"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelConfig:
        """Build from plain data; ``world_size`` is accepted as a cross-check of dp * pp."""
        data = dict(data)
        world = data.pop("world_size", None)
        _reject_unknown(cls, data, "parallel.")
        config = cls(**data)
        _require(
            world is None or world == config.world_size,
            "parallel.world_size",
            f"{world} != dp * pp = {config.world_size}",
        )
        return config

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms or vectors)."""
    max_grad_norm: float = 1.0
    """Clip gradients to this global 2-norm before the update (the reference release's 1.0); 0 disables it."""

    def __post_init__(self) -> None:
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 disables clipping), got {self.max_grad_norm}")


def _interleaved_rounds(microbatches: int, pp: int) -> int:
    """Rounds ``ScheduleInterleaved1F1B`` splits the microbatches into (torch 2.13)."""
    return max(1, microbatches // pp)


def _reject_unknown(cls, data: Mapping[str, Any], prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ValueError(f"{prefix}{key}: unknown field (known: {', '.join(sorted(known - {'moe', 'mla'}))})")


def _coerce_enums(obj, prefix: str) -> None:
    """Accept the enum's string value wherever an enum field is expected."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        enum_type = _ENUM_FIELDS.get(f.name)
        if enum_type is not None and not isinstance(value, enum_type):
            try:
                setattr(obj, f.name, enum_type(value))
            except ValueError:
                choices = ", ".join(e.value for e in enum_type)
                raise ValueError(f"{prefix}{f.name}: {value!r} is not one of {choices}") from None


_ENUM_FIELDS: dict[str, type[Enum]] = {
    "score_func": ScoreFunc,
    "routing": RoutingMode,
    "backend": ExpertBackendKind,
    "dtype": Precision,
    "schedule": PipelineSchedule,
    "overlap": ExpertOverlap,
    "dp_mode": DataParallelMode,
    "optimizer_sharding": OptimizerSharding,
    "dispatch": DispatchKind,
    "dispatch_rows": DispatchRows,
    "grad_dtype": GradDtype,
    "mode": RecomputeMode,
}


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
