"""FSDP2 mode: the design the reference release moved away from, kept to replay the comparison.

Every block is one ``fully_shard`` unit over the data-parallel group (experts included: they are
sharded over dp and gathered for each block's forward and backward), and the root holds the
embedding, final norm and head. Parameters stay fp32 and sharded (they are the master weights);
with bf16 precision the gathered copies are bf16 and gradients are reduced in fp32. Routers are
their own units with an fp32 policy, because the engine computes routing in fp32.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moe_engine.model import Transformer
from moe_engine.moe.router import Router


def apply_fsdp(model: Transformer, group: torch.distributed.ProcessGroup, compute_dtype: torch.dtype) -> Transformer:
    """Shard ``model`` (built in fp32) in place over ``group``; returns it."""
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    compute = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, Router):
            fully_shard(module, mesh=mesh, mp_policy=fp32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=compute)
    fully_shard(model, mesh=mesh, mp_policy=compute)
    return model


@torch.no_grad()
def clip_fsdp_grad_norm_(
    module: torch.nn.Module, max_norm: float, pp_group: torch.distributed.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip the sharded gradients of ``module`` to the global norm ``max_norm``; returns the norm before.

    ``get_total_norm`` of DTensor shards is a partial norm that ``full_tensor`` completes over dp;
    pipeline stages hold disjoint parameters, so their squared norms add up over ``pp_group``.
    """
    params = list(module.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if pp_group is not None:
        square = norm.square()
        torch.distributed.all_reduce(square, group=pp_group)
        norm = square.sqrt()
    # Scales the gradients of those that have one.
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
