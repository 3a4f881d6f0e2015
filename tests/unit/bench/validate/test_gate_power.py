"""The power table of ``bench.validate.gate_power``: what it counts as the gate failing, on hand-made records."""

import math

from bench.gate import paired
from bench.validate import gate_power


def record(planted, verdict, estimate, fails=None, seconds=60.0, **confirmation):
    """``confirmation``: ``unconfirmed_estimate`` (None: nothing to confirm), for a run under the
    confirming gate; left out for one from before it."""
    r = {"scenario": "s", "planted": planted, "verdict": verdict, "estimate": estimate, "tolerance": 0.03}
    r.update(seconds=seconds, budget_s=90.0, machine="a CPU", **confirmation)
    if fails is not None:
        r["fails"] = fails
    return r


def test_the_table_counts_what_the_gate_fails():
    timing = [
        record(0.0, "unchanged", 0.001),
        record(0.0, "inconclusive", 0.012, fails=False),
        record(0.0, "inconclusive", 0.035),  # a record from before the field: the same rule on its estimate
        record(0.05, "regressed", 0.06, fails=True),
        record(0.05, "inconclusive", 0.02, fails=False),
        # Under the confirming gate: an A/A failure withdrawn, a slowdown's confirmed, one with nothing to confirm.
        record(0.0, "unchanged", 0.01, fails=False, unconfirmed_estimate=0.035),
        record(0.05, "regressed", 0.052, fails=True, unconfirmed_estimate=0.048),
        record(0.05, "unchanged", 0.001, fails=False, unconfirmed_estimate=None),
    ]
    rows = {line.split(" | ")[1]: line.split(" | ") for line in gate_power.render(timing, []).splitlines()[2:4]}
    assert rows["none (A/A)"][2:7] == ["4", "1 (25%)", "0 / 1", "1", "0 / 1 (1)"]
    assert rows["+5%"][2:7] == ["4", "2 (50%)", "2 / 0", "1", "1 / 0 (2)"]


def test_the_replay_agrees_with_the_confirmed_rules_arithmetic():
    """One recorded run of 4 worker pairs with a pair spread of 4% (a standard error of 2%), drawn
    afresh 20,000 times: the replayed rates are ``paired.fail_rates``'s confirmed ones, within four
    binomial standard errors, at no change and at a planted 5% and 10%."""
    run = {"scenario": "s", "planted": 0.0, "worker_pairs": 4, "pair_sd": 0.04}
    rates = gate_power.replay([run], 0.045, (0.0, 0.05, 0.10), draws=20_000, seed=3)
    for slowdown in (0.0, 0.05, 0.10):
        _, expected = paired.fail_rates(slowdown, 0.02, 0.045)
        binomial_se = math.sqrt(max(expected * (1 - expected), 1e-4) / 20_000)
        assert abs(rates["s", slowdown] - expected) < 4 * binomial_se, (slowdown, rates["s", slowdown], expected)
    table = gate_power.render_replay(rates, 0.045).splitlines()
    assert table[0] == "| scenario (tolerance 4.5%) | A/A failed | +5% caught | +10% caught |"
    assert table[-1] == f"suite false alarms: {rates['s', 0.0]:.1%}"


def test_the_replay_draws_a_suite_runs_scenario_gates_from_their_standard_errors():
    """A whole-suite record holds each scenario's estimate, standard error and worker pairs: the replay
    draws each scenario gate with as many pairs, their spread se * sqrt(pairs); a plan scenario's gate
    (no pairs) is not drawn."""
    row = {"scenario": "s", "planted": 0.0, "se": 0.02, "worker_pairs": 4, "fails": False}
    plan = {"scenario": "plan", "planted": 0.0, "se": None, "worker_pairs": 0, "fails": False}
    suite = {"kind": "suite", "planted": 0.0, "planted_scenario": None, "scenarios": [row, plan]}
    runs = gate_power.suite_scenario_runs([suite, record(0.0, "unchanged", 0.001)])
    assert runs == [{"scenario": "s", "planted": 0.0, "worker_pairs": 4, "pair_sd": 0.04}]
    # The same rates as a per-scenario record of that spread (the test above): the confirmed rule's.
    drawn = gate_power.replay(runs, 0.045, (0.05,), draws=20_000, seed=3)
    _, expected = paired.fail_rates(0.05, 0.02, 0.045)
    assert abs(drawn["s", 0.05] - expected) < 4 * math.sqrt(expected * (1 - expected) / 20_000)
