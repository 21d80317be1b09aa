"""Against queueing theory: set the server up as one FIFO queue and the simulation is sixfold.loadgen.ideal's server.

Each query its own batch (``max_batch_rows`` 1: every query is over it, so each leaves alone at
once), one card, no splitting, no host-dense, no admission, a free host stage and front end:
sixfold is then a single FIFO server whose service time is the card's. Lindley's recursion
(``sixfold.loadgen.ideal.ideal_latencies``) gives every latency exactly, and for Poisson arrivals of one
size the mean wait is Pollaczek-Khinchine's (M/D/1).
"""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen.ideal import ideal_latencies
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.simulate.engine import ServingSettings, simulate
from sixfold.simulate.traffic import parse_traffic

from tests.simulate.factories import linear_platform

PER_ITEM = 20e-6  # the card: 20 us an item, no fixed cost (the ideal server's model)


def one_queue(max_rows: int) -> ServingSettings:
    return ServingSettings(batching=BatchingConfig(max_batch_rows=max_rows, max_queue_size=0, max_queue_work_ms=0.0),
                           max_card_rows=None, min_split_rows=0, host_dense_max_rows=0)


@pytest.mark.parametrize("sizes, rho", [("fixed:100", 0.5), ("fixed:100", 0.9), ("uniform:50-150", 0.8)])
def test_every_latency_is_lindleys(sizes: str, rho: float) -> None:
    platform = linear_platform(cards=1, card=(0.0, PER_ITEM))
    traffic = parse_traffic("poisson", sizes)
    mean = traffic.mean_items()
    rate = rho / (mean * PER_ITEM)
    arrivals = traffic.draw(rate, 10.0, 1.0, seed=3)
    # max_batch_rows 1: every query is over the limit, so each leaves alone at once (a batch of one)
    result = simulate(platform, arrivals, settings=one_queue(1))
    expected = ideal_latencies(arrivals.items, np.diff(arrivals.offsets, prepend=0.0), 1 / PER_ITEM)
    assert result.latencies_s == pytest.approx(expected, abs=1e-9)
    assert result.batches == len(arrivals)


def test_mean_wait_is_pollaczek_khinchine() -> None:
    platform = linear_platform(cards=1, card=(0.0, PER_ITEM))
    service = 100 * PER_ITEM
    rho = 0.8
    arrivals = parse_traffic("poisson", "fixed:100").draw(rho / service, 120.0, 1.0, seed=11)
    result = simulate(platform, arrivals, settings=one_queue(1), warmup_s=5.0)
    wait_ms = result.latency_ms["mean"] - service * 1e3
    theory_ms = rho * service / (2 * (1 - rho)) * 1e3  # M/D/1
    assert wait_ms == pytest.approx(theory_ms, rel=0.05)
    assert result.utilisation["card0"] == pytest.approx(rho, rel=0.02)
