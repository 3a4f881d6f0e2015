"""Fake resident sides with known block times: ``compare_resident``'s logic without processes."""

from __future__ import annotations

import contextlib
import math
import random
from types import SimpleNamespace

from bench.ab.resident import compare_resident


class FakeSide:
    """A side with known block times: the controller's logic without processes or timing noise.

    ``bias``: this worker's own lifelong factor (memory layout, thread placement); ``noise``: each
    block's, drawn from ``rng``; ``repeat``: the factor of a block run right after the same side's
    (its data still in the caches); ``drift``: the machine slowing down, per second of the clock."""

    def __init__(self, label, per_step_s, order, clock, bias=1.0, rng=None, noise=0.0, repeat=1.0, drift=0.0):
        self.label, self.per_step_s, self.order, self.clock = label, per_step_s, order, clock
        self.bias, self.rng, self.noise, self.repeat, self.drift = bias, rng, noise, repeat, drift
        self.scenario = SimpleNamespace(name="tiny-resident")

    def block(self, steps: int) -> float:
        again = bool(self.order) and self.order[-1] == self.label
        self.order.append(self.label)
        jitter = math.exp(self.rng.gauss(0, self.noise)) if self.rng else 1.0 + 0.01 * (len(self.order) % 3)
        seconds = steps * self.per_step_s * self.bias * jitter * (self.repeat if again else 1.0)
        seconds *= 1.0 + self.drift * self.clock[0]
        self.clock[0] += seconds
        return seconds


def fake_pairs(base_step, cand_step, order, clock, pair_bias=0.0, noise=0.0, seed=0, start_s=5.0, **effects):
    """``open_pair`` for ``compare_resident``: each call starts two fresh fake workers (``start_s`` each),
    each with its own bias, so that the two differ by ``pair_bias`` (standard deviation, log space)."""
    rng = random.Random(seed)

    @contextlib.contextmanager
    def open_pair(candidate_first=False):
        order.append("candidate first" if candidate_first else "baseline first")
        clock[0] += 2 * start_s
        biases = [math.exp(rng.gauss(0, pair_bias / math.sqrt(2))) for _ in range(2)]
        yield (
            FakeSide("baseline", base_step, order, clock, biases[0], rng if noise else None, noise, **effects),
            FakeSide("candidate", cand_step, order, clock, biases[1], rng if noise else None, noise, **effects),
        )
        order.append("closed")

    return open_pair


def run_fake(
    base_step,
    cand_step,
    tolerance,
    budget_s,
    stop_early=True,
    extension_s=0.0,
    confirm=False,
    deadline=None,
    clock=None,
    **kwargs,
):
    """``compare_resident`` on fake sides; ``clock``: a one-item list of seconds to share (with a
    ``deadline`` built on it, ``bench.ab.deadline.SuiteDeadline``), else a fresh one from 0."""
    order, clock = [], clock if clock is not None else [0.0]
    result = compare_resident(
        fake_pairs(base_step, cand_step, order, clock, **kwargs),
        tolerance,
        budget_s,
        clock=lambda: clock[0],
        stop_early=stop_early,
        extension_s=extension_s,
        confirm=confirm,
        deadline=deadline,
    )
    return result, order
