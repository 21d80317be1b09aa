"""Warm a tiered model's DRAM row cache from a loadgen recording before it serves (``--warm-from``).

A model served with a table memory (``sixfold.backends.host.table_store``) starts with an empty row
cache, so its first batches read almost every row from disk. A recording of earlier
traffic (``sixfold-loadgen --record PATH``, ``sixfold.loadgen.recording``) says which rows the
traffic asks for: its queries' ``sparse_lengths``/``sparse_indices`` go through
``HostEmbeddingStage.warm``, which loads the most wanted rows first with sequential reads,
before the model is added to the server (so before READY).

What is fed: the queries of the recording's pool that its requests carried, each weighted
by how many requests carried it (the whole pool, once each, when it lists no request): rows
are ranked by how many recorded ids ask for them. The report says how many rows were loaded,
the cache fill (rows cached / cache slots), the share of the recorded requests' ids the
warmed cache holds (the hit rate those requests would see, before any eviction) and the
time taken.

A recording that cannot be read whole, whose queries do not rebuild, or that was made
for another model shape (table rows, table count, ids outside the tables) is refused
with a ValueError naming the file. A model without tiered tables has nothing to warm:
that is said, and the file is not read.

NOTE: this reads loadgen's recording format (``sixfold.loadgen.recording``), the one place the
server imports from loadgen; loadgen never imports the server, so there is no cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["WarmReport", "warm_from_recording"]

log = logging.getLogger(__name__)

_LENGTHS, _INDICES = "sparse_lengths", "sparse_indices"


@dataclass(frozen=True)
class WarmReport:
    """What warming one model's row cache did."""

    model: str
    path: str
    queries: int
    """Distinct recorded queries fed."""
    requests: int
    """Requests in the recording (the hit rate is weighted by them)."""
    ids: int
    """Ids of the queries fed."""
    rows_loaded: int
    cached_rows: int
    slots: int
    hit_rate: float
    """Share of the recorded requests' ids whose row the warmed cache holds."""
    seconds: float

    @property
    def fill(self) -> float:
        return self.cached_rows / self.slots if self.slots else 0.0

    def describe(self) -> str:
        return (f"model {self.model}: row cache warmed from {self.path} in {self.seconds:.2f} s: {self.rows_loaded:,} "
                f"rows loaded, ranked over {self.requests:,} recorded requests ({self.queries} distinct queries, "
                f"{self.ids:,} ids); cache fill "
                f"{100 * self.fill:.1f}% ({self.cached_rows:,} of {self.slots:,} slots); hit rate on the recorded "
                f"requests {100 * self.hit_rate:.1f}%")


def _rows_text(rows: Sequence[int]) -> str:
    rows = [int(r) for r in rows]
    if not rows:
        return "no tables"
    if len(set(rows)) == 1:
        return f"{len(rows)} tables of {rows[0]:,} rows"
    return f"{len(rows)} tables of {min(rows):,}..{max(rows):,} rows"


def _check_query(path: str, k: int, query: dict[str, np.ndarray], table_rows: np.ndarray) -> np.ndarray:
    """Each id's table in a recorded query; refuses one that does not fit the model's tables (count, ids in range)."""
    lengths, ids = np.asarray(query[_LENGTHS]), np.asarray(query[_INDICES]).reshape(-1)
    tables = table_rows.shape[0]
    if lengths.ndim != 2 or lengths.shape[1] != tables:
        raise ValueError(f"recording {path!r} was made for another model: its queries have {_LENGTHS} "
                         f"{list(lengths.shape)}, this model has {tables} tables")
    table = np.repeat(np.tile(np.arange(tables), lengths.shape[0]), lengths.reshape(-1).astype(np.int64))
    bad = (ids < 0) | (ids >= table_rows[table])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        t = int(table[i])
        raise ValueError(f"recording {path!r} was made for another model: query {k} asks for row {int(ids[i])} of "
                         f"table {t}, which has {int(table_rows[t]):,} rows")
    return table


