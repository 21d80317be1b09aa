"""Replace rows of a ``HostEmbeddingStage``'s tables while it serves (table deltas).

Two steps, so that the part that must run between batches is short:

``prepare(stage, updates, sources)`` (any time, off the serving path): converts each table's
new rows to the form its group stores (fp32, fp16, or row-wise packed int8/int4 with the
same prepack op the stage converts tables with, so the rows equal those of a stage started
on the new tables, bit for bit), reads the rows they replace (``undo``), and readies each
group:

- a resident group (rows in a memory map or in memory) is written in place. A read-only
  map (``np.load(mmap_mode="r")``) is first opened again copy-on-write (``mmap_mode="c"``,
  the files never change) with the new rows already in it; a writable one has the pages of
  the rows about to change touched beforehand (their own bytes written back, which changes
  nothing a concurrent lookup reads), so the copy-on-write faults are paid here, not in
  the swap.
- a tiered group (``table_store.TieredRows``) gets a new ``RowOverlay``: the changed rows
  are then read from ``sources`` (the rows as stored, in files beside the version) instead
  of the table files, and cached copies are overwritten in the swap.

``RowSwap.commit()`` (between two batches: no lookup may run meanwhile; the server holds
its host stage for it, ``sixfold.server.execution.runtime.PlanRuntime.between_batches``): a pointer swap or a
scattered copy of the changed rows per group, and an overlay swap under each store's lock.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends.host.host_embedding import HostEmbeddingStage, bytes_per_row

__all__ = ["prepare", "RowSwap", "stored_rows", "read_rows", "stored_format"]


def stored_format(stage: HostEmbeddingStage, table: int) -> tuple[np.dtype, int]:
    """(dtype, width) of one stored row of ``table`` in ``stage``."""
    p = stage.precisions[table]
    if p == "fp32":
        return np.dtype(np.float32), stage.dim
    if p == "fp16":
        return np.dtype(np.float16), stage.dim
    return np.dtype(np.uint8), bytes_per_row(p, stage.dim)


def stored_rows(stage: HostEmbeddingStage, table: int, values: np.ndarray | None,
                packed: np.ndarray | None = None, packed_precision: str | None = None) -> np.ndarray:
    """Rows for ``table`` in the form its group stores them (fp32 ``values``, or ``packed`` rows of its precision)."""
    p = stage.precisions[table]
    dtype, width = stored_format(stage, table)
    if packed is not None and packed_precision == p:
        rows = np.ascontiguousarray(packed, np.uint8)
    elif values is not None and values.dtype == dtype and values.shape[1:] == (width,) and p in ("int8", "int4"):
        rows = np.ascontiguousarray(values)  # already stored form (e.g. undo rows)
    elif values is None:
        raise ValueError(f"table {table}: no fp32 rows and no {p} rows")
    elif p in ("fp32", "fp16"):
        rows = np.ascontiguousarray(values, dtype)
    else:
        import torch
        op = (torch.ops.quantized.embedding_bag_byte_prepack if p == "int8"
              else torch.ops.quantized.embedding_bag_4bit_prepack)
        rows = op(torch.from_numpy(np.ascontiguousarray(values, np.float32))).numpy()
    if rows.shape[1:] != (width,) or rows.dtype != dtype:
        raise ValueError(f"table {table}: rows are {rows.dtype} x {rows.shape[1:]}; its {p} rows are "
                         f"{dtype} x {width}")
    return rows


def _where(stage: HostEmbeddingStage, table: int) -> tuple[Any, int]:
    """(group, first row of ``table`` in the group's weight)."""
    for g in stage.groups:
        if table in g.tables:
            return g, int(g.row_offsets[g.tables.index(table)])
    raise ValueError(f"table {table} is in no group")


def read_rows(stage: HostEmbeddingStage, table: int, ids: np.ndarray) -> np.ndarray:
    """The rows ``ids`` (ascending) of ``table`` as served now, in stored form. Not during a swap."""
    group, offset = _where(stage, table)
    rows = np.asarray(ids, np.int64) + offset
    if group.store is not None:
        return group.store.read_rows(rows)
    return np.array(group.array[rows])


@dataclass
class _Write:
    group: Any
    rows: np.ndarray
    values: np.ndarray
    fresh: np.ndarray | None = None
    """A copy-on-write map holding the new rows already: the swap installs it."""


@dataclass
class RowSwap:
    """Row changes made ready by ``prepare``; ``commit`` between batches. ``undo``: table -> replaced rows."""

    stage: HostEmbeddingStage
    writes: list[_Write] = field(default_factory=list)
    overlays: list[tuple[Any, np.ndarray, np.ndarray, Any]] = field(default_factory=list)
    undo: dict[int, np.ndarray] = field(default_factory=dict)
    rows: int = 0

    def commit(self) -> None:
        import torch

        for w in self.writes:
            if w.fresh is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    w.group.array, w.group.weight = w.fresh, torch.from_numpy(w.fresh)
            else:
                w.group.array[w.rows] = w.values
        for store, rows, values, overlay in self.overlays:
            with store.lock:
                store.replace_rows(rows, values, overlay)


def _writable(array: np.ndarray) -> np.ndarray | None:
    """A copy-on-write map of ``array``'s file (None: ``array`` is writable already)."""
    if array.flags.writeable:
        return None
    filename = getattr(array, "filename", None)
    if isinstance(array, np.memmap) and filename and Path(filename).is_file():
        fresh = np.load(filename, mmap_mode="c")
        if fresh.shape == array.shape and fresh.dtype == array.dtype:
            return fresh
    return np.array(array)  # NOTE: not a map of a whole file: a private copy


def prepare(stage: HostEmbeddingStage, updates: Mapping[int, tuple[np.ndarray, np.ndarray]],
            sources: Mapping[int, np.ndarray] | None = None, *, undo: bool = True) -> RowSwap:
    """Ready ``updates`` (table -> (ascending ids, rows in stored form)) for ``RowSwap.commit``.

    ``sources`` (tiered groups): table -> the same rows as an array backed by a file that stays
    (the overlay reads them from there after the swap); defaults to the rows themselves.
    ``undo``: keep the rows they replace in ``RowSwap.undo`` (a read of each changed row).
    """
    from sixfold.backends.host.table_store import RowOverlay

    swap = RowSwap(stage)
    by_group: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for table, (ids, values) in sorted(updates.items()):
        group, offset = _where(stage, table)
        dtype, width = stored_format(stage, table)
        if values.dtype != dtype or values.shape != (ids.shape[0], width):
            raise ValueError(f"table {table}: rows {values.dtype} {list(values.shape)}, stored rows are "
                             f"{dtype} [{ids.shape[0]}, {width}]")
        if undo:
            swap.undo[table] = read_rows(stage, table, ids)
        source = values if sources is None or table not in sources else sources[table]
        by_group.setdefault(id(group), []).append((np.asarray(ids, np.int64) + offset, values, source))
        swap.rows += int(ids.shape[0])
    for group in stage.groups:
        parts = by_group.get(id(group))
        if not parts:
            continue
        rows = np.concatenate([r for r, _, _ in parts])
        values = np.concatenate([v for _, v, _ in parts])
        if group.store is not None:
            overlay = group.store.overlay or RowOverlay.empty()
            for r, _, source in parts:
                overlay = overlay.merged(r, source)
            swap.overlays.append((group.store, rows, values, overlay))
            continue
        fresh = _writable(group.array)
        if fresh is not None:
            fresh[rows] = values
            swap.writes.append(_Write(group, rows, values, fresh))
        else:
            group.array[rows] = group.array[rows]  # NOTE: the same bytes: pays the page faults now
            swap.writes.append(_Write(group, rows, values))
    return swap
