"""The ideal-server yardstick: Lindley's recursion, M/D/1's known mean wait, and the bisection's answer."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen.ideal import ideal_latencies, ideal_max_qps
from sixfold.models.requests import FixedQuerySizes, MLPerfQuerySizes


def test_latencies_follow_the_queue_by_hand() -> None:
    # 100 items at 1000 items/s = 0.1 s each; the 2nd arrives 0.05 s after the 1st, the 3rd 0.2 s later
    got = ideal_latencies(np.array([100, 100, 100]), np.array([0.0, 0.05, 0.2]), 1000.0)
    np.testing.assert_allclose(got, [0.1, 0.15, 0.1])


def test_mean_wait_matches_m_d_1() -> None:
    rng = np.random.default_rng(1)
    service, rho, n = 0.01, 0.5, 200_000
    gaps = rng.exponential(service / rho, n)
    latencies = ideal_latencies(np.full(n, 10), gaps, 10 / service)
    expected_wait = rho * service / (2 * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    assert abs((latencies.mean() - service) / expected_wait - 1) < 0.05


def test_the_answer_is_the_highest_rate_within_the_bound() -> None:
    sizes = MLPerfQuerySizes()
    r60 = ideal_max_qps(26_000, sizes, 60.0, queries=20_000)
    assert 0 < r60.max_qps < r60.capacity_qps and r60.p99_ms <= 60.0
    assert r60.capacity_qps == pytest.approx(26_000 / 270, rel=0.03)
    r250 = ideal_max_qps(26_000, sizes, 250.0, queries=20_000)
    assert r60.max_qps < r250.max_qps < r250.capacity_qps
    # a little faster than the answer breaks the bound, with the same arrivals
    rng = np.random.default_rng(0)
    drawn, unit = sizes.sample(rng, 20_000), rng.exponential(1.0, 20_000)
    over = np.percentile(ideal_latencies(drawn, unit / (r60.max_qps * 1.01), 26_000), 99)
    assert over > 0.060


def test_a_bound_below_the_largest_query_alone_gives_zero() -> None:
    r = ideal_max_qps(1000.0, FixedQuerySizes(100), 50.0)  # each query alone takes 100 ms
    assert r.max_qps == 0.0 and r.p99_ms == pytest.approx(100.0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="items_per_s > 0"):
        ideal_max_qps(0.0, FixedQuerySizes(1), 60.0)
