"""The open-loop driver on a fake clock: exact send times, latency from the schedule, drain, errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sixfold.loadgen import OpenLoopDriver, RequestFailed, RunRecord
from sixfold.loadgen.record import ERROR, OK

from tests.loadgen.fake_clock import FakeClock, running


def items(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.int64)


async def test_sends_on_schedule_without_waiting_for_answers():
    clock = FakeClock()
    offsets = np.arange(10) * 0.1  # one request every 100 ms, each answered after 1 s

    async def send(i: int) -> None:
        await clock.sleep_until(clock.now() + 1.0)

    async with running(clock):
        record = await OpenLoopDriver(send, clock=clock).run(RunRecord(offsets, items(10)))
    assert np.allclose(record.sent, offsets)  # open loop: never held back by slow answers
    assert np.allclose(record.latency(), 1.0)
    assert np.all(record.status == OK) and record.sent_count == record.finished == 10


async def test_generator_lag_is_recorded_and_charged_to_latency():
    clock = FakeClock()
    offsets = np.arange(5) * 0.01

    async def send(i: int) -> None:
        if i == 1:
            clock.burn(0.05)  # the generator itself stalls for 50 ms
        await clock.sleep_until(clock.now() + 0.002)

    async with running(clock):
        record = await OpenLoopDriver(send, clock=clock).run(RunRecord(offsets, items(5)))
    lag = record.send_lag()
    assert lag[0] == 0 and lag[1] == 0
    assert lag[2] == pytest.approx(0.04) and lag[3] == pytest.approx(0.03)
    # Latency counts from the scheduled time, so the generator's lateness is not hidden.
    assert record.latency()[2] == pytest.approx(0.04 + 0.002)


async def test_drain_timeout_turns_unanswered_requests_into_timeouts():
    clock = FakeClock()
    offsets = np.array([0.0, 0.1, 0.2])

    async def send(i: int) -> None:
        await clock.sleep_until(clock.now() + (0.05 if i == 0 else 100.0))

    async with running(clock):
        driver = OpenLoopDriver(send, clock=clock, drain_timeout_s=0.5)
        record = await driver.run(RunRecord(offsets, items(3)))
    assert record.status.tolist() == [OK, ERROR, ERROR]
    assert record.reasons == {1: "timeout", 2: "timeout"}
    assert record.done[1] == pytest.approx(0.7)  # last send at 0.2 + 0.5 s drain: the run is bounded
    assert record.sent_count == record.finished


async def test_failures_are_counted_by_reason():
    clock = FakeClock()

    async def send(i: int) -> None:
        await clock.sleep_until(clock.now() + 0.01)
        if i % 3 == 1:
            raise RequestFailed("unavailable", "down")
        if i % 3 == 2:
            raise KeyError("bug")

    async with running(clock):
        record = await OpenLoopDriver(send, clock=clock).run(RunRecord(np.arange(9) * 0.01, items(9)))
    assert record.errors == 6 and record.finished - record.errors == 3
    assert sorted(set(record.reasons.values())) == ["client_KeyError", "unavailable"]


async def test_cancelling_the_run_leaves_no_tasks():
    clock = FakeClock()

    async def send(i: int) -> None:
        await clock.sleep_until(clock.now() + 100.0)

    before = len(asyncio.all_tasks())
    async with running(clock):
        driver = OpenLoopDriver(send, clock=clock)
        run = asyncio.ensure_future(driver.run(RunRecord(np.arange(100) * 0.01, items(100))))
        for _ in range(100_000):
            if clock.now() >= 0.3:
                break
            await asyncio.sleep(0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert len(asyncio.all_tasks()) == before
