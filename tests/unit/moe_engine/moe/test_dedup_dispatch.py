"""Rows per (token, rank) and per (token, node): the expected destinations the projection prices, and
the config's choice and validation of the rows. On gloo ranks (the function of rows per (token,
expert), the bytes sent, the dropped tail, the hand-overs): tests/integration/distributed/
test_dedup_dispatch_ranks.py."""

from __future__ import annotations

import pytest

from moe_engine.config import DispatchRows, ParallelConfig
from moe_engine.parallel.layout import destination_share, expected_destinations

# ---- the expectation the projection prices ------------------------------------------------------


def test_expected_destinations_is_the_hypergeometric_mean():
    # E = 8, k = 2, 4 ranks of 2: a given rank is missed with C(6, 2) / C(8, 2) = 15 / 28.
    assert destination_share(8, 2, 4) == pytest.approx(13 / 28)
    assert expected_destinations(8, 2, 4) == pytest.approx(52 / 28)
    # Enumerate every top-2 choice to check the mean.
    choices = [(a, b) for a in range(8) for b in range(a + 1, 8)]
    assert sum(len({a // 2, b // 2}) for a, b in choices) / len(choices) == pytest.approx(52 / 28)
    # All experts on one destination, and k larger than one destination's miss set.
    assert expected_destinations(8, 2, 1) == 1
    assert expected_destinations(8, 7, 2) == 2


def test_config_resolves_and_validates_dispatch_rows():
    assert ParallelConfig(dp=4, ep=4).resolved_dispatch_rows is DispatchRows.PER_RANK
    assert ParallelConfig(dp=4, ep=4, ranks_per_node=8).resolved_dispatch_rows is DispatchRows.PER_RANK
    assert ParallelConfig(dp=4, ep=4, ranks_per_node=2).resolved_dispatch_rows is DispatchRows.PER_NODE
    assert ParallelConfig(dp=4, ep=4, dispatch_rows="per-expert", ranks_per_node=2).resolved_dispatch_rows is (
        DispatchRows.PER_EXPERT
    )
    with pytest.raises(ValueError, match="ranks_per_node"):
        ParallelConfig(dp=6, ep=6, ranks_per_node=4)
    with pytest.raises(ValueError, match="dispatch_rows"):
        ParallelConfig(dp=4, ep=4, dispatch_rows="per-node")
    assert ParallelConfig.from_dict({"dp": 2, "ep": 2, "dispatch_rows": "per-rank"}).to_dict()["dispatch_rows"] == (
        "per-rank"
    )
