"""The A/B gate's whole-suite time limit (``moe-bench ab --deadline``), shared out between its scenarios.

The per-scenario budget bounds the blocks a scenario times, not the gate: its full runs and worker
start-ups take what the machine makes them take, and two additions of the rule have no bound of their
own (an inconclusive scenario's extension; a failing one's confirmation on as many fresh pairs). The
limit bounds only those two: a scenario may add past its budget what is left of the limit less a
reserve for each execute scenario still to come, the most any scenario of this gate took to reach the
end of its budget. The full runs, the start-ups and the budgeted blocks always run, so on a machine slow
enough for those alone to pass the limit the gate passes it too. Rule and arithmetic:
docs/gates-and-releases.md, "The operating point".
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SuiteDeadline:
    """One gate's time limit, from its creation, over the execute scenarios ``scenarios`` (in their order)."""

    def __init__(self, limit_s: float, scenarios: list[str], clock: Callable[[], float] = time.monotonic):
        if not limit_s > 0:
            raise ValueError(f"deadline: must be > 0 seconds, got {limit_s!r}")
        if len(set(scenarios)) != len(scenarios):
            raise ValueError(f"deadline: scenarios must be distinct, got {scenarios}")
        self.limit_s = limit_s
        self.scenarios = list(scenarios)
        self.clock = clock
        self.started = clock()
        self.reserve_s = 0.0
        """The most a scenario of this gate took from its start to the end of its budget."""
        self._scenario: str | None = None
        self._scenario_started = self.started

    def scenario_starts(self, name: str) -> None:
        """Scenario ``name`` starts (its full runs next)."""
        self._scenario, self._scenario_started = name, self.clock()

    def budget_spent(self, unused_s: float = 0.0) -> None:
        """The running scenario has reached the end of its budget, or decided ``unused_s`` seconds before
        it (counted: a later scenario may need its whole budget)."""
        self.reserve_s = max(self.reserve_s, self.clock() - self._scenario_started + max(0.0, unused_s))

    @property
    def scenarios_after(self) -> int:
        """Execute scenarios still to come after the running one."""
        if self._scenario not in self.scenarios:
            return len(self.scenarios)
        return len(self.scenarios) - self.scenarios.index(self._scenario) - 1

    def left_s(self) -> float:
        """Seconds the running scenario may still add past its budget (negative: none)."""
        return self.started + self.limit_s - self.scenarios_after * self.reserve_s - self.clock()
