"""A replay of a paired pipeline plan: every rank runs its actions in order, each as soon as the rank is
free and its inputs have arrived, for the seconds its kind takes. The measured rank's idle time is the
step's bubble under the microbatches overlap (``moe_engine.parallel.paired_plan``).

A pair starts when both its actions' inputs are there and hands on both outputs when it ends. The
inputs: a forward needs the previous stage's forward of its microbatch; a backward its own forward
and the next stage's backward (the last stage: its forward only); a weight backward its input
backward (run before it, alone or in an earlier pair). Messages between stages take no time here (their seconds are the sender's, in its
actions). Formulas: docs/projection-formulas.md, "Bubble of a paired plan". Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.predict.collectives import is_number

__all__ = ["ChunkSeconds", "replay_idle_s"]


@dataclass(frozen=True)
class ChunkSeconds:
    """Seconds one stage chunk's action takes on the rank, by kind."""

    forward: float
    """A forward alone."""
    backward: float
    """A full backward alone."""
    input_backward: float
    """An input backward alone (its weight backward apart)."""
    weight_backward: float
    """A weight backward."""
    forward_backward: float
    """A forward beside a full backward."""
    input_beside_weight: float = 0.0
    """An input backward beside an earlier chunk's weight backward."""
    backward_beside_weight: float = 0.0
    """A full backward beside an earlier chunk's weight backward."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not is_number(value) or not value >= 0:
                raise ValueError(f"chunk_seconds.{name}: must be a number >= 0, got {value!r}")


def _seconds(action, chunk: ChunkSeconds) -> float:
    # heavy: torch's pipelining schedules (their action kinds), only for a pipeline.
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD

    if action.sub_actions is not None:
        kinds = {a.computation_type for a in action.sub_actions}
        if FORWARD in kinds:
            return chunk.forward_backward
        return chunk.input_beside_weight if BACKWARD_INPUT in kinds else chunk.backward_beside_weight
    return {
        FORWARD: chunk.forward,
        FULL_BACKWARD: chunk.backward,
        BACKWARD_INPUT: chunk.input_backward,
        BACKWARD_WEIGHT: chunk.weight_backward,
    }[action.computation_type]


def replay(plans: dict[int, list], stages: int, chunk: ChunkSeconds) -> dict[int, tuple[float, float]]:
    """(end, busy seconds) of each rank after replaying ``plans`` (rank -> its paired actions, as
    ``paired_plan`` returns them) over ``stages`` pipeline stages."""
    # heavy: torch's pipelining schedules (their action kinds), only for a pipeline.
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, FORWARD, FULL_BACKWARD

    done: dict[tuple[str, int, int], float] = {}

    def key(a) -> tuple[str, int, int]:
        kind = a.computation_type
        label = "F" if kind == FORWARD else "B" if kind in (FULL_BACKWARD, BACKWARD_INPUT) else "W"
        return label, a.stage_index, a.microbatch_index

    def inputs_at(a) -> float | None:
        label, stage, mb = key(a)
        if label == "F":
            return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
        if label == "W":
            return done.get(("B", stage, mb))
        own = done.get(("F", stage, mb))
        if own is None or stage == stages - 1:
            return own
        later = done.get(("B", stage + 1, mb))
        return None if later is None else max(own, later)

    position = dict.fromkeys(plans, 0)
    free = dict.fromkeys(plans, 0.0)
    busy = dict.fromkeys(plans, 0.0)
    progress = True
    while progress:
        progress = False
        for rank, plan in plans.items():
            while position[rank] < len(plan):
                action = plan[position[rank]]
                parts = action.sub_actions or (action,)
                arrivals = [inputs_at(a) for a in parts]
                ready = [t for t in arrivals if t is not None]
                if len(ready) < len(arrivals):
                    break
                seconds = _seconds(action, chunk)
                end = max(free[rank], *ready) + seconds
                for a in parts:
                    done[key(a)] = end
                free[rank], busy[rank] = end, busy[rank] + seconds
                position[rank] += 1
                progress = True
    stuck = [r for r, plan in plans.items() if position[r] < len(plan)]
    if stuck:
        raise ValueError(f"pipeline replay: ranks {stuck} wait for inputs no rank produces (a malformed plan)")
    return {rank: (free[rank], busy[rank]) for rank in plans}


def replay_idle_s(kind: str, pp: int, virtual_stages: int, microbatches: int, rank: int, chunk: ChunkSeconds) -> float:
    """Seconds rank ``rank`` idles in a replay of every rank's paired plan (``paired_plan`` of torch's
    plan for ``kind``), each action taking ``chunk``'s seconds: the step's end (the last rank to finish)
    less the rank's busy seconds."""
    # heavy: torch's pipelining schedules, only for a pipeline; the rest of the arithmetic runs without it.
    from moe_engine.parallel.paired_plan import paired_plan, torch_plan

    v = 2 if kind == "dualpipev" else virtual_stages
    plans = {r: paired_plan(kind, torch_plan(kind, pp, v, microbatches, r)) for r in range(pp)}
    ends = replay(plans, pp * v, chunk)
    step_end = max(end for end, _ in ends.values())
    if not math.isfinite(step_end):
        raise ValueError("pipeline replay: the step does not end")
    return step_end - ends[rank][1]
