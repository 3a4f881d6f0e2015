"""A proxy rank's pipeline stage: its microbatches in the schedule's order, neighbours fabricated.

The real pipeline (``parallel.pipeline``) runs ``torch.distributed.pipelining``, whose first step
infers shapes by exchanging metadata with the neighbouring stages; on a fake world nothing would
answer. This runs the same stage modules in the same order as GPipe or 1F1B would on this stage, so
the same number of microbatches' activations are alive at the peak, and issues the same
activation and gradient messages (fake, recorded). The input activations of a later stage and the
output gradients of an earlier one are random tensors of the right shape and dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from moe_engine.config import ParallelConfig, PipelineSchedule
from moe_engine.parallel.pipeline import StageModule, StageParameters


def stage_order(schedule: PipelineSchedule, pp: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """("F" | "B", microbatch) in the order a stage runs them: GPipe, or 1F1B with pp - stage - 1 warm-up forwards."""
    m = microbatches
    if schedule is PipelineSchedule.GPIPE:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule is not PipelineSchedule.ONE_F_ONE_B:
        raise ValueError(f"a proxy rank runs the gpipe and 1f1b schedules, not {schedule.value}")
    warmup = min(m, pp - stage - 1)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


class ProxyPipeline:
    """One stage of a pipeline on a fake world; same interface as ``parallel.pipeline.Pipeline``."""

    def __init__(
        self, module: StageModule, config: ParallelConfig, stage: int, group, d_model: int, dtype: torch.dtype
    ):
        if config.virtual_stages != 1:
            raise ValueError("a proxy rank runs one pipeline stage per rank (virtual_stages 1)")
        self.module = module
        self.modules = [module]
        self.config = config
        self.stage = stage
        self.group = group
        self.d_model = d_model
        self.dtype = dtype
        self.parameters_module = StageParameters([module])
        self.is_first = module.is_first
        self.is_last = module.is_last
        assert config.microbatches is not None  # ParallelConfig.__post_init__ resolves None to pp
        self.order = stage_order(config.schedule, config.pp, stage, config.microbatches)
        # Filling neighbours' messages is proxy overhead, not the stage's work: a timer can leave it out.
        self.fabrication: Callable[[], AbstractContextManager] = contextlib.nullcontext

    def _message(
        self, shape: torch.Size, device: torch.device, peer_stage: int, send: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Send ``send`` to, or receive a tensor of ``shape`` from, the rank of stage ``peer_stage``
        (received activations are N(0, 1), received gradients N(0, 1e-3))."""
        if send is not None:
            dist.send(send.contiguous(), group_dst=peer_stage, group=self.group)
            return send
        received = torch.empty(shape, dtype=self.dtype, device=device)
        dist.recv(received, group_src=peer_stage, group=self.group)
        with self.fabrication():
            return received.normal_(std=1.0 if peer_stage < self.stage else 1e-3)

    def step(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor | None:
        m = self.config.microbatches
        assert m is not None  # ParallelConfig.__post_init__ resolves None to pp
        tokens, labels = tokens_BS.chunk(m), labels_BS.chunk(m)
        shape = torch.Size((tokens[0].shape[0], tokens[0].shape[1], self.d_model))
        device = tokens_BS.device
        inputs, outputs, losses = {}, {}, []
        for kind, i in self.order:
            if kind == "F":
                if self.is_first:
                    x = tokens[i]
                else:
                    x = self._message(shape, device, self.stage - 1).requires_grad_()
                out = self.module(x)
                if self.is_last:
                    out = self.module.loss(out, labels[i])
                    losses.append(out.detach())
                    out = out / m
                else:
                    self._message(shape, device, self.stage + 1, send=out.detach())
                inputs[i], outputs[i] = x, out
            else:
                x, out = inputs.pop(i), outputs.pop(i)
                if self.is_last:
                    out.backward()
                else:
                    out.backward(self._message(shape, device, self.stage + 1))
                if not self.is_first:
                    self._message(shape, device, self.stage - 1, send=x.grad)
        return torch.stack(losses).mean() if self.is_last else None
