"""The power table of ``bench.validate.gate_power``: what it counts as the gate failing, on hand-made records."""

from bench.validate import gate_power


def record(planted, verdict, estimate, fails=None, seconds=60.0):
    r = {"scenario": "s", "planted": planted, "verdict": verdict, "estimate": estimate, "tolerance": 0.03}
    r.update(seconds=seconds, budget_s=90.0, machine="a CPU")
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
    ]
    rows = {line.split(" | ")[1]: line.split(" | ") for line in gate_power.render(timing, []).splitlines()[2:4]}
    assert rows["none (A/A)"][2:6] == ["3", "1 (33%)", "0 / 1", "1"]
    assert rows["+5%"][2:6] == ["2", "1 (50%)", "1 / 0", "1"]