def _merge(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys of ``parts`` (keys, weights) with their weights summed."""
    keys = np.concatenate([k for k, _ in parts])
    unique, inverse = np.unique(keys, return_inverse=True)
    return unique, np.bincount(inverse.reshape(-1), weights=np.concatenate([w for _, w in parts]),
                               minlength=unique.shape[0])


def warm_from_recording(stage: Any, path: str | Path, *, model: str) -> WarmReport | None:
    """Warm ``stage``'s row caches (a ``HostEmbeddingStage``) from the recording at ``path``; None if not tiered.

    ValueError (naming the file) for a recording that cannot be read or that does not fit
    this model. Logs the outcome at INFO (event ``table_cache_warmed``).
    """
    name = str(path)
    if stage is None or not getattr(stage, "stores", None):
        log.info("model %s has no tiered tables (no table memory): nothing to warm from %s", model, name,
                 extra={"event": "table_cache_warm_skipped", "model": model})
        return None
    from sixfold.loadgen.recording import load_recording

    start = time.perf_counter()
    recording = load_recording(name)  # ValueError naming the file when it is missing or damaged
    table_rows = np.asarray(stage.table_rows, dtype=np.int64)
    recorded = recording.shape.get("table_rows")
    if recorded is not None and [int(r) for r in recorded] != table_rows.tolist():
        raise ValueError(f"recording {name!r} was made for another model: {_rows_text(recorded)}; model {model} "
                         f"has {_rows_text(table_rows.tolist())}")
    tensors = recording.tensors  # rebuilt from its recipe (and checked) when it stores one
    requests = np.bincount(recording.query, minlength=len(tensors)) if len(recording) else np.ones(len(tensors), int)
    used = np.flatnonzero(requests).tolist()
    if not used:
        raise ValueError(f"recording {name!r} holds no queries to warm from")
    # Distinct (table, id) pairs with how often the recorded requests ask for them, merged a few
    # queries at a time (a pool's ids may be far more than its distinct rows).
    span = int(table_rows.max()) + 1
    keys, weights = np.empty(0, np.int64), np.empty(0, np.float64)
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    pending_size, ids_fed = 0, 0
    for k in used:
        table = _check_query(name, k, tensors[k], table_rows)
        ids = np.asarray(tensors[k][_INDICES]).reshape(-1).astype(np.int64)
        unique, times = np.unique(table * span + ids, return_counts=True)
        pending.append((unique, times * float(requests[k])))
        pending_size += unique.shape[0]
        ids_fed += ids.shape[0]
        if pending_size > max(1 << 22, keys.shape[0]) or k == used[-1]:
            keys, weights = _merge([(keys, weights), *pending])
            pending, pending_size = [], 0
    tables_of = keys // span
    lengths = np.bincount(tables_of, minlength=table_rows.shape[0]).reshape(1, -1)
    loaded = stage.warm(lengths, keys % span, counts=weights)  # keys are sorted: grouped by table, one "item"
    hits = total = 0.0
    for k in used:  # the share of the recorded requests' ids the warmed cache holds
        query = tensors[k]
        cached = stage.cached(query[_LENGTHS], np.asarray(query[_INDICES]).reshape(-1))
        hits += float(requests[k]) * int(np.count_nonzero(cached))
        total += float(requests[k]) * cached.shape[0]
    hit_rate = hits / total if total else 0.0
    stores = stage.stores
    report = WarmReport(model=model, path=name, queries=len(used), requests=len(recording), ids=ids_fed,
                        rows_loaded=int(loaded), cached_rows=sum(s.cached_rows for s in stores),
                        slots=sum(s.slots for s in stores), hit_rate=hit_rate,
                        seconds=time.perf_counter() - start)
    log.info(report.describe(), extra={"event": "table_cache_warmed", "model": model, "rows": report.rows_loaded,
                                       "fill": round(report.fill, 4), "hit_rate": round(hit_rate, 4)})
    return report
