"""The power table of ``bench.validate.gate_power``: what it counts as the gate failing, on hand-made records."""

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
