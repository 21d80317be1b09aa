"""Router: sends each batch to the card with the fewest outstanding rows (ties: least recently used).

Counting rows, not batches, matters because a batch can hold 1 or 1000 items.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["LeastLoadedRouter", "CardLoad"]


@dataclass
class CardLoad:
    outstanding_rows: int = 0
    outstanding_batches: int = 0
    last_used: int = -1
    batches: int = 0
    rows: int = 0


class LeastLoadedRouter:
    def __init__(self, cards: int) -> None:
        if cards < 1:
            raise ValueError(f"router needs at least one card, got {cards}")
        self.loads = [CardLoad() for _ in range(cards)]
        self._tick = itertools.count()

    def acquire(self, rows: int) -> int:
        """Pick a card for a batch of ``rows`` and count it as outstanding there."""
        index = min(range(len(self.loads)),
                    key=lambda i: (self.loads[i].outstanding_rows, self.loads[i].last_used))
        load = self.loads[index]
        load.outstanding_rows += rows
        load.outstanding_batches += 1
        load.last_used = next(self._tick)
        return index

    def release(self, index: int, rows: int) -> None:
        load = self.loads[index]
        load.outstanding_rows -= rows
        load.outstanding_batches -= 1
        load.batches += 1
        load.rows += rows
