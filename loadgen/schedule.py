"""The whole run, decided before the clock starts: when each request goes and which query it carries.

Query sizes are drawn per request from the exact distribution; the payloads
come from a pool holding a few distinct pre-generated queries of each size
that occurs. So the sizes sent follow the distribution exactly, while request
generation (and encoding) never runs during the measured run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.requests import QuerySizes, RequestGenerator

from .arrivals import ArrivalProcess

__all__ = ["Schedule", "QueryPool", "build_schedule"]


@dataclass(frozen=True)
class QueryPool:
    """Encoded queries; ``items[k]`` is the item count of ``payloads[k]``."""

    payloads: tuple[Any, ...]
    items: np.ndarray

    def __len__(self) -> int:
        return len(self.payloads)


@dataclass(frozen=True)
class Schedule:
    """Request ``i`` is due at ``offsets[i]`` seconds and carries pool entry ``query[i]``."""

    offsets: np.ndarray
    query: np.ndarray
    pool: QueryPool

    def __len__(self) -> int:
        return int(self.offsets.size)

    @property
    def items(self) -> np.ndarray:
        """Items per request."""
        return self.pool.items[self.query]


def build_schedule(arrival: ArrivalProcess, qps: float, window_s: float, sizes: QuerySizes,
                   generator: RequestGenerator, encode: Callable[[dict[str, np.ndarray]], Any], *,
                   pool: int, rng: np.random.Generator, limit: int | None = None) -> Schedule:
    """Draw offsets and sizes, generate and encode the pool, assign a pooled query to each request.

    ``pool`` distinct queries are spread evenly over the distinct sizes drawn,
    with at least one query per size.
    """
    offsets = arrival.offsets(qps, window_s, rng, limit)
    drawn = np.asarray(sizes.sample(rng, offsets.size), dtype=np.int64)
    distinct, which = np.unique(drawn, return_inverse=True)
    per_size = max(1, pool // max(1, distinct.size))
    payloads, items = [], []
    for size in distinct:
        for _ in range(per_size):
            payloads.append(encode(generator.make(int(size))))
            items.append(int(size))
    variant = rng.integers(0, per_size, size=offsets.size)
    query = which.reshape(-1).astype(np.int64) * per_size + variant
    return Schedule(offsets, query, QueryPool(tuple(payloads), np.asarray(items, dtype=np.int64)))
