"""Card gate: the cards go to whole batches in arrival order, each batch taking the cards it can use.

Without it a batch is split over the cards that are idle when it arrives. A batch that
arrives while another one's parts hold the cards then goes whole to one card, behind
that card's part, and runs at one card's speed while the other cards fall idle
again. With the gate it waits for the earlier batch's parts instead, and then runs split
over as many cards as it can use: batches are served one after another at the speed of all
the cards, as the ideal FIFO server serves them, and batches that need fewer cards than
there are run side by side.

The first batch in line does not always wait for every card it could use: when fewer are
idle, it starts on those if, by the cost model, it would finish sooner than by waiting for
the rest to be released (each grant's expected end is known). Behind it, a batch starts
ahead of its turn only on cards the first one cannot use yet and only if, by the cost
model, it is done before the first one could start (EASY backfilling): a stream of small
batches cannot starve a large one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CardGate", "Grant", "CARD_SCHEDULING"]

CARD_SCHEDULING = ("fifo", "greedy")
"""The runtime's policies (``PlanRuntime``'s ``card_scheduling``): "fifo" is this gate, "greedy" the idle cards."""

PartSeconds = Callable[[int], float]
"""Expected seconds of a batch split over ``n`` cards (its largest part's), by the cost model."""


@dataclass(eq=False)
class Grant:
    """Cards held by one batch, and when its parts are expected to be done."""

    slots: int
    """Cards still held: a batch gives each back as its part finishes."""
    expected_end: float


@dataclass(eq=False)
class _Request:
    slots: int
    seconds: PartSeconds | None
    future: asyncio.Future[Grant]


class CardGate:
    """Hands out card slots, first come first served; ``capacity()`` is the number of cards in rotation now.

    A request for more slots than there are cards gets them all. When no card is in
    rotation a request is granted at once (the runtime then falls back or fails the batch):
    nothing waits on cards that are not there. Call ``changed()`` when the capacity changes.
    """

    def __init__(self, capacity: Callable[[], int], clock: Callable[[], float] = time.perf_counter) -> None:
        self._capacity = capacity
        self._clock = clock
        self._grants: set[Grant] = set()
        self._waiting: deque[_Request] = deque()
        self.waits = 0
        """Batches that had to wait for cards."""
        self.early_starts = 0
        """First-in-line batches started on fewer cards than they wanted, as finishing sooner than waiting."""
        self.backfills = 0
        """Batches started ahead of the first in line, on cards it could not use before they were done."""

    @property
    def held(self) -> int:
        """Slots held by batches now."""
        return sum(grant.slots for grant in self._grants)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _first_in_line(self, request: _Request, capacity: int, free: int, now: float) -> tuple[int | None, float]:
        """-> (slots the first request in line gets now, or None: it waits; when it would have all it wants)."""
        want = max(1, min(request.slots, capacity))
        if free >= want or free == capacity:
            return want, now
        ready, at = free, now  # when ``want`` cards would be free, by the grants' expected ends
        for grant in sorted(self._grants, key=lambda g: g.expected_end):
            ready, at = ready + grant.slots, max(now, grant.expected_end)
            if ready >= want:
                break
        seconds = request.seconds
        if free > 0 and seconds is not None and now + seconds(free) <= at + seconds(want):
            self.early_starts += 1
            return free, now
        return None, at

    async def acquire(self, slots: int, seconds: PartSeconds | None = None) -> Grant:
        """Wait for ``slots`` cards (at most the cards in rotation), in line behind every earlier request.

        ``seconds(n)``: the batch's expected time on ``n`` cards. With it, the first batch in
        line may start on fewer cards, and a later batch may start on idle cards before the
        first one can (see the module docstring); without it, a batch waits for all it wants.
        """
        request = _Request(slots, seconds, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        self._grant()
        if not request.future.done():
            self.waits += 1
        try:
            return await request.future
        except asyncio.CancelledError:
            future = request.future
            if future.done() and not future.cancelled():  # granted, then cancelled before it ran: give them back
                self.release(future.result())
            else:
                self._waiting.remove(request)
                self._grant()  # it may have held up requests behind it
            raise

    def release(self, grant: Grant, slots: int | None = None) -> None:
        """Give back ``slots`` of the grant's cards (None: all it still holds), e.g. as each part finishes."""
        grant.slots -= grant.slots if slots is None else min(slots, grant.slots)
        if not grant.slots:
            self._grants.discard(grant)
        self._grant()

    def changed(self) -> None:
        """The number of cards in rotation changed: grant what now fits."""
        self._grant()

    def _give(self, request: _Request, slots: int) -> None:
        seconds = request.seconds
        grant = Grant(slots, self._clock() + (seconds(slots) if seconds is not None else 0.0))
        self._grants.add(grant)
        request.future.set_result(grant)

    def _grant(self) -> None:
        capacity = self._capacity()
        now = self._clock()
        free = capacity - self.held
        at = now
        while self._waiting:
            granted, at = self._first_in_line(self._waiting[0], capacity, free, now)
            if granted is None:
                break
            self._give(self._waiting.popleft(), granted)
            free -= granted
        # Backfill: a later request that would be done on the idle cards before the first in line
        # could start there does not delay it (EASY backfilling).
        for request in list(self._waiting)[1:]:
            if free <= 0:
                break
            slots = max(1, min(request.slots, free))
            if request.seconds is not None and now + request.seconds(slots) <= at:
                self._waiting.remove(request)
                self._give(request, slots)
                free -= slots
                self.backfills += 1
