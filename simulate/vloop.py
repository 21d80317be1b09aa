"""An asyncio event loop on a virtual clock: coroutines run unchanged, waits take no real time.

``VirtualTimeLoop.time()`` is a virtual clock that starts at 0. Whenever the loop has
nothing ready to run, instead of blocking in ``select`` until its next timer, it jumps
the clock to that timer and runs it. So ``asyncio.sleep(0.5)``, ``call_later``,
``asyncio.wait(..., timeout=...)`` and ``asyncio.timeout`` all behave as in real time,
in no real time: the server's batcher and runtime (which read their clock from the
loop or take it injected) run as they do in production, on simulated seconds.

Guards, so a simulation never hangs:

* ``max_events``: the loop counts the callbacks it runs; past the limit it raises
  ``SimulationLimit`` out of ``run_until_complete``.
* ``max_time_s``: a timer beyond this virtual time raises ``SimulationLimit``.
* Nothing ready and no timer: the simulated system waits for something that can never
  happen in virtual time (a deadlock); the loop waits for a worker thread's wake-up for
  ``thread_grace_s`` real seconds (``asyncio.to_thread`` still works: it takes no virtual
  time), then raises ``SimulationDeadlock``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from typing import Any

__all__ = ["VirtualTimeLoop", "SimulationLimit", "SimulationDeadlock", "run_virtual"]


class SimulationLimit(RuntimeError):
    """The simulation ran past its event or virtual-time budget."""


class SimulationDeadlock(RuntimeError):
    """Nothing is ready and nothing is scheduled: the simulated system can never make progress."""


class _VirtualSelector(selectors.BaseSelector):
    """Wraps the real selector (the loop's self-pipe lives there) and never waits on it."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.get_key(fileobj)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return self._real.select(0)  # NOTE: never blocks; VirtualTimeLoop._run_once does the waiting


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock is virtual (see the module docstring)."""

    def __init__(self, *, max_events: int | None = None, max_time_s: float | None = None,
                 thread_grace_s: float = 5.0) -> None:
        super().__init__(_VirtualSelector())
        self._now = 0.0
        self._heap: list[tuple[float, int, asyncio.TimerHandle]] = []
        """Timers as (when, sequence, handle): tuples compare in C, and equal times keep their order."""
        self._seq = itertools.count()
        self._thread_grace = thread_grace_s
        self.max_events = max_events
        self.max_time_s = max_time_s
        self.events = 0
        """Callbacks run so far (ready handles and due timers)."""
        self.jumps = 0
        """Times the clock jumped ahead to the next timer."""

    def time(self) -> float:
        return self._now

    # NOTE: call_soon and call_at without the checks of the base loop (closed, thread, debug):
    # the simulation makes a handful of these per request, and nothing else runs on this loop.
    def call_soon(self, callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def get_debug(self) -> bool:
        return False

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._heap, (when, next(self._seq), timer))
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _jump(self) -> None:
        """Nothing is ready: jump to the earliest timer, or fail when there is none (a deadlock)."""
        scheduled = self._heap
        if self._default_executor is not None:  # type: ignore[attr-defined]
            # NOTE: a worker thread (asyncio.to_thread) may be about to call back: take its wake-up first.
            self._process_events(self._selector._real.select(0 if scheduled else self._thread_grace))  # type: ignore[attr-defined]
            if self._ready:  # type: ignore[attr-defined]
                return
        if not scheduled:
            raise SimulationDeadlock(
                f"virtual time {self._now:.6f} s: nothing is ready and nothing is scheduled "
                "(the simulated system waits for an event that never comes)")
        when = scheduled[0][0]
        if self.max_time_s is not None and when > self.max_time_s:
            raise SimulationLimit(f"virtual time would pass {self.max_time_s:g} s (next timer at {when:.3f} s)")
        if when > self._now:
            self._now = when
            self.jumps += 1

    def _run_once(self) -> None:
        """One iteration: drop cancelled timers, jump the clock if idle, run what is due.

        NOTE: BaseEventLoop._run_once less the selector round-trip (nothing here does I/O) and
        the debug timing; the order in which callbacks run is the same.
        """
        ready = self._ready  # type: ignore[attr-defined]
        scheduled = self._heap
        count = len(scheduled)
        if count > 100 and self._timer_cancelled_count / count > 0.5:  # type: ignore[attr-defined]
            kept = []
            for entry in scheduled:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._heap = scheduled = kept
            self._timer_cancelled_count = 0  # type: ignore[attr-defined]
        else:
            while scheduled and scheduled[0][2]._cancelled:
                self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
                heapq.heappop(scheduled)[2]._scheduled = False
        if not ready and not self._stopping:  # type: ignore[attr-defined]
            self._jump()
        end_time = self._now + self._clock_resolution  # type: ignore[attr-defined]
        heappop = heapq.heappop
        while scheduled and scheduled[0][0] < end_time:
            handle = heappop(scheduled)[2]
            handle._scheduled = False
            ready.append(handle)
        todo = len(ready)
        self.events += todo
        if self.max_events is not None and self.events > self.max_events:
            raise SimulationLimit(f"more than {self.max_events:,} events by virtual time {self._now:.3f} s")
        popleft = ready.popleft
        for _ in range(todo):
            handle = popleft()
            if handle._cancelled:
                continue
            # NOTE: Handle._run inlined (one Python frame less per callback, ~12 callbacks a request)
            try:
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:  # as Handle._run: report it, keep the loop going
                self.call_exception_handler({"message": f"Exception in callback {handle!r}", "exception": exc,
                                             "handle": handle})
        handle = None  # noqa: F841 - breaks a cycle when a callback raised


def run_virtual(coro: Any, *, max_events: int | None = None, max_time_s: float | None = None) -> Any:
    """Run ``coro`` to completion on a fresh ``VirtualTimeLoop``; closes the loop (and its tasks) after."""
    loop = VirtualTimeLoop(max_events=max_events, max_time_s=max_time_s)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_all(loop)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: VirtualTimeLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.max_events = None  # cancelling may take a few more callbacks
    loop.max_time_s = None
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
