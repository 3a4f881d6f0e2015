"""Rank skew: the waits for the slowest rank at each blocking collective of a step (``SkewModel``,
``sync_points``, ``skew_seconds``).

Formulas: ``bench.predict.projection``'s docstring, section "Rank skew". Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from bench.predict.collectives import Collective, is_number

__all__ = ["SkewModel", "expected_max_normal", "skew_seconds", "sync_points"]


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals], by Simpson's rule (z_1 = 0, z_2 = 1/sqrt(pi))."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += weight * x * n * pdf * cdf ** (n - 1)
    return total * h / 3


@dataclass(frozen=True)
class SkewModel:
    """How much a rank's step time varies: the input of the rank-skew waits (``bench.predict.projection``'s docstring)."""

    cv: float
    """Coefficient of variation of one rank's step time (robust spread / median of measured steps)."""
    source: str
    """Where cv comes from, in words."""

    def __post_init__(self) -> None:
        if not is_number(self.cv) or not self.cv >= 0:
            raise ValueError(f"skew.cv: must be a number >= 0, got {self.cv!r}")


def sync_points(
    collectives: Iterable[Collective], per_step: Iterable[Collective], microbatches: int
) -> tuple[int, int]:
    """(S, n): the blocking collectives of a step and the largest group among them (``bench.predict.projection``'s docstring).

    ``collectives`` are one microbatch's, ``per_step`` the step's others (gradient buckets included)."""
    collectives, per_step = list(collectives), list(per_step)
    others = [c for c in per_step if c.phase == "other"]
    s = microbatches * sum(c.count for c in collectives) + sum(c.count for c in others) + 1
    n = max((len(c.ranks) for c in [*collectives, *per_step]), default=1)
    return s, n


def skew_seconds(skew: SkewModel | None, sync_count: int, group_size: int, compute_s: float) -> float:
    """z_n sqrt(S) cv compute: the expected waits for the slowest rank (``bench.predict.projection``'s docstring)."""
    if skew is None or group_size < 2 or sync_count < 1:
        return 0.0
    return expected_max_normal(group_size) * math.sqrt(sync_count) * skew.cv * compute_s
