"""The open-loop driver: send every request at its scheduled time, never waiting for answers.

Each send starts its own task, so a slow or stalled server delays nothing that
comes after it. Latency is measured from the SCHEDULED time, not the actual
send, so any lateness of the generator itself is charged to the latency
rather than hidden (no coordinated omission); that lateness is also recorded
as send lag. After the last send, in-flight requests get ``drain_timeout_s``
to answer; those still open are cancelled and count as errors "timeout". A run
therefore always ends, after at most (last offset + drain timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from sixfold.loadgen.clock import Clock, MonotonicClock
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.transport import RequestFailed

__all__ = ["OpenLoopDriver", "ClosedLoopDriver", "SendFn", "TIMEOUT"]

SendFn = Callable[[int], Awaitable[None]]
"""Sends request number ``i``; raises ``RequestFailed`` (or anything) if it failed."""
TIMEOUT = "timeout"


async def _attempt(send: SendFn, record: RunRecord, i: int, clock: Clock) -> None:
    """Send request ``i`` and record how it ended (it has been marked sent)."""
    try:
        await send(i)
    except asyncio.CancelledError:
        # NOTE: only the drain deadline (or the run's own cancellation) cancels a
        # request; either way it got no answer in time.
        record.mark_error(i, clock.now() - record.t0, TIMEOUT)
    except RequestFailed as exc:
        record.mark_error(i, clock.now() - record.t0, exc.reason)
    except Exception as exc:  # noqa: BLE001 - a client bug still counts, never kills the run
        record.mark_error(i, clock.now() - record.t0, f"client_{type(exc).__name__}")
    else:
        record.mark_ok(i, clock.now() - record.t0)


class OpenLoopDriver:
    """Runs one schedule of offsets against ``send``; see the module docstring for the semantics."""

    def __init__(self, send: SendFn, *, clock: Clock | None = None, drain_timeout_s: float = 10.0) -> None:
        self.send = send
        self.clock = clock or MonotonicClock()
        self.drain_timeout_s = drain_timeout_s

    async def run(self, record: RunRecord) -> RunRecord:
        """Send request ``i`` at ``record.due[i]`` seconds from now; return it when all are settled.

        ``record`` is filled in as the run goes (live progress reads it).
        """
        tasks: set[asyncio.Task[None]] = set()
        idle = asyncio.Event()
        idle.set()
        clock = self.clock

        async def one(i: int) -> None:
            record.mark_sent(i, clock.now() - record.t0)
            await _attempt(self.send, record, i, clock)

        def settled(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not tasks:
                idle.set()

        record.t0 = clock.now()
        try:
            for i, offset in enumerate(record.due.tolist()):
                due = record.t0 + offset
                if clock.now() < due:
                    await clock.sleep_until(due)
                task = asyncio.get_running_loop().create_task(one(i))
                tasks.add(task)
                idle.clear()
                task.add_done_callback(settled)
            await self._drain(idle, tasks)
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        return record

    async def _drain(self, idle: asyncio.Event, tasks: set[asyncio.Task[None]]) -> None:
        if idle.is_set():
            return
        deadline = self.clock.now() + self.drain_timeout_s
        timer = asyncio.ensure_future(self.clock.sleep_until(deadline))
        waiter = asyncio.ensure_future(idle.wait())
        try:
            await asyncio.wait({timer, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            waiter.cancel()


class ClosedLoopDriver:
    """Keeps ``concurrency`` requests outstanding: each of N workers sends, waits, sends again.

    Closed loop measures what a server sustains at a fixed number of users
    (like perf_analyzer's ``--concurrency-range``); its latency is from the
    actual send (each request is "due" when its worker sends it). Workers stop
    starting requests at ``window_s`` or after ``limit`` requests; requests
    still open then get ``drain_timeout_s`` before they count as "timeout".
    ``items_of(i)`` gives request ``i``'s item count (for the record).
    """

    def __init__(self, send: SendFn, items_of: Callable[[int], int], *, concurrency: int, window_s: float,
                 limit: int | None = None, clock: Clock | None = None, drain_timeout_s: float = 10.0) -> None:
        self.send, self.items_of = send, items_of
        self.concurrency, self.window_s, self.limit = concurrency, window_s, limit
        self.clock = clock or MonotonicClock()
        self.drain_timeout_s = drain_timeout_s

    async def run(self, record: RunRecord) -> RunRecord:
        """Fill the (growing) ``record`` until the window or the limit ends; returns it trimmed."""
        clock = self.clock
        record.t0 = clock.now()
        end = record.t0 + self.window_s

        async def worker() -> None:
            while True:
                now = clock.now()
                if now >= end or (self.limit is not None and record.size >= self.limit):
                    return
                i = record.add(now - record.t0, self.items_of(record.size))
                record.mark_sent(i, now - record.t0)
                await _attempt(self.send, record, i, clock)

        loop = asyncio.get_running_loop()
        workers = [loop.create_task(worker()) for _ in range(self.concurrency)]
        timer = asyncio.ensure_future(clock.sleep_until(end + self.drain_timeout_s))
        try:
            await asyncio.wait({timer, *workers}, return_when=asyncio.FIRST_COMPLETED)
            pending = {w for w in workers if not w.done()}
            while pending and not timer.done():
                await asyncio.wait({timer, *pending}, return_when=asyncio.FIRST_COMPLETED)
                pending = {w for w in pending if not w.done()}
        finally:
            timer.cancel()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return record.trim()
