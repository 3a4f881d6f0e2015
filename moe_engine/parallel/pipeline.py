"""Pipeline parallelism over ``torch.distributed.pipelining``: stage modules and schedules.
More: docs/schedules-and-recompute.md.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward_weight
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    OVERLAP_F_B,
    PipelineScheduleMulti,
    _Action,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)

from moe_engine import kernels
from moe_engine.config import ParallelConfig, PipelineSchedule
from moe_engine.model import Transformer
from moe_engine.moe import dispatch
from moe_engine.moe.layer import MoELayer, forward_leaves_no_trace
from moe_engine.parallel.layout import stage_blocks
from moe_engine.parallel.overlap import Interleaver, overlaps_microbatches
from moe_engine.parallel.paired_plan import paired_plan


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves no trace on the MoE layers.

    On its first step a stage runs its module once more, on the first microbatch, to learn what it
    sends. That forward would draw routes from the random and skewed streams (and count load): a
    run resumed from a checkpoint, whose first step infers again, would then route otherwise than
    the run it continues."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with forward_leaves_no_trace([m for m in self.submod.modules() if isinstance(m, MoELayer)]):
            return super()._forward_metadata_inference(*args, **kwargs)


class StageModule(nn.Module):
    """Blocks [first, last) of a transformer, plus the embedding and/or head at the ends."""

    def __init__(self, model: Transformer, blocks: range):
        super().__init__()
        self.is_first = blocks.start == 0
        self.is_last = blocks.stop == len(model.blocks)
        self.embed = model.embed if self.is_first else None
        self.rope = model.rope
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.fused_loss = self.is_last and model.fused_kernels
        """The last stage ends at the final norm; the loss applies the LM head (docs/schedules-and-recompute.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The first stage holds the embedding, the last the final norm (and the LM head).
        h_BSD = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h_BSD = block(h_BSD, self.rope)
        if self.norm is None:
            return h_BSD
        if self.fused_loss:
            return self.norm(h_BSD)
        assert self.lm_head is not None  # tied embeddings (no lm_head) run without a pipeline
        return self.lm_head(self.norm(h_BSD))

    def loss(self, out: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The last stage's training loss of its output (logits, or the normalised hidden states)."""
        if self.fused_loss:
            assert self.lm_head is not None  # tied embeddings (no lm_head) run without a pipeline
            return kernels.linear_cross_entropy(out, self.lm_head.weight, labels_BS)
        return cross_entropy(out, labels_BS)


def cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The training loss, as ``Transformer.loss`` computes it: fp32 mean token cross-entropy."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())


def _scaled_loss(out: torch.Tensor, labels_BS: torch.Tensor, stage: StageModule | None, scale: float) -> torch.Tensor:
    assert stage is not None  # only the rank holding the last stage calls the loss
    return stage.loss(out, labels_BS) * scale


class StageParameters(nn.Module):
    """Every module of a rank's stages under the full model's names (a container; never called)."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        first = next((s for s in stages if s.is_first), None)
        last = next((s for s in stages if s.is_last), None)
        self.embed = first.embed if first else None
        self.blocks = nn.ModuleDict({i: block for s in stages for i, block in s.blocks.items()})
        self.norm = last.norm if last else None
        self.lm_head = last.lm_head if last else None


_SCHEDULES = {
    PipelineSchedule.GPIPE: ScheduleGPipe,
    PipelineSchedule.ONE_F_ONE_B: Schedule1F1B,
    PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineSchedule.INTERLEAVED_ZB: ScheduleInterleavedZeroBubble,
    PipelineSchedule.ZBV: ScheduleZBVZeroBubble,
    PipelineSchedule.DUALPIPEV: ScheduleDualPipeV,
}


def rank_stages(config: ParallelConfig, pp_rank: int) -> list[int]:
    """The pipeline stages ``pp_rank`` runs, in order: r, r + pp, ... (looped), or r and 2pp-1-r under a
    V-shaped schedule (zbv, dualpipev: the first and the last stage on rank 0, so the loss and the
    embedding meet there)."""
    if config.schedule.v_shaped:
        return [pp_rank, 2 * config.pp - 1 - pp_rank]
    return list(range(pp_rank, config.num_stages, config.pp))


def _run_pair(action: _Action, ctx: _PipelineContext) -> None:
    """An overlapped pair of the paired plan (``moe_engine.parallel.paired_plan``): a forward beside a
    full backward, run side by side, switching at each expert all-to-all (``moe_engine.parallel.overlap``);
    or a backward with an earlier chunk's weight backward inside its all-to-alls (``_WeightSlices``).
    Each action is what the schedule's runtime does for it (torch 2.13's ``_PipelineScheduleRuntime``),
    receives, loss and the hand-over between a rank's two adjacent stages included."""
    schedule = ctx.schedule_ref
    assert isinstance(schedule, _PipelineScheduleRuntime) and action.sub_actions is not None
    stages = {stage.stage_index: stage for stage in schedule._stages}

    def run_forward(forward: _Action) -> None:
        index, mb = forward.stage_index, forward.microbatch_index
        assert mb is not None and ctx.arg_mbs is not None and ctx.kwarg_mbs is not None
        stage = stages[index]
        if not stage.is_first and index - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((index, mb)))
        # Pipeline.step never asks the schedule for the outputs (return_outputs=False).
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if index + 1 in stages:
            stages[index + 1].set_local_fwd_input(output, mb)

    def run_backward(backward: _Action) -> None:
        index, mb = backward.stage_index, backward.microbatch_index
        assert mb is not None
        stage = stages[index]
        if not stage.is_last and index + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((index, mb)))
        loss = schedule._maybe_get_loss(stage, mb)
        full = backward.computation_type != BACKWARD_INPUT
        last = False
        if full:
            schedule.backward_counter[index] += 1
            last = schedule.backward_counter[index] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last)
        if index - 1 in stages:
            stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    first, second = action.sub_actions
    if second.computation_type == BACKWARD_WEIGHT:
        index, mb = second.stage_index, second.microbatch_index
        assert mb is not None
        schedule.backward_counter[index] += 1
        weights = _WeightSlices(stages[index], mb)
        with weights.inside_all_to_alls():
            run_backward(first)
        weights.finish()
        return
    Interleaver().run(
        *(functools.partial(run_forward if a.computation_type == FORWARD else run_backward, a) for a in (first, second))
    )


