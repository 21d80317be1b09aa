"""Router: sends each batch to the card with the fewest outstanding rows (ties: least recently used).

Counting rows, not batches, matters because a batch can hold 1 or 1000 items.
Each card also carries the expected seconds of the work it holds
(``outstanding_s``), so the runtime can give a batch a hang deadline that
includes its wait behind the card's earlier batches.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

__all__ = ["LeastLoadedRouter", "CardLoad", "NoHealthyCard"]


class NoHealthyCard(RuntimeError):
    """Every card is out of rotation (or excluded for this batch)."""


@dataclass
class CardLoad:
    outstanding_rows: int = 0
    outstanding_batches: int = 0
    outstanding_s: float = 0.0
    """Expected card seconds of the batches outstanding (the runtime's cost-model price)."""
    last_used: int = -1
    batches: int = 0
    rows: int = 0
    healthy: bool = True
    failures: int = 0
    busy_s: float = 0.0
    """Seconds the card held at least one batch, up to its last idle moment (``busy_seconds``: up to now)."""
    busy_since: float = 0.0


class LeastLoadedRouter:
    def __init__(self, cards: int) -> None:
        if cards < 1:
            raise ValueError(f"router needs at least one card, got {cards}")
        self.loads = [CardLoad() for _ in range(cards)]
        self._tick = itertools.count()

    def acquire(self, rows: int, exclude: frozenset[int] | set[int] = frozenset(), *,
                idle_only: bool = False) -> int:
        """Pick a healthy card (not in ``exclude``; with ``idle_only``, holding no batch) for a batch
        of ``rows``; count it as outstanding."""
        candidates = [i for i, load in enumerate(self.loads) if load.healthy and i not in exclude
                      and not (idle_only and load.outstanding_batches)]
        if not candidates:
            down = [i for i, load in enumerate(self.loads) if not load.healthy]
            raise NoHealthyCard(f"no {'idle ' if idle_only else ''}healthy card left for this batch "
                                f"(out of rotation: {down}, tried: {sorted(exclude)})")
        index = min(candidates, key=lambda i: (self.loads[i].outstanding_rows, self.loads[i].last_used))
        load = self.loads[index]
        if not load.outstanding_batches:
            load.busy_since = time.perf_counter()
        load.outstanding_rows += rows
        load.outstanding_batches += 1
        load.last_used = next(self._tick)
        return index

    def charge(self, index: int, seconds: float) -> float:
        """Add a just-acquired batch's expected ``seconds`` to card ``index``; returns the seconds queued ahead of it."""
        load = self.loads[index]
        ahead = load.outstanding_s
        load.outstanding_s += seconds
        return ahead

    def release(self, index: int, rows: int, seconds: float = 0.0) -> None:
        load = self.loads[index]
        load.outstanding_rows -= rows
        load.outstanding_batches -= 1
        # NOTE: float sums drift; an idle card holds exactly nothing
        load.outstanding_s = load.outstanding_s - seconds if load.outstanding_batches else 0.0
        if not load.outstanding_batches:
            load.busy_s += time.perf_counter() - load.busy_since
        load.batches += 1
        load.rows += rows

    def busy_seconds(self, index: int) -> float:
        """Seconds card ``index`` has held at least one batch so far (its utilisation is this over wall time).

        Read from the metrics thread while the event loop writes: a read racing a release can come
        out a little low once, so a reader that needs a counter keeps the largest value it saw.
        """
        load = self.loads[index]
        busy = load.busy_s
        return busy + (time.perf_counter() - load.busy_since if load.outstanding_batches else 0.0)

    def mark_down(self, index: int) -> None:
        self.loads[index].healthy = False
        self.loads[index].failures += 1

    def mark_up(self, index: int) -> None:
        self.loads[index].healthy = True

    @property
    def healthy(self) -> list[int]:
        return [i for i, load in enumerate(self.loads) if load.healthy]
