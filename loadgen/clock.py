"""The driver's notion of time, injectable so tests can run a schedule exactly and fast."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock"]


class Clock(Protocol):
    """Seconds on a monotonic scale, and a way to wait until a point on it."""

    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class MonotonicClock:
    """Wall time from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, like the event loop's)."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.perf_counter()
        # NOTE: epoll rounds timeouts up to whole milliseconds, so waking is at
        # most ~1 ms late on an idle loop; the driver measures what it really got.
        await asyncio.sleep(delay if delay > 0 else 0)
