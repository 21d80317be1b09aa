"""Card scheduling on the virtual clock: with the card gate, six cards serve queries as one FIFO server six times as fast.

Each query is its own batch, every query is large enough to split over all six cards, the
host stage and front end are free and the cards take 20 us an item with no fixed cost. Then
"fifo" is exactly the ideal FIFO server at six cards' speed (Lindley's recursion,
``sixfold.loadgen.ideal``), while "greedy" sends a query that arrives while the cards are busy
whole to one card, at a sixth of the speed.
"""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen.ideal import ideal_latencies
from sixfold.loadgen.stats import percentiles
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.simulate.engine import ServingSettings, simulate
from sixfold.simulate.traffic import Arrivals

from tests.simulate.factories import linear_platform

PER_ITEM = 20e-6
CARDS = 6


def settings(scheduling: str, *, min_split_rows: int = 64) -> ServingSettings:
    # max_batch_rows 1: every query is over it, so each leaves alone at once (a batch of one)
    return ServingSettings(batching=BatchingConfig(max_batch_rows=1, max_queue_size=0, max_queue_work_ms=0.0),
                           max_card_rows=None, min_split_rows=min_split_rows, host_dense_max_rows=0,
                           card_scheduling=scheduling)


def two_queries(gap_s: float) -> Arrivals:
    return Arrivals(offsets=np.array([0.0, gap_s]), items=np.array([600, 600]), ids=np.array([600, 600]),
                    rate=1 / gap_s, window_s=1.0)


def test_a_query_arriving_while_the_cards_are_busy_waits_for_all_of_them_instead_of_taking_one() -> None:
    platform = linear_platform(cards=CARDS, card=(0.0, PER_ITEM))
    fifo = simulate(platform, two_queries(0.001), settings=settings("fifo"))
    greedy = simulate(platform, two_queries(0.001), settings=settings("greedy"))
    # the first: 6 parts of 100 items, 2 ms. The second, 1 ms later: waits 1 ms, then 6 parts (2 ms) ...
    assert fifo.latencies_s == pytest.approx([0.002, 0.003], abs=1e-9)
    # ... or, greedy, all 600 items on the least-loaded card, after its part of the first: 1 + 12 ms
    assert greedy.latencies_s == pytest.approx([0.002, 0.013], abs=1e-9)


def poisson(rate: float, sizes: np.ndarray, seed: int) -> Arrivals:
    offsets = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, sizes.size))
    return Arrivals(offsets=offsets, items=sizes, ids=sizes, rate=rate, window_s=float(offsets[-1]) + 1e-3)


@pytest.mark.parametrize("spread, rho", [(False, 0.6), (True, 0.8)], ids=["600-items", "402-798-items"])
def test_fifo_cards_are_the_ideal_fifo_server_at_all_the_cards_speed(spread: bool, rho: float) -> None:
    """Sizes are multiples of 6, so the parts are equal and no rounding adds up along a busy period."""
    platform = linear_platform(cards=CARDS, card=(0.0, PER_ITEM))
    rng = np.random.default_rng(4)
    sizes = CARDS * (rng.integers(67, 134, 2000) if spread else np.full(2000, 100))
    speed = CARDS / PER_ITEM
    arrivals = poisson(rho * speed / sizes.mean(), sizes, seed=5)
    fifo = simulate(platform, arrivals, settings=settings("fifo"))
    expected = ideal_latencies(arrivals.items, np.diff(arrivals.offsets, prepend=0.0), speed)
    assert fifo.latencies_s == pytest.approx(expected, abs=1e-9)
    greedy = simulate(platform, arrivals, settings=settings("greedy"))
    assert percentiles(greedy.latencies_s * 1e3)["p99"] > 1.25 * percentiles(fifo.latencies_s * 1e3)["p99"]


def test_small_queries_share_the_cards_side_by_side() -> None:
    """Queries of 100 items take one card each (parts of >= 64): six at once run together, none waits."""
    platform = linear_platform(cards=CARDS, card=(0.0, PER_ITEM))
    arrivals = Arrivals(offsets=np.arange(6) * 1e-4, items=np.full(6, 100), ids=np.full(6, 100), rate=1e4,
                        window_s=1.0)
    fifo = simulate(platform, arrivals, settings=settings("fifo"))
    assert fifo.latencies_s == pytest.approx(np.full(6, 100 * PER_ITEM), abs=1e-9)
