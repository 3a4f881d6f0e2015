"""The worker-bias measurement's variance components against hand-computed values and a simulation."""

from __future__ import annotations

import logging
import math
import random

import pytest

from bench.validate.worker_bias import main, variance_components


def test_components_by_hand():
    # Two workers 2% apart in log space (+-1% about the middle), rounds drifting together: the drift
    # is the rounds', so it goes; the means are +-0.01, their variance 0.0002 over 1 degree of freedom.
    drift = [0.0, 0.05, 0.1]
    noise = [[0.004, -0.004, 0.0], [-0.004, 0.004, 0.0]]
    times = [[math.exp(0.01 * sign + d + e) for d, e in zip(drift, errors)] for sign, errors in zip((1, -1), noise)]
    found = variance_components(times)
    assert found["worker_means"] == pytest.approx([0.01, -0.01])
    # Within: each worker's centred values are its errors (the rounds' means are 0 after the sign), so
    # the variance of (0.004, -0.004, 0) is 0.000016 for both.
    assert found["block_noise"] == pytest.approx(math.sqrt(0.000016))
    # Between: 3 rounds x var(0.01, -0.01) = 3 x 0.0002 = 0.0006; (0.0006 - 0.000016) / 3.
    assert found["worker_bias"] == pytest.approx(math.sqrt((0.0006 - 0.000016) / 3))


def test_components_recover_a_simulated_bias_and_noise():
    seed = 20261203
    rng = random.Random(seed)
    bias = [rng.gauss(0, 0.02) for _ in range(400)]
    times = [[math.exp(b + rng.gauss(0, 0.005)) for _ in range(30)] for b in bias]
    found = variance_components(times)
    assert found["worker_bias"] == pytest.approx(0.02, rel=0.1), seed
    assert found["block_noise"] == pytest.approx(0.005, rel=0.05), seed


def test_no_bias_reads_as_none():
    rng = random.Random(7)
    times = [[math.exp(rng.gauss(0, 0.01)) for _ in range(50)] for _ in range(6)]
    found = variance_components(times)
    assert found["worker_bias"] < 0.004 and found["block_noise"] == pytest.approx(0.01, rel=0.15)


def test_bad_input_is_one_line(caplog):
    assert main(["x.yaml", "--env", "OMP_PROC_BIND"]) == 2
    assert caplog.messages == ["worker_bias: --env takes KEY=VALUE, got OMP_PROC_BIND"]
    assert caplog.records[0].levelno == logging.ERROR
    assert main(["x.yaml", "--workers", "1"]) == 2
    with pytest.raises(ValueError, match="at least 2 workers"):
        variance_components([[1.0, 1.0]])
