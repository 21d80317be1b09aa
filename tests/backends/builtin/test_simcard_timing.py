"""simcard timing on a fake clock: service time is the spec's formula, batches queue FIFO, lag is counted.

The device has round numbers (1 GFLOP/s, 2 GB/s memory, 1 GB/s link, 1 ms
link latency, efficiency 1), so every expected time below is worked out by
hand rather than by calling the code under test.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend
from sixfold.backends.builtin.simcard import SimCardBackend, SimCardStats
from tests.backends.factories import Clocked, FakeClock, batch, device, mlp

MLP = mlp(widths=(3, 5), hidden=16)
IN_BYTES_PER_ROW = (3 + 5) * 4     # two float32 inputs
OUT_BYTES_PER_ROW = 1 * 4          # scores [rows, 1] float32


def by_hand(rows: int, *, flops_per_item: float = 1e6, bytes_per_item: float = 0.0, flops: float = 1e9) -> float:
    """transfer in + roofline compute + transfer out, for the factories' unit card."""
    transfer_in = 1e-3 + rows * IN_BYTES_PER_ROW / 1e9
    compute = max(rows * flops_per_item / flops, (MLP.param_bytes + rows * bytes_per_item) / 2e9)
    transfer_out = 1e-3 + rows * OUT_BYTES_PER_ROW / 1e9
    return transfer_in + compute + transfer_out


@pytest.fixture
def clock():
    return FakeClock()


def card(clock: FakeClock, *, functional=None, spec=None, **costs):
    backend = SimCardBackend(clock=clock, sleep=clock.sleep,
                             **({"functional": functional} if functional is not None else {}))
    costs.setdefault("flops_per_item", 1e6)
    return backend.load(MLP.artifact(**costs), spec or device())


@pytest.mark.parametrize("case", ["compute-bound", "memory-bound", "fp16"])
async def test_service_time_is_the_spec_formula(clock, case):
    rows = 4
    if case == "compute-bound":
        exe, want = card(clock), by_hand(rows)
    elif case == "memory-bound":
        exe = card(clock, flops_per_item=0.0, bytes_per_item=1e6)
        want = by_hand(rows, flops_per_item=0.0, bytes_per_item=1e6)
    else:
        exe = card(clock, dtype="fp16", spec=device(peak_flops={"fp32": 1e9, "fp16": 4e9}))
        want = by_hand(rows, flops=4e9)
    clock.now = 10.0
    feed = batch(MLP, rows)
    out = await exe.infer(feed)
    np.testing.assert_allclose(out["scores"], MLP.reference(feed), rtol=1e-5, atol=1e-6)
    assert clock.sleeps == [pytest.approx(want, rel=1e-12)]     # released at arrival + service
    assert exe.busy_until == pytest.approx(10.0 + want, rel=1e-12)
    s = exe.stats()
    assert (s.batches, s.rows, s.lagged_batches, s.outstanding) == (1, rows, 0, 0)
    assert s.modelled_busy_s == pytest.approx(want, rel=1e-12)
    exe.close()


async def test_a_second_batch_queues_behind_the_first(clock):
    exe = card(clock)
    s2, s7 = by_hand(2), by_hand(7)
    await exe.infer(batch(MLP, 2))                      # arrives at 0, card busy until s2
    clock.now = 0.001                                   # arrives while the card is still busy
    await exe.infer(batch(MLP, 7))
    assert clock.sleeps == [pytest.approx(s2), pytest.approx(s2 + s7 - 0.001)]
    assert exe.busy_until == pytest.approx(s2 + s7)
    clock.now = 5.0                                     # the card went idle: starts on arrival
    await exe.infer(batch(MLP, 7))
    assert clock.sleeps[-1] == pytest.approx(s7)
    assert exe.busy_until == pytest.approx(5.0 + s7)
    assert exe.stats().modelled_busy_s == pytest.approx(s2 + 2 * s7)
    exe.close()


