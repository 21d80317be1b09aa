"""The whole run, decided before the clock starts: when each request goes and which query it carries.

Query sizes are drawn per request from the exact distribution; the payloads
come from a pool holding a few distinct pre-generated queries of each size
that occurs. So the sizes sent follow the distribution exactly, while request
generation (and encoding) never runs during the measured run.

Popular ids can drift (``drift``: the hot set rotates by that fraction of each
table per second). Shifting ids at send time would mean re-encoding every
request, so instead the run is cut into time slices (at most ``MAX_DRIFT_SLICES``,
each at least 1 s) and the pool is built once per slice with every id shifted
by the slice's offset, (id + floor(drift * rows * t)) mod rows; a request
carries a query of its own slice. Sending stays one pre-encoded payload.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.requests import QuerySizes, RequestGenerator
from models.signature import INDICES, LENGTHS

from .arrivals import ArrivalProcess

__all__ = ["Schedule", "QueryPool", "build_schedule", "shift_ids", "drift_slices", "MAX_DRIFT_SLICES"]

MAX_DRIFT_SLICES = 32
"""The pool is built this many times at most when ids drift (memory: pool x slices queries)."""


@dataclass(frozen=True)
class QueryPool:
    """Encoded queries; ``items[k]`` is the item count of ``payloads[k]``.

    ``tensors[k]`` is the query before encoding, kept only when asked (to record a run).
    """

    payloads: tuple[Any, ...]
    items: np.ndarray
    tensors: tuple[dict[str, np.ndarray], ...] | None = None

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


def shift_ids(request: Mapping[str, np.ndarray], table_rows: np.ndarray, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """A copy of ``request`` with table t's ids moved by ``offsets[t]`` (mod its rows): the hot set rotates."""
    lengths = request[LENGTHS]
    tables = lengths.shape[1]
    table = np.repeat(np.tile(np.arange(tables), lengths.shape[0]), lengths.reshape(-1))
    rows = table_rows[table]
    return {**request, INDICES: (request[INDICES] + offsets[table]) % rows}


def drift_slices(window_s: float, drift: float) -> tuple[int, float]:
    """(slice count, slice length in s) for ids drifting at ``drift`` table fractions per second."""
    if drift <= 0:
        return 1, max(window_s, 1e-9)
    count = int(min(MAX_DRIFT_SLICES, max(1, np.ceil(window_s - 1e-9))))
    return count, window_s / count


def build_schedule(arrival: ArrivalProcess, qps: float, window_s: float, sizes: QuerySizes,
                   generator: RequestGenerator, encode: Callable[[dict[str, np.ndarray]], Any], *,
                   pool: int, rng: np.random.Generator, limit: int | None = None, drift: float = 0.0,
                   keep_tensors: bool = False) -> Schedule:
    """Draw offsets and sizes, generate and encode the pool, assign a pooled query to each request.

    ``pool`` distinct queries are spread evenly over the distinct sizes drawn,
    with at least one query per size; with ``drift`` > 0 that pool is repeated,
    ids shifted, once per time slice (see the module docstring).
    """
    offsets = arrival.offsets(qps, window_s, rng, limit)
    drawn = np.asarray(sizes.sample(rng, offsets.size), dtype=np.int64)
    distinct, which = np.unique(drawn, return_inverse=True)
    per_size = max(1, pool // max(1, distinct.size))
    base, items = [], []
    for size in distinct:
        for _ in range(per_size):
            base.append(generator.make(int(size)))
            items.append(int(size))
    variant = rng.integers(0, per_size, size=offsets.size)
    query = which.reshape(-1).astype(np.int64) * per_size + variant
    slices, slice_s = drift_slices(window_s, drift)
    tensors = base
    if slices > 1:
        rows = generator.table_rows
        tensors = []
        for k in range(slices):
            shift = np.floor(drift * rows * (k * slice_s)).astype(np.int64) % rows
            tensors.extend(shift_ids(q, rows, shift) for q in base)
        which_slice = np.minimum((offsets // slice_s).astype(np.int64), slices - 1)
        query = which_slice * len(base) + query
        items = items * slices
    payloads = tuple(encode(q) for q in tensors)
    return Schedule(offsets, query, QueryPool(payloads, np.asarray(items, dtype=np.int64),
                                              tuple(tensors) if keep_tensors else None))
