"""The dynamic batcher: rows-bounded merging, the queue delay, failure and shutdown hygiene."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sixfold.server.scheduling.batcher import BatchingConfig, BatchInfo, DynamicBatcher
from sixfold.server.errors import DeadlineExceeded, InternalError, Overloaded, Unavailable
from tests.virtual_time import loop_clock, virtual_time


def _batcher(*args, **kwargs) -> DynamicBatcher:
    """A DynamicBatcher on the running loop's clock (virtual: tests.virtual_time)."""
    return DynamicBatcher(*args, clock=loop_clock(), **kwargs)


def _request(rows: int, value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 2), value, dtype=np.float32)}


class Recorder:
    """A real async 'model' that doubles its input and remembers every batch it saw."""

    def __init__(self, delay: float = 0.0, fail: bool = False, drop_row: bool = False) -> None:
        self.batches: list[int] = []
        self.delay, self.fail, self.drop_row = delay, fail, drop_row

    async def __call__(self, inputs: dict[str, np.ndarray], info: BatchInfo) -> dict[str, np.ndarray]:
        self.batches.append(inputs["x"].shape[0])
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("card on fire")
        y = inputs["x"] * 2
        return {"y": y[:-1] if self.drop_row else y}


@virtual_time
async def test_requests_merge_into_one_batch_and_each_gets_its_own_rows() -> None:
    model = Recorder()
    batcher = _batcher(model, BatchingConfig(max_batch_rows=100, max_queue_delay_microseconds=50_000), max_inflight=2)
    results = await asyncio.gather(*(batcher.submit(_request(r, r), r) for r in (3, 5, 7)))
    assert model.batches == [15]
    for (outputs, info), rows in zip(results, (3, 5, 7)):
        assert outputs["y"].shape == (rows, 2) and np.all(outputs["y"] == 2 * rows)
        assert info.rows == 15 and info.requests == 3
    await batcher.close()


@virtual_time
async def test_batches_never_exceed_max_rows_and_keep_arrival_order() -> None:
    model = Recorder()
    batcher = _batcher(model, BatchingConfig(max_batch_rows=10, max_queue_delay_microseconds=20_000), max_inflight=1)
    results = await asyncio.gather(*(batcher.submit(_request(4, i), 4) for i in range(5)))
    assert model.batches == [8, 8, 4]
    assert [float(o["y"][0, 0]) for o, _ in results] == [0, 2, 4, 6, 8]
    await batcher.close()


