"""One rank's share of a training step under any layout: build what the rank holds, then step it.

``build_rank_model`` builds the model from the seed with this rank's experts and dispatchers chosen
at construction (``DispatchSpec.from_parallel``; every layout starts from the same weights as the
single-process reference), then keeps this rank's share: its pipeline stages (pp), or its FSDP shards. ``ParallelTrainer.step`` runs forward and backward
over the rank's microbatches (itself, or through the pipeline schedule), synchronises gradients and
updates the parameters. With no process groups it is the single-process trainer.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from moe_engine.config import DataParallelMode, ModelConfig, ParallelConfig, Precision, RecomputeConfig
from moe_engine.model import Transformer, build_model
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer
from moe_engine.parallel.data_parallel import DataParallelOptimizer, build_data_parallel_optimizer
from moe_engine.parallel.fsdp import apply_fsdp, clip_fsdp_grad_norm_
from moe_engine.parallel.groups import ProcessGroups
from moe_engine.parallel.layout import stage_blocks
from moe_engine.parallel.overlap import Interleaver, overlaps_microbatches
from moe_engine.parallel.pipeline import Pipeline, cross_entropy, rank_stages
from moe_engine.recompute import apply_recompute
from moe_engine.train import OptimizerConfig, adamw_param_groups

# Offsets the random-routing seed per data-parallel rank, so that ranks draw independent routes.
_DP_SEED_STRIDE = 7919


@dataclass
class RankModel:
    """The modules one rank holds and how it runs them."""

    module: nn.Module
    """Every parameter this rank owns: the model, or its pipeline stages."""
    model: Transformer | None
    """The whole-model forward, when the rank runs one (pp = 1)."""
    pipeline: Pipeline | None
    """The rank's pipeline stages and schedule (pp > 1)."""

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.module.modules() if isinstance(m, MoELayer)]


def routing_seed(base_seed: int, dp_rank: int) -> int:
    """The random-routing seed of a data-parallel rank (each rank draws its own routes)."""
    return base_seed + _DP_SEED_STRIDE * dp_rank


def rank_config(config: ModelConfig, groups: ProcessGroups | None) -> ModelConfig:
    """The model config a rank builds: the routing seed of its data-parallel rank."""
    if groups is None:
        return config
    seed = routing_seed(config.moe.routing_seed, groups.coords.dp_rank)
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, routing_seed=seed))


def prepare_blocks(
    model: Transformer, parallel: ParallelConfig, recompute: RecomputeConfig | None, compile: bool
) -> None:
    """How the blocks run: which recompute in backward (``moe_engine.recompute``), and compiled or eager."""
    recompute = recompute or RecomputeConfig()
    stages = stage_blocks(len(model.blocks), parallel.num_stages)
    recompute.validate(len(model.blocks), min(len(stage) for stage in stages))
    apply_recompute(model.blocks, recompute, stages)
    if compile:
        # Imported here: torch.compile's machinery loads only for runs that ask for it.
        from moe_engine.compile import compile_blocks

        compile_blocks(model.blocks)


def build_rank_model(
    config: ModelConfig,
    parallel: ParallelConfig,
    groups: ProcessGroups | None,
    device: torch.device,
    seed: int,
    recompute: RecomputeConfig | None = None,
    compile: bool = False,
) -> RankModel:
    """Build the model from ``seed`` with this rank's experts and dispatchers (``DispatchSpec.from_parallel``)
    and keep this rank's share of it; ``recompute`` and ``compile`` set how its blocks run (activation
    recompute, regional ``torch.compile``)."""
    parallel.validate(config)
    parallel.validate_executable()
    if groups is None and parallel.world_size > 1:
        raise ValueError(f"a layout of {parallel.world_size} ranks needs process groups")
    fsdp = parallel.dp_mode is DataParallelMode.FSDP and groups is not None
    config = rank_config(config, groups)
    # FSDP keeps fp32 shards as the master weights and casts the gathered copies itself.
    dispatch = DispatchSpec.from_parallel(parallel, groups)
    model = build_model(dataclasses.replace(config, dtype=Precision.FP32) if fsdp else config, device, seed, dispatch)
    prepare_blocks(model, parallel, recompute, compile)
    if fsdp:
        assert groups is not None  # part of fsdp's definition above
        apply_fsdp(model, groups.dp, config.dtype.torch_dtype)
    if parallel.pp > 1:
        assert groups is not None  # pp > 1 is a layout of several ranks (checked above)
        stages = rank_stages(parallel, groups.coords.pp_rank)
        pipeline = Pipeline(model, parallel, stages, groups.pp, device)
        return RankModel(module=pipeline.parameters_module, model=None, pipeline=pipeline)
    return RankModel(module=model, model=model, pipeline=None)


