"""Where a projected step's time goes: by op kind and by engine module (``moe-bench project --breakdown``).
More: docs/projection-formulas.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from bench.predict.collectives import Collective, Network, collective_seconds
from bench.predict.op_kinds import OP_KINDS, op_kind_of
from bench.predict.op_projection import PER_MICROBATCH_ACCOUNTS, collective_account, runs_every_microbatch
from bench.predict.pricing import PricedOp
from bench.predict.projection import Projection

__all__ = ["MODULES", "format_breakdown", "module_of", "step_breakdown"]

MODULES = {
    "embedding": "token embedding",
    "attention": "attention: projections, RoPE, the attention kernel",
    "norms": "RMSNorms (block, QK and final)",
    "router": "router scores, expert selection, auxiliary losses, the expert-bias update",
    "dispatch": "MoE layer before its experts: routing plan, gather into the send buffer, all-to-alls out",
    "experts": "routed experts: the gather of their rows into expert order, grouped GEMMs, activation",
    "combine": "MoE layer after its experts: unsort, all-to-alls back, weighted combine",
    "shared_expert": "the MoE layer's shared expert",
    "mlp": "dense blocks' feed-forward",
    "residual": "residual adds of the blocks",
    "head": "LM head",
    "loss": "the trainer's loss: fp32 cast, log-softmax, NLL, scaling",
    "pipeline": "pipeline stage messages",
    "grad_sync": "gradient buffers: accumulation, scaling, bucket reductions",
    "fsdp": "FSDP's parameter gathers, gradient reductions and their copies",
    "optimizer": "zeroing gradients, clipping, AdamW, ZeRO-1 parameter gathers",
    "proxy_peers": "the proxy rank's stand-ins for its peers' traffic (no work on a real rank)",
    "other": "ops outside every module and part of the step (the trace's own batch)",
}
"""The engine modules of the breakdown, in table order, with what each holds."""

IDLE = {"bubble": "pipeline bubble (idle)", "skew": "rank skew (waits for the slowest rank)"}
"""Rows of time that belongs to no op."""

_SCOPES = {
    "@optimizer": "optimizer",
    "@grad_sync": "grad_sync",
    "@accumulate_grad": "grad_sync",
    "@expert_bias": "router",
    "@proxy_peers": "proxy_peers",
    "@fsdp": "fsdp",
}
_CLASSES = {
    "Router": "router",
    "GroupedExperts": "experts",
    "RMSNorm": "norms",
    "Embedding": "embedding",
    "Attention": "attention",
    "MultiHeadLatentAttention": "attention",
    "RotaryEmbedding": "attention",
    "Block": "residual",
}


def module_of(location: str, stage: str, pipeline_message: bool = False) -> str:
    """The engine module an op belongs to, from where it ran (``TracedOp.location``) and its stage.

    1. A message between pipeline stages: ``pipeline``.
    2. A named part of the step: the optimizer's zeroing and step (``optimizer``, ZeRO-1's gathers and
       the clipping norm included), the gradient sync it finishes and the gradient buffers' hooks in
       the backward (``grad_sync``), the expert-bias update (``router``), the proxy's fabrication of
       its peers' traffic (``proxy_peers``), FSDP's own scopes (``fsdp``).
    3. Inside the model's modules, the innermost module that names a part, walking out from the op:
       Router, GroupedExperts, RMSNorm, Embedding, attention (Attention, MLA, RotaryEmbedding),
       SwiGLU (``shared_expert`` inside an MoE layer, else ``mlp``), the MoE layer's own ops
       (``dispatch`` until its experts have run, ``combine`` after), a block's own ops (``residual``);
       the model's own ops and a linear map directly under it: ``head``.
    4. Outside every module and part, the forward and backward: ``loss`` (the trainer computes
       the loss, and nothing else, outside the model); elsewhere ``other``.

    Backward ops carry the location of the forward op whose autograd node runs them, so each
    gradient lands with its forward.
    """
    if pipeline_message:
        return "pipeline"
    if location.startswith("@"):
        return _SCOPES.get(location, "other")
    if not location:
        return "loss" if stage in ("forward", "backward") else "other"
    return _module_in_chain(location)


@cache
def _module_in_chain(location: str) -> str:
    chain = location.split("/")
    for i in range(len(chain) - 1, -1, -1):
        name, _, after = chain[i].partition(">")
        if name == "MoELayer":
            return "combine" if after in ("GroupedExperts", "SwiGLU") else "dispatch"
        if name == "SwiGLU":
            return "shared_expert" if i > 0 and chain[i - 1].partition(">")[0] == "MoELayer" else "mlp"
        if name in _CLASSES:
            return _CLASSES[name]
    return "head"


# ---- the breakdown -----------------------------------------------------------------------------


@dataclass
class _Row:
    time_s: float = 0.0
    hidden_s: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    kernels: float = 0.0

    def add(self, time_s: float, hidden_s: float, nbytes: float, flops: float, kernels: float) -> None:
        self.time_s += time_s
        self.hidden_s += hidden_s
        self.bytes += nbytes
        self.flops += flops
        self.kernels += kernels

    @property
    def empty(self) -> bool:
        return not (self.time_s or self.hidden_s or self.bytes or self.flops or self.kernels)

    def to_dict(self, step_s: float) -> dict[str, float]:
        return {
            "time_s": self.time_s,
            "share": self.time_s / step_s,
            "hidden_s": self.hidden_s,
            "bytes": self.bytes,
            "flops": self.flops,
            "kernels": self.kernels,
        }


ACCOUNTS = {
    "expert": "expert_comm",
    "pipeline": "pipeline_comm",
    "fsdp": "fsdp_gather_exposed",
    "grad_sync": "grad_sync_exposed",
    "param_gather": "param_gather_exposed",
    "other": "other_comm",
}
"""Accounts of collectives (``bench.predict.op_projection.collective_account``) -> the projection's
counted seconds of each (``Projection.breakdown_s``)."""

TOP_OPS = 20
"""ATen ops the breakdown lists by name, the most time first."""


def step_breakdown(
    priced: Sequence[PricedOp],
    group_phases: dict[str, str],
    microbatches_traced: int,
    microbatches: int,
    projection: Projection,
    rank: int,
    net: Network,
) -> dict[str, Any]:
    """The projected step (``projection``, of this priced trace of ``rank``) by op kind and by module
    (docs/projection-formulas.md): JSON-ready, each table's rows adding up to the step."""
    per_microbatch = microbatches / microbatches_traced
    steps = projection.breakdown_s
    step_s = projection.step_s

    # Collectives: each one's price on its own, then its share of its account's counted seconds.
    accounts: list[str | None] = []
    alone: list[float] = []
    priced_by_account = dict.fromkeys(ACCOUNTS, 0.0)
    for p in priced:
        if p.work.kind != "collective":
            accounts.append(None)
            alone.append(0.0)
            continue
        phase, charged_to = collective_account(p.op, group_phases)
        c = p.op.collective
        assert c is not None  # the work of a collective op
        weight = per_microbatch if charged_to in PER_MICROBATCH_ACCOUNTS else 1.0
        seconds = weight * collective_seconds(
            Collective(c["op"], tuple(c["ranks"]), int(c["nbytes"]), phase), rank, net
        )
        accounts.append(charged_to)
        alone.append(seconds)
        priced_by_account[charged_to] += seconds
    counted_share = {
        account: (steps[key] / priced_by_account[account] if priced_by_account[account] > 0 else 0.0)
        for account, key in ACCOUNTS.items()
    }

    by_kind: dict[str, _Row] = {}
    by_module: dict[str, _Row] = {}
    module_kinds: dict[str, dict[str, float]] = {}
    by_op: dict[str, _Row] = {}
    op_modules: dict[str, dict[str, float]] = {}
    op_kinds: dict[str, str] = {}
    for p, account, seconds_alone in zip(priced, accounts, alone):
        op = p.op
        kind = op_kind_of(p)
        pipeline_message = account == "pipeline"
        module = module_of(op.location, op.stage, pipeline_message)
        if account is None:
            weight = per_microbatch if runs_every_microbatch(op) else 1.0
            time_s, hidden_s = p.seconds * weight, 0.0
            kernels = p.work.kernels * weight
            nbytes, flops = p.work.nbytes * weight, p.work.flops * weight
        else:
            weight = per_microbatch if account in PER_MICROBATCH_ACCOUNTS else 1.0
            time_s = seconds_alone * counted_share[account]
            hidden_s = seconds_alone - time_s if account in ("expert", "grad_sync", "param_gather", "fsdp") else 0.0
            assert op.collective is not None  # only collectives are charged to an account
            kernels, nbytes, flops = weight, op.collective["nbytes"] * weight, 0.0
        for table, key in ((by_kind, kind), (by_module, module), (by_op, op.packet)):
            table.setdefault(key, _Row()).add(time_s, hidden_s, nbytes, flops, kernels)
        mix = module_kinds.setdefault(module, {})
        mix[kind] = mix.get(kind, 0.0) + time_s
        where = op_modules.setdefault(op.packet, {})
        where[module] = where.get(module, 0.0) + time_s
        op_kinds.setdefault(op.packet, kind)

    for table in (by_kind, by_module):
        for key in IDLE:
            if steps[key] > 0:
                table[key] = _Row(time_s=steps[key])
    # Rows of nothing (views and metadata on a GPU profile) would only lengthen the tables.
    kinds = [k for k in (*OP_KINDS, *IDLE) if k in by_kind and not by_kind[k].empty]
    modules = [m for m in (*MODULES, *IDLE) if m in by_module and not by_module[m].empty]
    total = _Row()
    for row in by_kind.values():
        total.add(row.time_s, row.hidden_s, row.bytes, row.flops, row.kernels)
    top = sorted(by_op, key=lambda name: -by_op[name].time_s)[:TOP_OPS]
    return {
        "step_s": step_s,
        "by_kind": {k: by_kind[k].to_dict(step_s) for k in kinds},
        "by_module": {
            m: by_module[m].to_dict(step_s)
            | (
                {"time_by_kind_s": {k: s for k, s in sorted(module_kinds[m].items(), key=lambda kv: -kv[1]) if s > 0}}
                if m in module_kinds
                else {}
            )
            for m in modules
        },
        "top_ops": [
            {
                "op": name,
                "kind": op_kinds[name],
                **by_op[name].to_dict(step_s),
                "time_by_module_s": {m: s for m, s in sorted(op_modules[name].items(), key=lambda kv: -kv[1]) if s > 0},
            }
            for name in top
        ],
        "total": total.to_dict(step_s),
        "kinds": {k: OP_KINDS.get(k) or IDLE[k] for k in kinds},
        "modules": {m: MODULES.get(m) or IDLE[m] for m in modules},
        "rules": [
            f"one step of {microbatches} microbatches: each traced forward and backward op counts "
            f"{microbatches} / {microbatches_traced} times, the optimizer's and the rest once",
            "time_s: what the projected step counts; each table's rows add up to step_s",
            "collectives: expert all-to-alls, stage messages and once-per-step collectives are counted whole "
            "(not overlapped with compute); of the gradient sync, ZeRO-1 and FSDP gathers only the exposed part, "
            "split over their collectives by their prices; hidden_s: the rest, run under compute",
            "bubble and skew: idle time of the pipeline schedule and waits for the slowest rank, in no op",
            "kernels: ops priced as a kernel (a region priced as one GPU kernel: one) and collective calls; "
            "bytes: read + written by compute ops, sent or received by collectives",
            "module of an op: where it ran in the engine (bench/predict/breakdown.py module_of); backward ops "
            "with the forward op that made their autograd node",
        ],
    }