async def test_concurrent_batches_are_served_in_arrival_order(clock):
    exe = card(clock)
    feeds = [batch(MLP, rows, seed=rows) for rows in (2, 7, 1)]
    outs = await asyncio.gather(*(exe.infer(f) for f in feeds))
    for feed, out in zip(feeds, outs):
        np.testing.assert_allclose(out["scores"], MLP.reference(feed), rtol=1e-5, atol=1e-6)
    finishes = np.cumsum([by_hand(2), by_hand(7), by_hand(1)])
    assert sorted(clock.sleeps) == pytest.approx(list(finishes))
    assert exe.stats() == SimCardStats(batches=3, rows=10, modelled_busy_s=pytest.approx(finishes[-1]),
                                       actual_compute_s=0.0, outstanding=0)
    exe.close()


async def test_lag_is_counted_when_the_host_is_slower_than_the_card(clock):
    service = by_hand(4)
    slow = Clocked(OnnxRuntimeBackend(), clock, compute_s=0.010)   # every real run takes 10 ms of fake time
    exe = card(clock, functional=slow)
    await exe.infer(batch(MLP, 4))
    assert clock.sleeps == []                            # finished later than modelled: released at once
    s = exe.stats()
    assert (s.batches, s.lagged_batches) == (1, 1)
    assert s.total_lag_s == pytest.approx(0.010 - service)
    assert s.max_lag_s == pytest.approx(0.010 - service)
    assert s.actual_compute_s == pytest.approx(0.010)
    assert s.modelled_busy_s == pytest.approx(service)  # the model does not absorb the lag
    exe.close()


async def test_a_faster_host_waits_for_the_modelled_finish(clock):
    service = by_hand(4)
    exe = card(clock, functional=Clocked(OnnxRuntimeBackend(), clock, compute_s=0.002))
    await exe.infer(batch(MLP, 4))
    assert clock.sleeps == [pytest.approx(service - 0.002)]
    s = exe.stats()
    assert (s.lagged_batches, s.total_lag_s) == (0, 0.0)
    assert s.actual_compute_s == pytest.approx(0.002)
    exe.close()


async def test_lag_accumulates_over_queued_batches(clock):
    service = by_hand(1)
    slow = Clocked(OnnxRuntimeBackend(), clock, compute_s=0.010, gate_open=False)
    exe = card(clock, functional=slow)
    tasks = [asyncio.create_task(exe.infer(batch(MLP, 1))) for _ in range(3)]
    while exe.stats().outstanding < 3:                   # all three arrive at 0 ...
        await asyncio.sleep(0)
    slow.gate.set()                                      # ... before any computes
    await asyncio.gather(*tasks)
    # real finishes at 10, 20, 30 ms; modelled at 1, 2, 3 services
    lags = [0.010 * k - service * k for k in (1, 2, 3)]
    s = exe.stats()
    assert s.lagged_batches == 3
    assert s.total_lag_s == pytest.approx(sum(lags))
    assert s.max_lag_s == pytest.approx(lags[-1])
    exe.close()


async def test_real_clock_releases_no_earlier_than_the_model():
    import time

    spec = device(link_latency_s=0.02)                   # two transfers: at least 40 ms per batch
    exe = SimCardBackend().load(MLP.artifact(flops_per_item=1.0), spec)
    t0 = time.monotonic()
    await exe.infer(batch(MLP, 3))
    assert time.monotonic() - t0 >= 0.04
    assert exe.stats().lagged_batches == 0
    exe.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.0005, 0.003, 0.02]), st.integers(1, 64)), min_size=1, max_size=8))
async def test_timeline_is_fifo_max_of_arrival_and_busy_until(arrivals):
    """For any gaps and sizes: finish_k = max(arrival_k, finish_k-1) + service(rows_k), released at finish_k."""
    clock = FakeClock()
    exe = card(clock)
    finish, total = float("-inf"), 0.0
    for gap, rows in arrivals:
        clock.now += gap
        before = len(clock.sleeps)
        await exe.infer(batch(MLP, rows))
        finish = max(clock.now, finish) + by_hand(rows)
        total += by_hand(rows)
        assert clock.sleeps[before:] == [pytest.approx(finish - clock.now, rel=1e-9, abs=1e-15)]
    assert exe.stats().modelled_busy_s == pytest.approx(total)
    exe.close()