@virtual_time
async def test_late_arrivals_that_fill_the_batch_send_it_before_the_delay() -> None:
    """Arrivals while the batch timer runs are not recounted one by one (a lazy wake), but the
    one that fills the batch, or overflows it, must still send it at once."""
    model = Recorder()
    batcher = _batcher(model, BatchingConfig(max_batch_rows=10, max_queue_delay_microseconds=10_000_000),
                             max_inflight=1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = asyncio.ensure_future(batcher.submit(_request(4, 1), 4))
    await asyncio.sleep(0.01)  # the timer is armed for the first request
    second = asyncio.ensure_future(batcher.submit(_request(3, 2), 3))  # 7 rows: keeps waiting
    await asyncio.sleep(0.01)
    assert model.batches == []
    third = asyncio.ensure_future(batcher.submit(_request(3, 3), 3))  # 10 rows: full
    await asyncio.wait_for(asyncio.gather(first, second, third), 2.0)
    fourth = asyncio.ensure_future(batcher.submit(_request(6, 4), 6))
    await asyncio.sleep(0.01)
    fifth = asyncio.ensure_future(batcher.submit(_request(6, 5), 6))  # 12 rows: 6 leave, 6 wait
    await asyncio.sleep(0.05)
    assert model.batches == [10, 6] and loop.time() - started < 2.0 and fourth.done() and not fifth.done()
    fifth.cancel()
    await batcher.close(drain=False)


@virtual_time
async def test_a_query_larger_than_a_batch_runs_alone() -> None:
    model = Recorder()
    batcher = _batcher(model, BatchingConfig(max_batch_rows=10), max_inflight=1)
    (out, info), = await asyncio.gather(batcher.submit(_request(25, 1), 25))
    assert model.batches == [25] and out["y"].shape == (25, 2)
    await batcher.close()


@virtual_time
async def test_zero_delay_does_not_wait_for_company() -> None:
    model = Recorder()
    batcher = _batcher(model, BatchingConfig(max_queue_delay_microseconds=0), max_inflight=1)
    await batcher.submit(_request(1, 1), 1)
    await batcher.submit(_request(1, 1), 1)
    assert model.batches == [1, 1]
    await batcher.close()


@virtual_time
async def test_a_failed_batch_fails_every_request_in_it() -> None:
    batcher = _batcher(Recorder(fail=True), BatchingConfig(max_queue_delay_microseconds=20_000), max_inflight=1)
    results = await asyncio.gather(*(batcher.submit(_request(2, 1), 2) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, InternalError) and "card on fire" in str(r) for r in results)
    # ...and the batcher keeps serving afterwards.
    batcher._run_batch = Recorder()
    out, _ = await batcher.submit(_request(2, 3), 2)
    assert np.all(out["y"] == 6)
    await batcher.close()


@virtual_time
async def test_a_model_that_loses_rows_is_caught() -> None:
    batcher = _batcher(Recorder(drop_row=True), BatchingConfig(), max_inflight=1)
    with pytest.raises(InternalError, match="did not preserve batch size"):
        await batcher.submit(_request(3, 1), 3)
    await batcher.close()


@virtual_time
async def test_close_answers_queued_requests_then_refuses_new_ones() -> None:
    model = Recorder(delay=0.02)
    batcher = _batcher(model, BatchingConfig(max_batch_rows=2, max_queue_delay_microseconds=0), max_inflight=1)
    pending = [asyncio.ensure_future(batcher.submit(_request(2, i), 2)) for i in range(4)]
    await asyncio.sleep(0.005)
    await batcher.close(drain=True)
    assert all(p.done() and not p.exception() for p in pending)
    with pytest.raises(Unavailable):
        await batcher.submit(_request(1, 1), 1)


def test_config_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_rows"):
        BatchingConfig(max_batch_rows=0)
    with pytest.raises(ValueError, match="max_queue_delay"):
        BatchingConfig(max_queue_delay_microseconds=-1)


@virtual_time
async def test_a_full_queue_refuses_at_once_with_resource_exhausted() -> None:
    model = Recorder(delay=0.05)
    batcher = _batcher(model, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0,
                                                   max_queue_size=2), max_inflight=1)
    running = [asyncio.ensure_future(batcher.submit(_request(1, 0), 1))]
    await asyncio.sleep(0.01)  # the first batch is running
    running += [asyncio.ensure_future(batcher.submit(_request(1, i), 1)) for i in (1, 2)]
    await asyncio.sleep(0)  # two queued behind it: the queue is full
    with pytest.raises(Overloaded, match="max_queue_size 2"):
        await batcher.submit(_request(1, 9), 1)
    assert all(not isinstance(r, Exception) for r in await asyncio.gather(*running, return_exceptions=True))
    await batcher.close()


@virtual_time
async def test_a_request_past_its_deadline_is_dropped_before_compute() -> None:
    model = Recorder(delay=0.05)
    batcher = _batcher(model, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0), max_inflight=1)
    slow = asyncio.ensure_future(batcher.submit(_request(1, 1), 1))
    await asyncio.sleep(0.005)
    with pytest.raises(DeadlineExceeded, match="before compute"):
        await batcher.submit(_request(1, 2), 1, timeout_s=0.01)  # waits behind a 50 ms batch
    await slow
    assert model.batches == [1]  # the expired request never reached the model
    await batcher.close()


@virtual_time
async def test_the_default_timeout_applies_when_the_client_sets_none() -> None:
    model = Recorder(delay=0.05)
    batcher = _batcher(model, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0,
                                                   default_timeout_microseconds=10_000), max_inflight=1)
    slow = asyncio.ensure_future(batcher.submit(_request(1, 1), 1, timeout_s=1.0))
    await asyncio.sleep(0.005)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(_request(1, 2), 1)
    await slow
    await batcher.close()