def format_breakdown(breakdown: dict[str, Any], top: int = 10) -> str:
    """The breakdown's two tables and its top ops, as console text."""
    lines = []

    def table(title: str, rows: dict[str, dict[str, float]]) -> None:
        lines.append(
            f"  {title:<16}{'time ms':>11}{'share':>8}{'hidden ms':>11}{'GB moved':>11}{'TFLOP':>10}{'kernels':>10}"
        )
        for name, row in rows.items():
            lines.append(_row_text(name, row))
        t = breakdown["total"]
        lines.append(_row_text("total", t))

    table("by op kind", breakdown["by_kind"])
    lines.append("")
    table("by module", breakdown["by_module"])
    lines.append("")
    lines.append(f"  top ops{'':<35}{'time ms':>11}{'share':>8}{'GB moved':>11}{'kernels':>10}  modules")
    for row in breakdown["top_ops"][:top]:
        modules = ", ".join(m for m in list(row["time_by_module_s"])[:3])
        lines.append(
            f"  {row['op']:<42}{row['time_s'] * 1e3:>11.1f}{row['share']:>8.1%}"
            f"{row['bytes'] / 1e9:>11.1f}{row['kernels']:>10,.0f}  {modules}"
        )
    return "\n".join(lines)


def _row_text(name: str, row: dict[str, float]) -> str:
    hidden = f"{row['hidden_s'] * 1e3:.1f}" if row["hidden_s"] else ""
    return (
        f"  {name:<16}{row['time_s'] * 1e3:>11.1f}{row['share']:>8.1%}{hidden:>11}"
        f"{row['bytes'] / 1e9:>11.1f}{row['flops'] / 1e12:>10.1f}{row['kernels']:>10,.0f}"
    )