class _WeightSlices:
    """One stage chunk's weight backward (torch's ``backward_weight_one_chunk`` of a stage after the
    first: ``stage_backward_weight`` over the parameter groups its input backward saved), run in slices
    at the expert all-to-alls of the backward it is paired with: each slice while one all-to-all is in
    flight, on the thread that waits for it (on a GPU, autograd's device thread: a reentrant backward).

    Slices take parameter groups in order, about one share of their elements each. A weight backward
    issues no collective, so every rank's collectives keep their order.

    torch's weight backward adds each gradient to ``.grad`` past the weight's accumulator, so past its
    post-accumulate hooks: once a weight's last group has run, its hooks run here, as the accumulator
    would have run them. The data-parallel optimizer's hook moves the gradient into its (fp32) buffer
    and counts the backward, so the cool-down's gradients neither add up in the weights' dtype nor hold
    their buckets' reductions until the backward ends."""

    def __init__(self, stage, mb: int):
        if stage.is_first:
            raise ValueError("a weight backward of the first stage holds its whole backward: it runs alone")
        _, groups, _, _ = stage.backward_state.pop(mb)
        # torch's input backward leaves a no-op dw_runner entry that its weight backward consumes: this one does.
        stage.dw_runner.pop(mb)
        self.stage = stage
        self.groups: list = list(groups or [])
        # Two exchanges of rows per MoE layer hand over in a backward: its combine's and its dispatch's.
        slices = max(1, 2 * sum(isinstance(m, MoELayer) for m in stage.submod.modules()))
        self.share = max(1, sum(p.numel() for g in self.groups for p in _group_weights(g)) // slices)
        # A weight in several groups has its hooks run once, after its last group: one backward.
        self.groups_left: dict[int, int] = {}
        for group in self.groups:
            for weight in _group_weights(group):
                self.groups_left[id(weight)] = self.groups_left.get(id(weight), 0) + 1
        self.given: set[int] = set()

    def _run_slice(self) -> None:
        taken, size = [], 0
        while self.groups and size < self.share:
            group = self.groups.pop(0)
            size += sum(p.numel() for p in _group_weights(group))
            taken.append(group)
        if taken:
            # Only a group with a gradient to propagate gives its weights one (torch skips the rest).
            for group in taken:
                if any(grad is not None for grads in group["grads"] for grad in grads):
                    self.given.update(id(weight) for weight in _group_weights(group))
            # Inside a backward grad mode is off, and torch finds each weight's accumulator through a view.
            with torch.enable_grad():
                stage_backward_weight(self.stage.submod.parameters(), taken)
            self._run_post_accumulate_hooks(taken)

    def _run_post_accumulate_hooks(self, groups: list) -> None:
        for group in groups:
            for weight in _group_weights(group):
                self.groups_left[id(weight)] -= 1
                if self.groups_left[id(weight)] == 0 and id(weight) in self.given:
                    # What AccumulateGrad runs after adding a gradient (FSDP2 runs them by hand too).
                    for hook in tuple((weight._post_accumulate_grad_hooks or {}).values()):
                        hook(weight)

    @contextlib.contextmanager
    def inside_all_to_alls(self):
        """Within: each expert all-to-all in flight runs one slice (none left: nothing)."""
        if dispatch.in_flight_hook is not None:
            raise RuntimeError("an overlapped region is already running")

        def hook() -> None:
            dispatch.in_flight_hook = None  # a slice runs no all-to-all of its own
            try:
                self._run_slice()
            finally:
                dispatch.in_flight_hook = hook

        dispatch.in_flight_hook = hook
        try:
            yield
        finally:
            dispatch.in_flight_hook = None

    def finish(self) -> None:
        """The slices no all-to-all ran."""
        while self.groups:
            self._run_slice()


def _run_weight_alone(action: _Action, ctx: _PipelineContext) -> None:
    """The paired plan's last weight backward, alone: what the runtime does for a BACKWARD_WEIGHT
    action, through ``_WeightSlices`` so that its weights' hooks run."""
    schedule = ctx.schedule_ref
    assert isinstance(schedule, _PipelineScheduleRuntime) and action.microbatch_index is not None
    stage = next(s for s in schedule._stages if s.stage_index == action.stage_index)
    schedule.backward_counter[action.stage_index] += 1
    _WeightSlices(stage, action.microbatch_index).finish()


def _group_weights(group: dict) -> list:
    # torch's parameter groups name their weights by gradient accumulators; their variables are the weights.
    return [acc.variable for acc in group["params"] if hasattr(acc, "variable")]


def _pair_plan(schedule: _PipelineScheduleRuntime, kind: str) -> None:
    """Rewrite the schedule's plan as ``paired_plan`` pairs it and let torch lower it again (sends and
    receives)."""
    schedule.pipeline_order = {rank: list(paired_plan(kind, plan)) for rank, plan in schedule.pipeline_order.items()}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)


