"""The A/B gate's job, checked before anything runs (``plan_ab``: the baseline's commit, the scenarios, the
budget, the accepted changes), and the one-line error of bad input (``ABError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.ab.resident import TARGET_BLOCK_S
from bench.gate import paired
from bench.gate.accept import Acceptance
from bench.release.git import try_git
from bench.release.record import RELEASES_PATH, ReleaseError, load_releases
from bench.results import REPO_ROOT
from bench.scenario import Scenario

__all__ = ["DEFAULT_BUDGET_S", "MIN_BUDGET_S", "ABError", "ABPlan", "check_budget", "plan_ab"]

MIN_BUDGET_S = paired.MIN_WORKER_PAIRS * paired.MIN_BLOCKS_PER_PAIR * 2 * TARGET_BLOCK_S
"""The least time budget per scenario that can hold the minimum of worker pairs and their block pairs
(start-up not counted: it is the machine's, not the budget's, to say)."""
DEFAULT_BUDGET_S = 60.0


class ABError(ValueError):
    """Bad input for the A/B gate (one line; nothing was run)."""


@dataclass(frozen=True)
class ABPlan:
    """A checked A/B job: nothing has run yet."""

    label: str
    """How the baseline is named in the report (``release 0.1.0``, or the ref as given)."""
    commit: str
    scenarios: list[Scenario]
    tolerance: float
    budget_s: float
    """Seconds of resident blocks per execute scenario, at most."""
    accept_work: frozenset[str] | None = None
    """Work metrics whose increase is accepted (every one: the set of all); None accepts none."""
    accept_increase: frozenset[str] = frozenset()
    """Exact metrics (peak memory, optimizer bytes) whose regression is accepted."""
    acceptances: tuple[Acceptance, ...] = ()
    """Accepted changes: the command line's and every release's, applied by the two sides' versions."""
    warn_above: float | None = None
    """A step-time slowdown beyond this (and within the tolerance) is a warning that passes
    (docs/gates-and-releases.md#the-operating-point); None: no warnings."""
    deadline_s: float | None = None
    """The whole gate's time limit, seconds: what the rule adds past a scenario's budget (an extension,
    a confirmation's pairs) is cut to fit it (``bench.ab.deadline``); None: no limit."""


def check_budget(budget_s: float) -> None:
    if budget_s < MIN_BUDGET_S:
        raise ABError(
            f"--budget {budget_s:g} s is too small: it must hold {paired.MIN_WORKER_PAIRS} worker pairs of "
            f"{paired.MIN_BLOCKS_PER_PAIR} block pairs of {TARGET_BLOCK_S:g} s per side ({MIN_BUDGET_S:g} s)"
        )


def plan_ab(
    ref: str | None,
    scenarios: list[Scenario],
    tolerance: float,
    budget_s: float = DEFAULT_BUDGET_S,
    root: Path = REPO_ROOT,
    releases_path: Path = RELEASES_PATH,
    accept_work: frozenset[str] | None = None,
    accept_increase: frozenset[str] = frozenset(),
    acceptances: tuple[Acceptance, ...] = (),
    warn_above: float | None = None,
    deadline_s: float | None = None,
) -> ABPlan:
    """Check everything before any work; raises ABError with a one-line reason. ``acceptances``: the
    command line's; the releases' (``releases_path``) are added, to apply where the versions say."""
    check_budget(budget_s)
    if warn_above is not None and not 0 < warn_above < tolerance:
        raise ABError(
            f"--warn-above {warn_above:.2%} must lie between 0 and the tolerance ({tolerance:.2%}), which fails the gate"
        )
    if deadline_s is not None and not deadline_s >= budget_s:
        raise ABError(f"--deadline {deadline_s:g} s must be at least the --budget ({budget_s:g} s)")
    if not scenarios:
        raise ABError("no scenarios to run")
    if try_git(root, "rev-parse", "--is-inside-work-tree") is None:
        raise ABError(f"{root} is not a git checkout: the A/B gate checks the baseline out of the repository history")
    try:
        releases = load_releases(releases_path)
    except ReleaseError as err:
        raise ABError(str(err)) from None
    acceptances = (*acceptances, *(a for r in releases for a in r.accepted))
    if ref is None:
        release = releases[-1] if releases else None
        if release is None:
            raise ABError(f"no release recorded in {releases_path.name}: pass --baseline-ref REF")
        commit = try_git(root, "rev-parse", "--verify", "--quiet", f"{release.commit}^{{commit}}")
        if commit is None:
            raise ABError(
                f"release {release.version} ({release.commit[:12]}) is not in this clone: fetch its history "
                "(git fetch --unshallow)"
            )
        return ABPlan(
            f"release {release.version}",
            commit,
            scenarios,
            tolerance,
            budget_s,
            accept_work,
            accept_increase,
            acceptances,
            warn_above,
            deadline_s,
        )
    commit = try_git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}") if not ref.startswith("-") else None
    if commit is None:
        raise ABError(f"--baseline-ref {ref}: no such commit, branch or tag in this repository")
    return ABPlan(
        ref, commit, scenarios, tolerance, budget_s, accept_work, accept_increase, acceptances, warn_above, deadline_s
    )