class ParallelTrainer:
    """Forward, backward, gradient synchronisation, clipping and optimizer step of one rank.

    A step of m microbatches scales each microbatch's loss by 1/m in backward (the router losses
    too, through ``MoELayer.loss_scale``), so gradients are final as they arrive and each bucket's
    reduction can launch during the last microbatch's backward.
    """

    def __init__(
        self,
        rank_model: RankModel,
        parallel: ParallelConfig,
        groups: ProcessGroups | None,
        config: OptimizerConfig | None = None,
    ):
        self.rank_model = rank_model
        self.parallel = parallel
        self.groups = groups
        self.config = config = config or OptimizerConfig()
        self.fsdp = parallel.dp_mode is DataParallelMode.FSDP and groups is not None
        # torch's AdamW under fsdp, else the engine's own data-parallel optimizer.
        self.optimizer: torch.optim.AdamW | DataParallelOptimizer
        if self.fsdp:
            self.optimizer = torch.optim.AdamW(
                adamw_param_groups(list(rank_model.module.parameters()), config),
                lr=config.lr,
                betas=config.betas,
                eps=config.eps,
            )
        else:
            self.optimizer = build_data_parallel_optimizer(rank_model.module, groups, config, parallel)
        assert parallel.microbatches is not None  # ParallelConfig resolves None to pp
        self.microbatches = parallel.microbatches
        # A pipeline scales its stages' router losses itself.
        for layer in rank_model.moe_layers():
            layer.loss_scale = 1 / self.microbatches
        self._fsdp_grad_norm: torch.Tensor | None = None
        self.overlapped = (
            rank_model.pipeline is None and not self.fsdp and overlaps_microbatches(parallel, rank_model.module)
        )
        """Whether a step runs the overlapped data-parallel step (``_accumulate_overlapped``)."""

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """Global gradient norm of the last step before clipping (device scalar); None without clipping."""
        if isinstance(self.optimizer, torch.optim.AdamW):  # fsdp
            return self._fsdp_grad_norm
        return self.optimizer.last_grad_norm

    def step(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step on this rank's batch; its mean loss (detached) where the rank has one."""
        self.optimizer.zero_grad()
        if isinstance(self.optimizer, DataParallelOptimizer):  # not fsdp
            self.optimizer.arm_overlap(self.microbatches)
        if self.rank_model.pipeline is not None:
            loss = self.rank_model.pipeline.step(tokens_BS, labels_BS)
        else:
            loss = self._accumulate(tokens_BS, labels_BS)
        if self.fsdp and self.config.max_grad_norm > 0:
            assert self.groups is not None  # fsdp runs with process groups only
            pp_group = self.groups.pp if self.parallel.pp > 1 else None
            self._fsdp_grad_norm = clip_fsdp_grad_norm_(self.rank_model.module, self.config.max_grad_norm, pp_group)
        self.optimizer.step()
        self._update_expert_bias()
        return loss

    def _accumulate(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        if self.overlapped:
            return self._accumulate_overlapped(tokens_BS, labels_BS)
        model, m = self.rank_model.model, self.microbatches
        assert model is not None  # without a pipeline the rank runs the whole model
        losses = []
        for i, (tokens, labels) in enumerate(zip(tokens_BS.chunk(m), labels_BS.chunk(m))):
            if self.fsdp:
                # fully_shard swapped the model's class for one with FSDPModule's methods.
                cast(FSDPModule, model).set_requires_gradient_sync(i == m - 1)
            # With fused kernels the LM head and the loss are one op inside the model's forward.
            fused = getattr(model, "fused_kernels", False)
            loss = model(tokens, labels) if fused else cross_entropy(model(tokens), labels)
            (loss if m == 1 else loss / m).backward()
            losses.append(loss.detach())
        return losses[0] if m == 1 else torch.stack(losses).mean()

    def _accumulate_overlapped(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The overlapped data-parallel step: microbatch i+1's forward runs beside microbatch i's backward,
        switching at each expert all-to-all (``moe_engine.parallel.overlap``), so each one's all-to-alls
        move while the other computes. The first forward and the last backward run alone."""
        model, m = self.rank_model.model, self.microbatches
        assert model is not None  # without a pipeline the rank runs the whole model
        batches = list(zip(tokens_BS.chunk(m), labels_BS.chunk(m)))
        # With fused kernels the LM head and the loss are one op inside the model's forward.
        fused = getattr(model, "fused_kernels", False)

        def forward(i: int) -> torch.Tensor:
            tokens, labels = batches[i]
            return model(tokens, labels) if fused else cross_entropy(model(tokens), labels)

        def backward(loss: torch.Tensor) -> None:
            (loss / m).backward()

        losses = [forward(0)]
        for i in range(1, m):
            loss, _ = Interleaver().run(functools.partial(forward, i), functools.partial(backward, losses[-1]))
            losses[-1] = losses[-1].detach()
            losses.append(loss)
        backward(losses[-1])
        return torch.stack([loss.detach() for loss in losses]).mean()

    def _update_expert_bias(self) -> None:
        layers = self.rank_model.moe_layers()
        if not layers or layers[0].config.expert_bias_rate == 0:
            return
        if self.groups is not None:
            # The bias balances the global load, so every replica sees the same counts.
            for layer in layers:
                dist.all_reduce(layer.tokens_per_expert, group=self.groups.dp)
        for layer in layers:
            layer.update_expert_bias()

    def state_bytes(self) -> int:
        """Optimizer bytes this rank holds (fp32 masters that are not the parameters, Adam moments)."""
        if isinstance(self.optimizer, torch.optim.AdamW):  # fsdp
            return sum(
                t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                for state in self.optimizer.state.values()
                for t in state.values()
                if torch.is_tensor(t) and t.ndim > 0
            )
        return self.optimizer.state_bytes()

    def resident_tensors(self) -> list[torch.Tensor]:
        """Tensors that live across steps: parameters, buffers, gradients and optimizer state."""
        module = self.rank_model.module
        tensors = list(module.parameters()) + list(module.buffers())
        tensors += [p.grad for p in module.parameters() if p.grad is not None]
        if isinstance(self.optimizer, torch.optim.AdamW):  # fsdp
            tensors += [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        else:
            tensors += self.optimizer.gradient_tensors() + self.optimizer.state_tensors()
        return tensors
