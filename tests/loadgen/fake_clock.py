"""A discrete-event clock for driver tests: time moves only when every task is waiting on it."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

__all__ = ["FakeClock", "running"]


class FakeClock:
    """Implements loadgen's Clock; a background ticker jumps to the next sleeper's deadline."""

    def __init__(self) -> None:
        self.t = 0.0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def burn(self, seconds: float) -> None:
        """Pretend the caller used the CPU for ``seconds`` without yielding."""
        self.t += seconds

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self.t:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (deadline, next(self._seq), future))
        await future

    async def tick_forever(self, settle: int = 30) -> None:
        while True:
            for _ in range(settle):  # let every runnable task reach its next wait
                await asyncio.sleep(0)
            while self._heap and self._heap[0][2].done():
                heapq.heappop(self._heap)  # cancelled sleepers
            if self._heap:
                deadline, _, future = heapq.heappop(self._heap)
                self.t = max(self.t, deadline)
                future.set_result(None)


@contextlib.asynccontextmanager
async def running(clock: FakeClock) -> AsyncIterator[FakeClock]:
    """Run the clock's ticker for the body; stopped (and awaited) on exit."""
    task = asyncio.get_running_loop().create_task(clock.tick_forever())
    try:
        yield clock
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
