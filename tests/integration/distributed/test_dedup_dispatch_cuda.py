"""On a GPU: rows per (token, rank) and per (token, node) beside rows per (token, expert), on two ranks.

Device tensors throughout (the fused kernels' Triton path, the grouped GEMM's CUDA kernel). With two
or more GPUs each rank has its own and the rows travel over NCCL; on one GPU both ranks share it and
the rows travel over gloo, which copies CUDA tensors through the host. Prints each variant's time per
forward and backward (median of 10), for the GPU check's log.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import shard
from distributed_harness import run_ranks

from moe_engine.config import MoEConfig
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer
from moe_engine.parallel.groups import NodeGroups, build_node_groups

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

D_MODEL, HIDDEN, EXPERTS, TOP_K, TOKENS = 256, 512, 16, 4, 2048
ROWS = ("per-expert", "per-rank", "per-node")


def _layer(rank: int, device: torch.device, dtype: torch.dtype, rows: str, kind: str, group, nodes) -> MoELayer:
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_hidden=HIDDEN, routing="learned", routing_seed=rank)
    layer = MoELayer(D_MODEL, moe)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer = shard(layer, DispatchSpec(group, rank, 2, kind, 4.0, 1, rows, nodes))
    return layer.to(device=device, dtype=dtype)


def _rank_job() -> dict:
    rank = dist.get_rank()
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    if gpus >= 2:
        group = dist.new_group(backend="nccl")
        nodes = build_node_groups_nccl()
    else:
        group, nodes = dist.group.WORLD, build_node_groups([[0, 1]], 1)
    out: dict = {"backend": dist.get_backend(group)}
    generator = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(TOKENS, D_MODEL, generator=generator).to(device)
    grad_TD = torch.randn(TOKENS, D_MODEL, generator=generator).to(device)
    for kind in ("sync", "no-sync"):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in ROWS:
                layer = _layer(rank, device, dtype, rows, kind, group, nodes)
                x = x_TD.to(dtype, copy=True).requires_grad_()
                times = []
                for _ in range(12):
                    layer.zero_grad()
                    x.grad = None
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    y = layer(x)
                    y.backward(grad_TD.to(dtype))
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                out[(kind, str(dtype), rows)] = dict(
                    y=y.detach().float().cpu(),
                    grad_x=x.grad.float().cpu(),
                    grad_router=layer.router.weight.grad.float().cpu(),
                    grad_gate_up=layer.experts.gate_up.grad.float().cpu(),
                    dropped=int(layer.last_dropped),
                    ms=statistics.median(times[2:]),
                )
    return out


def build_node_groups_nccl() -> NodeGroups:
    """Two nodes of one rank each, their groups on NCCL."""
    intra = [dist.new_group([r], backend="nccl") for r in range(2)]
    inter = dist.new_group([0, 1], backend="nccl")
    return NodeGroups(intra=intra[dist.get_rank()], inter=inter)


def test_dedup_dispatch_beside_per_expert_on_a_gpu(record_property):
    ranks = run_ranks(_rank_job, 2, timeout=300)
    for rank, out in enumerate(ranks):
        for kind in ("sync", "no-sync"):
            for dtype, tol in (
                (torch.float32, dict(rtol=1e-4, atol=1e-5)),
                (torch.bfloat16, dict(rtol=0.05, atol=0.05)),
            ):
                reference = out[(kind, str(dtype), "per-expert")]
                for rows in ROWS:
                    got = out[(kind, str(dtype), rows)]
                    # In the junit XML of the GPU check: each variant's median time per forward and backward.
                    record_property(f"rank{rank}-{out['backend']}-{kind}-{dtype}-{rows}-ms", round(got["ms"], 3))
                    assert got["dropped"] == 0
                    for key in ("y", "grad_x", "grad_router", "grad_gate_up"):
                        scale = reference[key].abs().max().clamp(min=1e-12)
                        torch.testing.assert_close(
                            got[key] / scale, reference[key] / scale, **tol, msg=f"rank {rank} {kind} {rows} {key}"
                        )
