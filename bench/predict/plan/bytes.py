"""Bytes per parameter and the parameters a plan splits over ranks (``bench.predict.plan``'s
notation).
More: docs/memory-plan.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_engine.config import ModelConfig
from moe_engine.flops import parameter_counts


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes of one element of each kind of tensor under a precision."""

    param: int
    """A (non-router) parameter."""
    grad: int
    """Its gradient, as the gradient buffer holds it."""
    optimizer: int
    """Its optimizer state (fp32 master copy when the parameter is low precision, Adam m and v)."""
    activation: float
    """A saved activation, a pipeline message element."""
    expert_input: float
    """A saved input of an expert GEMM (gathered tokens, SwiGLU product)."""
    comm: int
    """An all-to-all element."""
    optimizer_step_temp: int
    """fp32 copy of a gradient made for the optimizer step (0 when the gradient buffer is already fp32)."""


BYTES = {
    "fp32": PrecisionBytes(param=4, grad=4, optimizer=8, activation=4, expert_input=4, comm=4, optimizer_step_temp=0),
    "bf16": PrecisionBytes(param=2, grad=2, optimizer=12, activation=2, expert_input=2, comm=2, optimizer_step_temp=4),
    "mxfp8": PrecisionBytes(
        param=2, grad=2, optimizer=12, activation=2, expert_input=1 + 1 / 32, comm=2, optimizer_step_temp=4
    ),
    # Rowwise FP8 saves x in e4m3 but h in bf16 (``moe_engine.precision.fp8_experts``): counted as bf16.
    "fp8": PrecisionBytes(param=2, grad=2, optimizer=12, activation=2, expert_input=2, comm=2, optimizer_step_temp=4),
}
"""Bytes by precision with gradient buffers in the parameters' dtype (``grad_dtype: param``)."""


ROUTER_BYTES = PrecisionBytes(param=4, grad=4, optimizer=8, activation=4, expert_input=4, comm=4, optimizer_step_temp=0)
"""The router is fp32 whatever the precision, and is its own optimizer master."""


FP32_GRAD_BYTES = 4
"""An element of an fp32 gradient buffer (``grad_dtype: fp32``), or of what FSDP reduces."""


def precision_bytes(precision: str, grad_dtype: str = "fp32", dp_mode: str = "ddp") -> PrecisionBytes:
    """``BYTES[precision]`` with the gradients in the buffers ``grad_dtype`` asks for.

    fp32 buffers hold 4 bytes per gradient and need no fp32 copy for the optimizer step. FSDP has no
    DDP buffers: it keeps the same 16 bytes per parameter whatever grad_dtype (see docs/memory-plan.md).
    """
    b = BYTES[precision]
    if grad_dtype == "fp32" and dp_mode != "fsdp":
        return dataclasses.replace(b, grad=FP32_GRAD_BYTES, optimizer_step_temp=0)
    return b


@dataclass(frozen=True)
class Params:
    """A parameter count split by storage: low-precision (model dtype) and fp32 (router)."""

    lowp: int = 0
    fp32: int = 0

    def __add__(self, other: Params) -> Params:
        return Params(self.lowp + other.lowp, self.fp32 + other.fp32)

    def __mul__(self, n: int) -> Params:
        return Params(self.lowp * n, self.fp32 * n)

    @property
    def count(self) -> int:
        return self.lowp + self.fp32

    def nbytes(self, b: PrecisionBytes, kind: str) -> int:
        """Bytes of ``kind`` ("param", "grad" or "optimizer") for these parameters."""
        return self.lowp * getattr(b, kind) + self.fp32 * getattr(ROUTER_BYTES, kind)


@dataclass(frozen=True)
class Pieces:
    """Parameters of each repeated piece of the model, derived from ``parameter_counts``."""

    embedding: Params
    head: Params
    """Final norm + LM head."""
    block: Params
    """Attention projections and the block's norms (every block)."""
    dense_ffn: Params
    moe_dense: Params
    """Router (fp32) and shared expert of an MoE block."""
    expert: Params
    """One routed expert."""


def parameter_pieces(model: ModelConfig) -> Pieces:
    counts = parameter_counts(model)
    grown = parameter_counts(dataclasses.replace(model, n_layers=model.n_layers + 1))
    block_norms = grown.norms - counts.norms
    final_norm = counts.norms - model.n_layers * block_norms
    n_moe, n_dense = model.n_moe_layers, model.n_dense_ffn_layers
    return Pieces(
        embedding=Params(counts.embedding),
        head=Params(counts.lm_head + final_norm),
        block=Params(counts.attention // model.n_layers + block_norms),
        dense_ffn=Params(counts.dense_ffn // n_dense if n_dense else 0),
        moe_dense=Params(counts.shared_expert // n_moe, counts.router // n_moe) if n_moe else Params(),
        expert=Params(counts.experts // (n_moe * model.moe.num_experts) if n_moe else 0),
    )
