"""``moe-bench ab --calibrate``: the A/B gate's resident comparison with this checkout on both sides (A/A),
for the whole budget: the machine's noise floor and the smallest tolerance that keeps false alarms at or
below 5% within that budget (``Calibration``, ``run_calibration``, ``render_calibration``).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from bench.ab.plan import check_budget
from bench.ab.resident import ResidentComparison, compare_resident, fresh_pair
from bench.ab.sides import START_MARGIN_S
from bench.gate import paired
from bench.results import REPO_ROOT
from bench.scenario import Scenario

logger = logging.getLogger(__name__)

__all__ = ["Calibration", "render_calibration", "run_calibration"]


@dataclass(frozen=True)
class Calibration:
    """What an A/A run of one scenario says about this machine."""

    scenario: str
    comparison: ResidentComparison

    @property
    def estimate(self) -> paired.PooledEstimate:
        """The A/A estimate: ``compare_resident`` sets it from the second worker pair on, and a run for the
        whole budget makes at least ``paired.MIN_WORKER_PAIRS``."""
        if self.comparison.estimate is None:
            raise ValueError(f"calibration of {self.scenario}: the resident comparison has no estimate")
        return self.comparison.estimate

    @property
    def noise(self) -> float:
        """Standard deviation of one block pair's log-ratio within its worker pair."""
        return self.estimate.within_sd

    @property
    def pair_bias(self) -> float:
        """Standard deviation of the pair bias (log space): the pairs' spread less the block noise it carries."""
        blocks = self.comparison.block_pairs / len(self.comparison.pairs)
        return math.sqrt(max(0.0, self.estimate.between_sd**2 - self.noise**2 / blocks))

    @property
    def tolerance(self) -> float:
        """The smallest tolerance at which, within this budget, the gate both decides and raises a
        false alarm at most 5% of the time: the interval must be narrower than it, and the estimate
        of identical code (its bias plus 1.645 standard errors) must stay below it."""
        est = self.estimate
        standard_error = est.width / (2 * paired.t_critical(est.worker_pairs - 1))
        return math.expm1(max(est.width, abs(est.estimate) + 1.645 * standard_error))


def run_calibration(
    scenarios: list[Scenario],
    budget_s: float,
    device: str = "auto",
    root: Path = REPO_ROOT,
) -> list[Calibration]:
    """A/A: this checkout against itself, resident, for the whole budget of each execute scenario."""
    check_budget(budget_s)
    found = []
    for scenario in (s for s in scenarios if s.mode == "execute"):
        timeout = scenario.run.timeout_s + START_MARGIN_S
        comparison = compare_resident(
            functools.partial(fresh_pair, root, root, scenario, device, timeout),
            0.0,
            budget_s,
            stop_early=False,
        )
        found.append(Calibration(scenario.name, comparison))
        logger.info(
            f"calibrate {scenario.name}: {len(comparison.pairs)} worker pairs, {comparison.block_pairs} block pairs "
            f"of {comparison.steps_per_block} steps, noise {found[-1].noise:.2%} per block pair, pair bias "
            f"{found[-1].pair_bias:.2%}, smallest tolerance {found[-1].tolerance:.2%}"
        )
    return found


def render_calibration(found: list[Calibration], budget_s: float) -> str:
    columns = (
        "scenario",
        "worker pairs",
        "block pairs",
        "steps/block",
        "block noise",
        "pair bias",
        "A/A estimate",
        "95% interval",
        "smallest tolerance",
    )
    rows = [
        (
            c.scenario,
            str(len(c.comparison.pairs)),
            str(c.comparison.block_pairs),
            str(c.comparison.steps_per_block),
            f"{c.noise:.2%}",
            f"{c.pair_bias:.2%}",
            f"x{1 + c.estimate.slowdown:.4f}",
            f"[{1 + c.estimate.interval[0]:.4f}, {1 + c.estimate.interval[1]:.4f}]",
            f"{c.tolerance:.2%}",
        )
        for c in found
    ]
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *rows]]
    worst = max((c.tolerance for c in found), default=0.0)
    return (
        "\n".join(
            [
                f"A/A calibration, budget {budget_s:g} s per scenario:",
                *lines,
                f"smallest tolerance for every scenario at this budget: {worst:.2%}",
            ]
        )
        + "\n"
    )
