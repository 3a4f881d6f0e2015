"""Build only a proxy rank's share of the model: real tensors for its stage, its experts, nothing else.

The real ranks build the whole model from the seed and then drop what they do not hold
(``parallel.trainer.build_rank_model``); a 1.2T model does not fit in one machine, so the proxy
builds the whole model on the meta device (no storage), shards it the same way, and only then
allocates and initialises the kept tensors. Values are drawn per tensor (a generator seeded from
the seed and the tensor's name) with the model's initialisation law, so they are not the real
run's values; a proxy measures time, memory and traffic, for which the law is what matters.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from bench.run.proxy.rank.peers import ProxyDispatchSpec
from bench.run.proxy.rank.pipeline import ProxyPipeline
from moe_engine.config import ModelConfig, ParallelConfig, RecomputeConfig
from moe_engine.model import build_model
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding
from moe_engine.parallel.groups import ProcessGroups
from moe_engine.parallel.layout import check_proxy_layout, stage_blocks
from moe_engine.parallel.pipeline import StageModule
from moe_engine.parallel.trainer import RankModel, prepare_blocks, rank_config, routing_seed


def peer_routing_seeds(config: ModelConfig, groups: ProcessGroups) -> list[int | None]:
    """Routing seed of every rank of this rank's ep group (None for itself); ``config`` is the scenario's."""
    coords, ep = groups.coords, groups.layout.config.ep
    return [
        None if s == coords.ep_rank else routing_seed(config.moe.routing_seed, coords.edp_rank * ep + s)
        for s in range(ep)
    ]


@torch.no_grad()
def initialise(module: nn.Module, std: float, seed: int) -> None:
    """Fill a freshly allocated module: norms 1, matrices N(0, std) from per-name generators, RoPE
    tables recomputed, every other buffer (routing counters, expert biases) zero."""
    for name, param in module.named_parameters():
        if param.ndim >= 2:
            generator = torch.Generator(param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.normal_(0.0, std, generator=generator)
        else:
            param.zero_()
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            sub.weight.fill_(1.0)
        if isinstance(sub, RotaryEmbedding):
            sub.reset_tables()
        elif not isinstance(sub, RMSNorm):
            for buffer in sub.buffers(recurse=False):
                buffer.zero_()


def build_proxy_rank(
    config: ModelConfig,
    parallel: ParallelConfig,
    groups: ProcessGroups,
    device: torch.device,
    seed: int,
    recompute: RecomputeConfig | None = None,
    compile: bool = False,
) -> RankModel:
    """This rank's share of the model on ``device``, its dispatchers and pipeline standing in for peers;
    its blocks recompute and compile as ``build_rank_model``'s do.

    Each MoE layer is built with a ``ProxyDispatcher`` (``ProxyDispatchSpec``) whose ``peers`` is a
    ``SimulatedPeers``; a caller may replace it. Its rows are per (token, expert) whatever
    ``parallel.dispatch_rows`` says.
    """
    parallel.validate(config)
    check_proxy_layout(parallel)
    dispatch = None
    if parallel.ep > 1:
        dispatch = ProxyDispatchSpec(
            group=groups.ep,
            ep_rank=groups.coords.ep_rank,
            ep=parallel.ep,
            kind=parallel.dispatch,
            capacity_factor=parallel.capacity_factor,
            a2a_chunks=parallel.a2a_chunks,
            peer_seeds=tuple(peer_routing_seeds(config, groups)),
        )
    config = rank_config(config, groups)
    model = build_model(config, "meta", seed, dispatch)
    prepare_blocks(model, parallel, recompute, compile)
    if parallel.pp == 1:
        module: nn.Module = model
        pipeline = None
    else:
        stage = groups.coords.pp_rank
        module = StageModule(model, stage_blocks(config.n_layers, parallel.pp)[stage])
        pipeline = ProxyPipeline(module, parallel, stage, groups.pp, config.d_model, config.dtype.torch_dtype)
    module.to_empty(device=device)
    initialise(module, config.init_std, seed)
    if pipeline is not None:
        # ProxyPipeline has Pipeline's interface (step, modules, parameters_module) without being one;
        # RankModel names the engine's class.
        return RankModel(module=pipeline.parameters_module, model=None, pipeline=pipeline)  # type: ignore[arg-type]
    return RankModel(module=model, model=model, pipeline=None)
