"""What the paired plan's split weight backwards add to a rank's step (docs/projection-formulas.md, "Split
weight backwards").

Interleaved 1F1B's paired plan splits its cool-down's backwards (``moe_engine.parallel.paired_plan``). A
weight backward computes its gradients through ``autograd.grad``, which hands each weight's gradient back
whole instead of adding it inside the GEMM, and the gradient is then added into the buffer: one more
elementwise pass over the stage chunk's parameters (read the gradient in the weights' dtype, read and
write the buffer) per weight backward. Pure arithmetic but for the plan, which is torch's.
"""

from __future__ import annotations

from bench.predict.device import DeviceProfile
from bench.predict.plan.bytes import Params, PrecisionBytes, parameter_pieces, precision_bytes
from bench.predict.plan.rank import rank_holdings
from bench.predict.pricing import op_seconds
from bench.predict.traced import OpWork
from moe_engine.config import ModelConfig, ParallelConfig, PipelineSchedule
from moe_engine.parallel.layout import stage_blocks


def weight_backwards_by_stage(
    kind: str, pp: int, virtual_stages: int, microbatches: int, pipeline_rank: int
) -> dict[int, int]:
    """Weight backwards per stage in pipeline rank ``pipeline_rank``'s paired plan, alone or in a pair."""
    # heavy: torch's pipelining schedules, only for a pipeline.
    from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT

    from moe_engine.parallel.paired_plan import paired_plan, torch_plan

    counts: dict[int, int] = {}
    for action in paired_plan(kind, torch_plan(kind, pp, virtual_stages, microbatches, pipeline_rank)):
        for part in action.sub_actions or (action,):
            if part.computation_type == BACKWARD_WEIGHT:
                counts[part.stage_index] = counts.get(part.stage_index, 0) + 1
    return counts


def weight_add_s(
    weight_backwards: dict[int, int],
    stage_params: dict[int, Params],
    b: PrecisionBytes,
    dtype: str,
    profile: DeviceProfile,
) -> float:
    """Seconds per step the split weight backwards' gradients take to reach the buffer: per weight backward
    of stage s, one memory-bound pass over ``stage_params[s]`` (gradient read, buffer read and written)."""
    seconds = 0.0
    for stage, count in weight_backwards.items():
        params = stage_params[stage]
        nbytes = params.nbytes(b, "param") + 2 * params.nbytes(b, "grad")
        seconds += count * op_seconds(OpWork("memory", 0.0, float(nbytes), dtype), profile)
    return seconds


def stage_params(model: ModelConfig, parallel: ParallelConfig) -> dict[int, Params]:
    """Each pipeline stage's parameters on one rank (its blocks with their local experts; the first
    stage's embedding, the last's final norm and LM head)."""
    pieces, stages = parameter_pieces(model), parallel.num_stages
    params = {}
    for stage, blocks in enumerate(stage_blocks(model.n_layers, stages)):
        held = rank_holdings(model, pieces, list(blocks), stage, stages, parallel.ep)
        params[stage] = held.dense + held.experts
    return params


def split_weight_add_s(
    model: ModelConfig, parallel: ParallelConfig, precision: str, profile: DeviceProfile, pipeline_rank: int
) -> float:
    """``weight_add_s`` of pipeline rank ``pipeline_rank`` under the layout's paired plan: 0 but for
    interleaved 1F1B's (the only plan that splits backwards it did not ask to split)."""
    if parallel.pp == 1 or parallel.schedule is not PipelineSchedule.INTERLEAVED_1F1B:
        return 0.0
    assert parallel.microbatches is not None  # ParallelConfig resolves None to pp
    counts = weight_backwards_by_stage(
        parallel.schedule.value, parallel.pp, parallel.virtual_stages, parallel.microbatches, pipeline_rank
    )
    b = precision_bytes(precision, parallel.grad_dtype.value, parallel.dp_mode.value)
    return weight_add_s(counts, stage_params(model, parallel), b, "bf16" if b.param == 2 else "fp32", profile)
