"""The capacity searches on platforms whose answers are known."""

from __future__ import annotations

import pytest

from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.simulate.capacity import ImpossibleTarget, check_bound, max_rate
from sixfold.simulate.engine import ServingSettings
from sixfold.simulate.traffic import parse_traffic

from tests.simulate.factories import linear_platform

SETTINGS = ServingSettings(batching=BatchingConfig(max_batch_rows=100, max_queue_work_ms=0.0, max_queue_size=0),
                           max_card_rows=None, min_split_rows=0, host_dense_max_rows=0)


def test_a_loose_bound_is_met_up_to_saturation() -> None:
    platform = linear_platform(cards=1, card=(0.0, 10e-6))  # 1 ms a 100-item query: 1000 q/s at most
    answer = max_rate(platform, parse_traffic("poisson", "fixed:100"), 1000.0, duration_s=5.0, warmup_s=0.5,
                      settings=SETTINGS, tolerance=0.01)
    assert 900 < answer.max_qps < 1000  # near saturation, never at it (busy >= 99% fails)
    assert answer.best is not None and answer.best.utilisation["card0"] < 0.99
    assert all(not s.passed for s in answer.steps if s.rate > answer.max_qps)


def test_a_tight_bound_is_met_lower_and_an_impossible_one_is_refused() -> None:
    platform = linear_platform(cards=1, card=(0.0, 10e-6))
    traffic = parse_traffic("poisson", "fixed:100")
    tight = max_rate(platform, traffic, 5.0, duration_s=5.0, warmup_s=0.5, settings=SETTINGS, tolerance=0.01)
    loose = max_rate(platform, traffic, 50.0, duration_s=5.0, warmup_s=0.5, settings=SETTINGS, tolerance=0.01)
    assert 0 < tight.max_qps < loose.max_qps
    assert tight.best.latency_ms["p99"] <= 5.0
    with pytest.raises(ImpossibleTarget, match="--p99-ms 0.5: a lone 100-item query"):
        check_bound(platform, traffic, 0.5, SETTINGS)
    with pytest.raises(ValueError, match="--p99-ms must be > 0"):
        check_bound(platform, traffic, -1.0, SETTINGS)
