"""Planning a run: query-size statistics, the pooled queries, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen import ConstantArrivals, build_schedule
from sixfold.models.requests import MLPERF_QUANTILES, RequestGenerator, parse_query_sizes


def plan(query_size: str, *, qps: float = 2000.0, window_s: float = 10.0, pool: int = 14, seed: int = 0):
    generator = RequestGenerator((50, 60), 3, (2, 1), seed=seed)
    return build_schedule(ConstantArrivals(), qps, window_s, parse_query_sizes(query_size), generator,
                          lambda request: request, pool=pool, rng=np.random.default_rng(seed))


def test_mlperf_query_sizes():
    schedule = plan("mlperf")
    items = schedule.items
    assert len(schedule) == 20_000
    assert set(np.unique(items)) <= set(MLPERF_QUANTILES)
    assert items.mean() == pytest.approx(np.mean(MLPERF_QUANTILES), abs=6)  # 270
    assert np.median(items) == 200 and items.max() == 700
    # 7 distinct sizes x 2 variants each; every pooled query really has its size.
    assert len(schedule.pool) == 14
    for payload, n in zip(schedule.pool.payloads, schedule.pool.items):
        assert payload["dense_features"].shape == (n, 3)
        assert payload["sparse_indices"].size == payload["sparse_lengths"].sum()


def test_fixed_query_sizes():
    schedule = plan("fixed:7", qps=100, window_s=1.0, pool=3)
    assert np.all(schedule.items == 7) and len(schedule.pool) == 3
    assert set(schedule.query.tolist()) <= {0, 1, 2}


def test_same_seed_same_plan():
    a, b = plan("mlperf", qps=50, window_s=1.0, seed=4), plan("mlperf", qps=50, window_s=1.0, seed=4)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.items, b.items)
    assert all(np.array_equal(x["sparse_indices"], y["sparse_indices"])
               for x, y in zip(a.pool.payloads, b.pool.payloads))


@pytest.mark.parametrize("spec", ["fixed:0", "fixed:x", "lognormal", "fixed"])
def test_bad_query_size_spec(spec):
    with pytest.raises(ValueError, match="mlperf"):
        parse_query_sizes(spec)
