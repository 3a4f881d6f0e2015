"""proxy-check's arithmetic: the step-time spread, the skew a proxy's collectives imply, the summary."""

from __future__ import annotations

import math

import pytest

from bench.predict.skew import SkewModel
from bench.validate.proxy_check import proxy_skew_s, step_time_cv, summarize


def test_step_time_cv_is_the_robust_spread_over_the_median():
    # median 1.1; absolute deviations .1, 0, .2, .1, .3 -> MAD 0.1.
    assert step_time_cv([1.0, 1.1, 0.9, 1.2, 1.4]) == pytest.approx(1.4826 * 0.1 / 1.1)
    assert step_time_cv([2.0, 2.0, 2.0]) == 0.0
    # One wild step does not move it (the standard deviation would).
    assert step_time_cv([1.0, 1.0, 1.1, 0.9, 50.0]) == pytest.approx(1.4826 * 0.1)


def test_proxy_skew_counts_the_blocking_collectives_of_the_step():
    details = {
        "collectives_per_step": [
            {"op": "all_to_all", "group_size": 2, "nbytes": 100, "phase": "expert", "count": 16},
            {"op": "all_reduce", "group_size": 2, "nbytes": 100, "phase": "grad", "count": 3},
            {"op": "all_reduce", "group_size": 4, "nbytes": 4, "phase": "other", "count": 1},
        ],
        "projection": {"breakdown_s": {"compute": 0.5}},
    }
    # S = 16 all-to-alls + 1 other + the step's end = 18; n = 4 (the largest group).
    z4 = 1.0293753730
    assert proxy_skew_s(details, SkewModel(0.1, "test")) == pytest.approx(z4 * math.sqrt(18) * 0.1 * 0.5, rel=1e-6)
    assert proxy_skew_s(details, SkewModel(0.0, "test")) == 0.0


def test_summary_takes_medians_of_the_ok_runs():
    rows = [
        {"scenario": "a", "status": "ok", "error": e, "error_without_skew": e - 0.1, "op_level_error": 2 * e}
        for e in (0.05, -0.02, 0.30)
    ] + [{"scenario": "a", "status": "timeout", "error": "stopped"}]
    entry = summarize(rows)["a"]
    assert entry["runs"] == 3
    assert entry["median_error"] == pytest.approx(0.05)
    assert entry["median_error_without_skew"] == pytest.approx(-0.05)
    assert entry["median_op_level_error"] == pytest.approx(0.10)
