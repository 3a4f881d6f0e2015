"""One MoE layer with rows per (token, rank) or per (token, node) on gloo ranks: the layer
(``make_layer``), a rank's batch (``batch``), its expert block with a dispatcher of given rows, kind,
capacity and chunks (``sharded``), and one forward and backward (``step``)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from dispatch_cases import shard

from moe_engine.config import MoEConfig
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer

D_MODEL, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 24, 8, 3, 20


def make_layer(routing_seed: int, routing: str = "learned") -> MoELayer:
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_hidden=HIDDEN, routing=routing, routing_seed=routing_seed)
    layer = MoELayer(D_MODEL, moe)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def batch(rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}-{rank}".encode()))
    return torch.randn(TOKENS, D_MODEL, generator=generator), torch.randn(TOKENS, D_MODEL, generator=generator)


def step(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor) -> dict:
    x = x_TD.clone().requires_grad_()
    layer.zero_grad()
    layer.router.reset_routing_generator()
    y = layer(x)
    (y * grad_TD).sum().backward()
    layer.router.reset_routing_generator()  # the forward's routes, drawn again
    return dict(
        y=y.detach(),
        grad_x=x.grad,
        grad_router=layer.router.weight.grad,
        grad_gate_up=layer.experts.gate_up.grad,
        grad_down=layer.experts.down.grad,
        dropped=layer.last_dropped,
        expert_TK=layer.router(x_TD).expert_TK,
    )


def sharded(rows: str, kind: str, capacity_factor: float, chunks: int, nodes, routing: str = "learned") -> MoELayer:
    rank = dist.get_rank()
    spec = DispatchSpec(dist.group.WORLD, rank, dist.get_world_size(), kind, capacity_factor, chunks, rows, nodes)
    return shard(make_layer(rank, routing), spec)
