"""One byte budget for request bodies in flight, shared by gRPC and REST, checked before a body is read.

A request holds its share from before its body is read until it is answered, so the bytes of
bodies being received, decoded, queued and run never pass ``limit`` (plus one message: the first
request is always let in, whatever its size). REST knows a body's size from Content-Length; gRPC
learns it only once the message is read, so a gRPC read reserves the message limit while it runs and
then keeps the message's real size. Refusals are immediate when the bytes already held leave no
room; a read that only waits for other reads to finish waits (up to a timeout) instead, so a burst
of small requests is not refused for the few large reservations of reads still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sixfold.server.transport.deadline import within

__all__ = ["ReceiveBudget"]


class ReceiveBudget:
    """Bytes held by requests in flight (event-loop local; not thread-safe)."""

    def __init__(self, limit: int, max_message_bytes: int) -> None:
        self.limit = limit
        """0: no bound (every reservation succeeds, and is still counted)."""
        self.max_message_bytes = max_message_bytes
        self.held = 0
        """Bytes reserved now, by reads running (the message limit each) and bodies read (their size)."""
        self.reading = 0
        """gRPC reads running, each holding ``max_message_bytes`` of ``held``."""
        self.refused = 0
        self.peak = 0
        """Most bytes held at once so far."""
        self._waiting = 0
        self._changed: asyncio.Condition | None = None
        self.unread_refusal: Callable[[float | None], str | None] | None = None
        """``(client deadline s) -> why`` every model would refuse any request now (None: one may be admitted),
        asked before a gRPC message is read, so a request the scheduler refuses costs no read and no decode
        (``sixfold.server.scheduling.unread_admission``). None: not asked."""

    def _fits(self, nbytes: int) -> bool:
        return not self.limit or self.held == 0 or self.held + nbytes <= self.limit

    def try_hold(self, nbytes: int) -> bool:
        """Hold ``nbytes`` now if they fit; False (and counted) if not."""
        if not self._fits(nbytes):
            self.refused += 1
            return False
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return True

    async def start_read(self, wait_s: float) -> bool:
        """Reserve the message limit for a read whose size is not known yet.

        False at once when the bodies already read leave no room for a largest message; otherwise
        waits up to ``wait_s`` for running reads to settle to their real sizes.
        """
        need = self.max_message_bytes
        settled = self.held - self.reading * need
        if self.limit and settled > 0 and settled + need > self.limit:
            self.refused += 1
            return False
        if not self._fits(need):
            if self._changed is None:
                self._changed = asyncio.Condition()
            self._waiting += 1
            try:
                # NOTE: within(), not asyncio.wait_for: that runs the wait in a task of its own, and another
                # waiter could pass the same check before this one's task is resumed and takes the bytes.
                await within(self._take_when_free(need), wait_s)
                return True
            except TimeoutError:
                self.refused += 1
                return False
            finally:
                self._waiting -= 1
        self._take(need)
        return True

    async def _take_when_free(self, need: int) -> None:
        assert self._changed is not None
        async with self._changed:
            await self._changed.wait_for(lambda: self._fits(need))
            self._take(need)  # in the same step as the check: no other waiter runs in between

    def _take(self, need: int) -> None:
        self.held += need
        self.peak = max(self.peak, self.held)
        self.reading += 1

    def end_read(self, nbytes: int | None) -> None:
        """The read finished: keep ``nbytes`` (the message's size) of its reservation; None: it failed."""
        self.reading -= 1
        self.release(self.max_message_bytes - (nbytes or 0))

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` held; waiting reads may start."""
        self.held -= nbytes
        if self._waiting and nbytes > 0:
            asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()
