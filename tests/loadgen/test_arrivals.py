"""Arrival processes: rates, spacing statistics, bounds and spec errors."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen import ConstantArrivals, PoissonArrivals, parse_arrival


def gaps(offsets: np.ndarray) -> np.ndarray:
    return np.diff(offsets)


def test_poisson_gaps_are_exponential_with_mean_one_over_qps():
    offsets = PoissonArrivals().offsets(1000.0, 30.0, np.random.default_rng(1))
    g = gaps(offsets)
    assert offsets.size == pytest.approx(30_000, rel=0.03)
    assert g.mean() == pytest.approx(1e-3, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)  # CV of an exponential is 1
    assert offsets[0] == 0.0 and np.all(g >= 0) and offsets[-1] < 30.0


def test_constant_gaps_are_exact():
    offsets = ConstantArrivals().offsets(50.0, 2.0, np.random.default_rng(0))
    assert offsets.size == 100
    assert np.allclose(gaps(offsets), 0.02)
    assert gaps(offsets).std() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("kind", ["poisson", "constant"])
def test_limit_and_seed(kind):
    process = parse_arrival(kind)
    a = process.offsets(100.0, 10.0, np.random.default_rng(7), limit=25)
    b = process.offsets(100.0, 10.0, np.random.default_rng(7), limit=25)
    assert a.size == 25 and np.array_equal(a, b)


def test_poisson_low_rate_short_window_still_bounded():
    offsets = PoissonArrivals().offsets(0.5, 1.0, np.random.default_rng(3))
    assert 1 <= offsets.size <= 5 and offsets[-1] < 1.0


@pytest.mark.parametrize("spec", ["", "uniform", "poisson:3"])
def test_bad_arrival_spec(spec):
    with pytest.raises(ValueError, match="poisson, constant"):
        parse_arrival(spec)


def test_bad_rate():
    with pytest.raises(ValueError, match="qps must be > 0"):
        PoissonArrivals().offsets(0.0, 1.0, np.random.default_rng(0))
