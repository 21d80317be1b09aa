"""The virtual-time loop: asyncio's waits take simulated seconds, and a stuck simulation stops."""

from __future__ import annotations

import asyncio
import time

import pytest

from sixfold.simulate.vloop import SimulationDeadlock, SimulationLimit, VirtualTimeLoop, run_virtual


def test_sleeps_timeouts_and_waits_take_virtual_seconds() -> None:
    async def main() -> tuple[float, ...]:
        loop = asyncio.get_running_loop()
        marks = []
        await asyncio.sleep(3600)
        marks.append(loop.time())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2.5):
                await asyncio.sleep(10)
        marks.append(loop.time())
        slow = asyncio.ensure_future(asyncio.sleep(1.0))
        done, pending = await asyncio.wait([slow], timeout=0.25)
        marks.append(loop.time())
        assert pending == {slow}
        await slow
        marks.append(loop.time())
        fired = []
        loop.call_at(loop.time() + 7, fired.append, "a")
        loop.call_at(loop.time() + 7, fired.append, "b")  # equal times keep their order
        await asyncio.sleep(8)
        assert fired == ["a", "b"]
        return tuple(marks)

    started = time.perf_counter()
    assert run_virtual(main()) == (3600.0, 3602.5, 3602.75, 3603.5)
    assert time.perf_counter() - started < 5  # ~4000 simulated seconds, no real waiting


def test_a_worker_thread_takes_no_virtual_time() -> None:
    async def main() -> tuple[int, float]:
        value = await asyncio.to_thread(lambda: 41 + 1)
        return value, asyncio.get_running_loop().time()

    assert run_virtual(main()) == (42, 0.0)


def test_nothing_to_wait_for_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever set it

    with pytest.raises(SimulationDeadlock, match="nothing is ready and nothing is scheduled"):
        run_virtual(main())


def test_event_and_time_budgets_stop_a_runaway_simulation() -> None:
    async def forever() -> None:
        while True:
            await asyncio.sleep(0.001)

    with pytest.raises(SimulationLimit, match="more than 1,000 events"):
        run_virtual(forever(), max_events=1000)
    with pytest.raises(SimulationLimit, match="virtual time would pass 5 s"):
        run_virtual(forever(), max_time_s=5.0)


def test_the_loop_is_a_real_asyncio_loop() -> None:
    loop = VirtualTimeLoop()
    try:
        assert isinstance(loop, asyncio.AbstractEventLoop)
        assert loop.run_until_complete(asyncio.sleep(2, result="x")) == "x"
        assert loop.time() == 2.0
    finally:
        loop.close()