@virtual_time
async def test_a_batch_of_no_wait_rows_leaves_at_once_and_a_smaller_one_waits() -> None:
    """A request of at least ``no_wait_rows`` rows is not held for the window (nothing would join
    it worth the wait); a smaller one is, until an arrival brings the batch to ``no_wait_rows``,
    which sends it at once (the lazy wake must not sleep through that arrival), uncut."""
    model = Recorder()
    config = BatchingConfig(max_batch_rows=1000, max_queue_delay_microseconds=10_000_000, no_wait_rows=8)
    batcher = _batcher(model, config, max_inflight=1)
    big, _ = await asyncio.wait_for(batcher.submit(_request(8, 1), 8), 2.0)  # a 10 s window, not waited out
    assert model.batches == [8] and big["y"].shape == (8, 2)
    first = asyncio.ensure_future(batcher.submit(_request(3, 2), 3))
    await asyncio.sleep(0.01)  # the timer is armed for the first request
    second = asyncio.ensure_future(batcher.submit(_request(3, 3), 3))  # 6 rows: keeps waiting
    await asyncio.sleep(0.01)
    assert model.batches == [8]
    third = asyncio.ensure_future(batcher.submit(_request(4, 4), 4))  # 10 rows >= 8: all three leave together
    await asyncio.wait_for(asyncio.gather(first, second, third), 2.0)
    assert model.batches == [8, 10]
    await batcher.close()


@virtual_time
async def test_no_wait_rows_zero_holds_even_a_large_request_for_the_window() -> None:
    model = Recorder()
    config = BatchingConfig(max_batch_rows=1000, max_queue_delay_microseconds=10_000_000, no_wait_rows=0)
    batcher = _batcher(model, config, max_inflight=1)
    waiting = asyncio.ensure_future(batcher.submit(_request(500, 1), 500))
    await asyncio.sleep(0.05)
    assert model.batches == [] and not waiting.done()
    waiting.cancel()
    await batcher.close(drain=False)
    with pytest.raises(ValueError, match="no_wait_rows"):
        BatchingConfig(no_wait_rows=-1)


@virtual_time
async def test_all_in_dispatch_sends_a_batch_once_every_outstanding_request_is_in() -> None:
    """Closed-loop clients (each sends again only once answered): after the first window shows how
    many keep requests outstanding, a batch leaves as soon as all of them are queued or running,
    not when the window ends. Fewer than that (open-loop gaps) still wait the window."""
    model = Recorder(delay=0.001)
    config = BatchingConfig(max_batch_rows=100, max_queue_delay_microseconds=2_000, all_in_dispatch=True)
    batcher = _batcher(model, config, max_inflight=2)
    loop = asyncio.get_running_loop()
    answered: list[float] = []

    async def client(i: int) -> None:
        await asyncio.sleep(0.0001 * i)  # they start apart, then each sends again when answered
        for _ in range(5):
            await batcher.submit(_request(1, i), 1)
            answered.append(loop.time())

    started = loop.time()
    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(4))), 2.0)
    # the first arrival is a new peak, so it leaves at once; the others gather behind it and leave
    # as soon as all four are in (one running, three queued): 1 + 3 from then on, no window waited
    assert sum(model.batches) == 20
    assert max(model.batches) >= 3, model.batches
    elapsed = loop.time() - started
    assert elapsed < 11 * 0.001, elapsed  # ~2 batch times a round, 5 rounds
    await batcher.close()
    # without it, every batch waits out the window (only 4 clients: never full)
    model = Recorder(delay=0.001)
    batcher = _batcher(model, BatchingConfig(max_batch_rows=100, max_queue_delay_microseconds=2_000), max_inflight=2)
    started = loop.time()
    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(4))), 2.0)
    assert loop.time() - started >= 5 * 0.002
    await batcher.close()


@virtual_time
async def test_all_in_dispatch_keeps_the_window_when_fewer_than_the_recent_peak_are_in() -> None:
    model = Recorder()
    config = BatchingConfig(max_batch_rows=100, max_queue_delay_microseconds=50_000, all_in_dispatch=True)
    batcher = _batcher(model, config, max_inflight=2)
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(batcher.submit(_request(1, i), 1) for i in range(3)))  # a peak of 3
    t0 = loop.time()
    await batcher.submit(_request(1, 9), 1)  # 1 of a recent 3: the others may come, so it waits
    assert loop.time() - t0 == pytest.approx(0.05, abs=1e-4)
    await asyncio.sleep(0.2)  # past the horizon: the peak is what is held now
    t0 = loop.time()
    await batcher.submit(_request(1, 9), 1)
    assert loop.time() - t0 == pytest.approx(0.0, abs=1e-4)
    await batcher.close()
