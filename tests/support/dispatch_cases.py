"""One MoE layer's expert-parallel dispatch cases: the layer (``make_layer``), its expert block on one
rank (``shard``), a configuration with each rank's batch (``make_case``), one forward and backward
(``step``), and the capacity rule's kept assignments by hand (``expected_kept``)."""

from __future__ import annotations

import zlib

import torch

from moe_engine.config import MoEConfig
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer

D_MODEL, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 24, 8, 2, 24


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def make_layer(seed: int, routing: str, backend: str = "torch", routing_seed: int = 0) -> MoELayer:
    """Same parameters for every ``routing_seed``: it only seeds random and skewed expert choices."""
    torch.manual_seed(seed)
    moe = MoEConfig(
        num_experts=EXPERTS,
        top_k=TOP_K,
        expert_hidden=HIDDEN,
        routing=routing,
        zipf_exponent=2.0,
        backend=backend,
        routing_seed=routing_seed,
    )
    layer = MoELayer(D_MODEL, moe)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def shard(full: MoELayer, dispatch: DispatchSpec) -> MoELayer:
    """A layer built with ``dispatch`` (its block of experts, its dispatcher) holding ``full``'s weights."""
    layer = MoELayer(full.d_model, full.config, full.router.layer_idx, full.fused_kernels, dispatch)
    held = layer.experts.global_experts
    experts = {"experts.gate_up", "experts.down"}
    state = {n: v[held.start : held.stop] if n in experts else v for n, v in full.state_dict().items()}
    layer.load_state_dict(state)
    return layer


def make_case(name, ep, kind, capacity_factor, routing, backend="torch", tokens=None, seed=0):
    """One expert-parallel configuration, with each rank's own fresh batch and output gradient."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tokens = tokens or [TOKENS] * ep
    x = [torch.randn(t, D_MODEL, generator=generator) for t in tokens]
    grad = [torch.randn(t, D_MODEL, generator=generator) for t in tokens]
    return dict(
        name=name,
        ep=ep,
        kind=kind,
        capacity_factor=capacity_factor,
        routing=routing,
        backend=backend,
        seed=seed,
        x=x,
        grad=grad,
    )


def step(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor) -> dict:
    x = x_TD.clone().requires_grad_()
    layer.zero_grad()
    layer.router.reset_routing_generator()
    y = layer(x)
    (y * grad_TD).sum().backward()
    return dict(
        y=y.detach(),
        grad_x=x.grad,
        grad_router=layer.router.weight.grad,
        grad_gate_up=layer.experts.gate_up.grad,
        grad_down=layer.experts.down.grad,
        dropped=layer.last_dropped,
        counts=layer.last_counts_E,
        experts=layer.experts.global_experts,
    )


def expected_kept(expert_TK: torch.Tensor, ep: int, slot_capacity: int) -> torch.Tensor:
    """bool (T, k): each destination keeps its first ``slot_capacity`` assignments by (expert, t, j)."""
    per_rank = EXPERTS // ep
    kept = torch.ones(expert_TK.numel(), dtype=torch.bool)
    flat = expert_TK.flatten().tolist()
    for dest in range(ep):
        queue = sorted((e, n) for n, e in enumerate(flat) if e // per_rank == dest)
        for _, n in queue[slot_capacity:]:
            kept[n] = False
    return kept.view_as(expert_TK)