class Pipeline:
    """This rank's stages and the schedule that runs one step of them."""

    def __init__(
        self,
        model: Transformer,
        config: ParallelConfig,
        stage_indices: list[int],
        group: torch.distributed.ProcessGroup,
        device: torch.device,
    ):
        microbatches = config.microbatches
        assert microbatches is not None  # ParallelConfig resolves None to pp
        bounds = stage_blocks(len(model.blocks), config.num_stages)
        self.modules = [StageModule(model, bounds[s]) for s in stage_indices]
        self.stages = [
            _Stage(module, s, config.num_stages, device, group=group) for module, s in zip(self.modules, stage_indices)
        ]
        self.parameters_module = StageParameters(self.modules)
        self.is_first = any(m.is_first for m in self.modules)
        self.is_last = any(m.is_last for m in self.modules)
        for module in self.modules:
            for layer in module.modules():
                if isinstance(layer, MoELayer):
                    layer.loss_scale = 1 / microbatches
        schedule = _SCHEDULES[config.schedule]
        # Only the rank holding the last stage calls the loss.
        last = next((m for m in self.modules if m.is_last), None)
        loss_fn = functools.partial(_scaled_loss, stage=last, scale=1 / microbatches)
        stages = self.stages if issubclass(schedule, PipelineScheduleMulti) else self.stages[0]
        self.schedule = schedule(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
        # Decided for the whole model, not this rank's blocks: every rank must lower the same plan,
        # or their sends and receives would not match.
        if config.schedule.pairs_microbatches and overlaps_microbatches(config, model):
            assert isinstance(self.schedule, _PipelineScheduleRuntime)
            _pair_plan(self.schedule, config.schedule.value)
            self.schedule.register_custom_function(OVERLAP_F_B, _run_pair)
            if config.schedule is PipelineSchedule.INTERLEAVED_1F1B:
                # Its plan's only weight backwards are the cool-down's (DualPipeV's are torch's own).
                self.schedule.register_custom_function(BACKWARD_WEIGHT, _run_weight_alone)

    def step(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every microbatch; the mean loss on the last stage, else None."""
        inputs = (tokens_BS,) if self.is_first else ()
        if not self.is_last:
            self.schedule.step(*inputs, return_outputs=False)
            return None
        losses: list[torch.Tensor] = []
        self.schedule.step(*inputs, target=labels_BS, losses=losses, return_outputs=False)
        # The schedule's losses are the scaled ones: their sum is the mean of the microbatch losses.
        return torch.stack([loss.detach() for loss in losses]).sum()
