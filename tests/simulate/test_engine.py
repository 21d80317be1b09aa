"""The simulator runs the server's own scheduling code: change the server's settings (or code) and the
simulated latencies change exactly as that code says they should."""

from __future__ import annotations

import numpy as np
import pytest

import sixfold.server.execution.runtime as server_runtime
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.simulate.engine import ServingSettings, simulate
from sixfold.simulate.traffic import Arrivals, parse_traffic

from tests.simulate.factories import linear_platform

HOST = (0.2e-3, 2e-6)   # 0.2 ms + 2 us an item
CARD = (0.5e-3, 10e-6)  # 0.5 ms + 10 us an item


def settings(**batching) -> ServingSettings:
    """Serving defaults without work admission, host-dense or idle-card splitting unless asked."""
    return ServingSettings(batching=BatchingConfig(**{"max_queue_work_ms": 0.0, **batching}), min_split_rows=0,
                           host_dense_max_rows=0)


def arrivals(offsets: list[float], items: list[int]) -> Arrivals:
    return Arrivals(np.asarray(offsets, dtype=float), np.asarray(items), np.asarray(items), 1.0,
                    max(offsets) + 1e-3)


def host(rows: int) -> float:
    return HOST[0] + HOST[1] * rows


def card(rows: int) -> float:
    return CARD[0] + CARD[1] * rows


def test_a_lone_query_waits_out_the_batching_window_then_runs_host_then_card() -> None:
    platform = linear_platform(host=HOST, card=CARD, per_request_s=50e-6)
    for delay_us in (2000, 500, 0):
        result = simulate(platform, arrivals([0.0], [100]), settings=settings(max_queue_delay_microseconds=delay_us))
        expected = 50e-6 + delay_us / 1e6 + host(100) + card(100)
        assert result.latency_ms["max"] == pytest.approx(expected * 1e3, abs=1e-9)


def test_max_batch_rows_decides_whether_two_queries_share_a_batch() -> None:
    platform = linear_platform(cards=2, host=HOST, card=CARD)
    two = arrivals([0.0, 0.0], [100, 100])
    together = simulate(platform, two, settings=settings(max_batch_rows=1024, max_queue_delay_microseconds=2000))
    assert together.batches == 1
    assert together.latencies_s == pytest.approx([2e-3 + host(200) + card(200)] * 2, abs=1e-12)
    # A full batch leaves at once; the second waits for the host stage, then takes the other card.
    apart = simulate(platform, two, settings=settings(max_batch_rows=100, max_queue_delay_microseconds=2000))
    assert apart.batches == 2
    assert apart.latencies_s == pytest.approx([host(100) + card(100), 2 * host(100) + card(100)], abs=1e-12)


def test_a_large_batch_is_split_across_cards_by_the_runtime() -> None:
    platform = linear_platform(cards=4, host=HOST, card=CARD)
    one = arrivals([0.0], [700])
    whole = simulate(platform, one, settings=ServingSettings(
        batching=BatchingConfig(max_queue_work_ms=0.0), max_card_rows=None, min_split_rows=0, host_dense_max_rows=0))
    split = simulate(platform, one, settings=ServingSettings(
        batching=BatchingConfig(max_queue_work_ms=0.0), max_card_rows=256, min_split_rows=0, host_dense_max_rows=0))
    # 700 items >= no_wait_rows (256): the batch leaves without waiting out the window
    assert whole.latency_ms["max"] == pytest.approx((host(700) + card(700)) * 1e3)
    # 700 items over 256-item cards: 3 parts of 234, 233, 233 run at once; the largest decides.
    assert split.latency_ms["max"] == pytest.approx((host(700) + card(234)) * 1e3)
    assert split.card_batches == 3


def test_changing_the_servers_code_changes_the_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime that splits batches is sixfold.server.execution.runtime's: patch it, and the simulation follows."""
    platform = linear_platform(cards=4, host=HOST, card=CARD)
    one = arrivals([0.0], [700])
    before = simulate(platform, one, settings=ServingSettings(batching=BatchingConfig(max_queue_work_ms=0.0),
                                                               host_dense_max_rows=0))
    monkeypatch.setattr(server_runtime.PlanRuntime, "_parts", lambda self, rows, free: 1)
    after = simulate(platform, one, settings=ServingSettings(batching=BatchingConfig(max_queue_work_ms=0.0),
                                                              host_dense_max_rows=0))
    assert before.card_batches == 4 and after.card_batches == 1
    assert after.latency_ms["max"] - before.latency_ms["max"] == pytest.approx((card(700) - card(175)) * 1e3)


def test_the_least_loaded_router_spreads_batches_over_cards() -> None:
    platform = linear_platform(cards=3, host=HOST, card=CARD)
    traffic = parse_traffic("constant", "fixed:50")
    result = simulate(platform, traffic.draw(600.0, 2.0, 1.0), settings=settings(max_batch_rows=50))
    cards = [result.utilisation[f"card{i}"] for i in range(3)]
    assert max(cards) - min(cards) < 0.01
    assert sum(cards) == pytest.approx(600 * card(50), rel=0.01)


def test_overload_is_refused_by_the_servers_admission() -> None:
    platform = linear_platform(cards=1, host=HOST, card=CARD)
    traffic = parse_traffic("poisson", "fixed:100")
    capacity = 1 / card(100)
    bounded = simulate(platform, traffic.draw(2 * capacity, 2.0, 1.0), settings=settings(max_queue_size=16))
    assert bounded.errors.get("overloaded", 0) > 0.3 * bounded.requests
    assert bounded.queue_len["max"] <= 16
    assert bounded.ok + sum(bounded.errors.values()) == bounded.requests


def test_a_run_is_deterministic_for_a_seed() -> None:
    platform = linear_platform(cards=2, host=HOST, card=CARD, host_dense=(0.1e-3, 30e-6), per_request_s=60e-6)
    traffic = parse_traffic("bursty", "mlperf")
    runs = [simulate(platform, traffic.draw(150.0, 3.0, 1.0, seed=7), settings=ServingSettings(), warmup_s=0.5)
            for _ in range(2)]
    assert np.array_equal(runs[0].latencies_s, runs[1].latencies_s, equal_nan=True)
    assert runs[0].summary() | {"wall_s": 0} == runs[1].summary() | {"wall_s": 0}
    other = simulate(platform, traffic.draw(150.0, 3.0, 1.0, seed=8), settings=ServingSettings(), warmup_s=0.5)
    assert not np.array_equal(other.latencies_s, runs[0].latencies_s)


def test_time_parallel_segments_agree_with_one_process() -> None:
    platform = linear_platform(cards=2, host=HOST, card=CARD, per_request_s=20e-6)
    traffic = parse_traffic("poisson", "fixed:50")
    arrivals = traffic.draw(800.0, 31.0, 1.0, seed=2)
    one = simulate(platform, arrivals, settings=ServingSettings(), warmup_s=1.0)
    two = simulate(platform, arrivals, settings=ServingSettings(), warmup_s=1.0, jobs=2)
    assert two.jobs == 2 and two.requests == one.requests and two.ok == one.ok
    # Far below saturation a segment's 2 s warm-up leaves it in the same state: the same latencies.
    assert np.allclose(two.latencies_s, one.latencies_s, atol=1e-9)
    assert two.utilisation["card0"] == pytest.approx(one.utilisation["card0"], abs=1e-3)
