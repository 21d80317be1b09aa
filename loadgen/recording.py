"""``--record`` / ``--replay``: what a run sent, when, and what came back, in one ``.npz`` file.

A recording holds each request's timing and outcome, the model's shape, and
the distinct queries the run sent (the pool). The pool is stored as its
*recipe* when the loadgen generated it (the request generator's parameters and
random state, the sizes made, the id drift: a few hundred bytes, from which
``sixfold.loadgen.schedule.pool_tensors`` rebuilds the very same bits, checked against
a SHA-256 digest), and as compressed tensors only when it cannot be
regenerated (a pool that came from elsewhere). Format 2
(``numpy.savez_compressed``; every time is in seconds after the schedule's start):

=====================  =========  ==================================================
key                    dtype      meaning
=====================  =========  ==================================================
``meta``               str (0-d)  JSON: ``schema``, ``config`` (LoadConfig), ``target``,
                                  ``shape`` (``dense_dim``, ``table_rows``, ``pooling``,
                                  ``zipf``), ``pool`` (see below), ``started_at``,
                                  ``mode``, ``offered_qps``, ``numpy``
``due``                float64    [R] scheduled send time (closed loop: the send time)
``sent``               float64    [R] actual send time (NaN: never sent)
``done``               float64    [R] answer time (NaN: no answer)
``status``             int8       [R] 0 never finished, 1 ok, 2 error
``query``              int32      [R] which pool query the request carried
``error_index``        int64      [E] request numbers of the errors ...
``error_reason``       str        [E] ... and their reasons (``timeout``, gRPC status)
``pool_items``         int64      [Q] items (rows) of each pool query
``pool_ids``           int64      [Q] ids (len of ``sparse_indices``) of each pool query
=====================  =========  ==================================================

``meta.pool`` is ``{"source": "recipe", "recipe": {...}, "digest": SHA-256}`` or
``{"source": "stored", "digest": ...}``; a stored pool adds
``dense_features`` (float32 [sum(pool_items), D]), ``sparse_lengths`` (the
narrowest unsigned dtype, [sum(pool_items), T]) and ``sparse_indices_bytes``
(uint8 [itemsize, sum(pool_ids)]: the ids in the narrowest unsigned dtype,
split into byte planes so the zip's deflate finds the all-zero high bytes).
Pool query k is its slice of the concatenated arrays (cumulative sums of
``pool_items`` / ``pool_ids``), in canonical dtypes once loaded.

Format 1 files (``sixfold.loadgen.recording/1``, raw tensors) are still read.
A file that cannot be read whole (truncated, corrupted, inconsistent, or
whose pool does not rebuild to its digest) is refused with a ValueError
naming the file; nothing of it is used.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.models.signature import DENSE, INDICES, LENGTHS

from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.schedule import PoolRecipe, pool_digest, pool_tensors

__all__ = ["Recording", "save_recording", "load_recording", "RECORDING_SCHEMA", "RECORDING_SCHEMA_V1"]

RECORDING_SCHEMA = "sixfold.loadgen.recording/2"
RECORDING_SCHEMA_V1 = "sixfold.loadgen.recording/1"
_SHAPE_KEYS = ("dense_dim", "table_rows", "pooling", "zipf")

Tensors = tuple[dict[str, np.ndarray], ...]


@dataclass
class Recording:
    """A loaded recording; ``tensors[k]`` is pool query k as the canonical input tensors.

    With a recipe pool, ``tensors`` is rebuilt on first use (and checked
    against the recorded digest); ``recipe`` is then not None.
    """

    meta: dict[str, Any]
    due: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    status: np.ndarray
    query: np.ndarray
    reasons: dict[int, str]
    pool_items: np.ndarray
    recipe: PoolRecipe | None = None
    path: str = ""
    _tensors: Tensors | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.due.size)

    @property
    def items(self) -> np.ndarray:
        """Items per request."""
        return self.pool_items[self.query]

    @property
    def latency(self) -> np.ndarray:
        """Answer time minus scheduled time per request, seconds (NaN: no answer)."""
        return self.done - self.due

    @property
    def shape(self) -> dict[str, Any]:
        """The model shape the run was made for: ``dense_dim``, ``table_rows``, ``pooling``, ``zipf``."""
        return dict(self.meta.get("shape") or {})

    @property
    def tensors(self) -> Tensors:
        if self._tensors is None:
            assert self.recipe is not None
            try:
                rebuilt = tuple(pool_tensors(self.recipe))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"recording {self.path!r}: cannot rebuild its queries ({exc})") from None
            digest = self.meta["pool"].get("digest")
            if pool_digest(rebuilt) != digest:
                raise ValueError(
                    f"recording {self.path!r}: the queries rebuilt from its recipe do not match the recorded "
                    f"digest (recorded with numpy {self.meta.get('numpy', '?')}, this is numpy {np.__version__}); "
                    f"the file is refused")
            self._tensors = rebuilt
        return self._tensors


def _narrow(values: np.ndarray) -> np.ndarray:
    """``values`` (non-negative ints) in the narrowest unsigned dtype that holds them."""
    top = int(values.max()) if values.size else 0
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dtype).max:
            return values.astype(dtype)
    raise AssertionError("unreachable")


def _stored_pool(tensors: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    ids = np.concatenate([np.asarray(t[INDICES]).reshape(-1) for t in tensors])
    if ids.size and int(ids.min()) < 0:
        raise ValueError("cannot record negative sparse ids")
    narrow = _narrow(ids)
    return {
        DENSE: np.concatenate([t[DENSE] for t in tensors]).astype(np.float32, copy=False),
        LENGTHS: _narrow(np.concatenate([t[LENGTHS] for t in tensors])),
        "sparse_indices_bytes": narrow.view(np.uint8).reshape(-1, narrow.itemsize).T.copy(),
    }


def save_recording(path: str | Path, record: RunRecord, query: np.ndarray, tensors: Tensors,
                   meta: dict[str, Any], *, recipe: PoolRecipe | None = None,
                   shape: Mapping[str, Any] | None = None) -> Path:
    """Write ``record`` (request i carried pool query ``query[i]``) and the pool to ``path``.

    With ``recipe`` (which must rebuild ``tensors``) only the recipe is stored;
    without it the tensors are stored compressed. ``shape`` is the model shape
    (``dense_dim``, ``table_rows``, ``pooling``, ``zipf``), so a replay needs no flags.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(record)
    errors = sorted(record.reasons)
    pool: dict[str, Any] = {"digest": pool_digest(tensors)}
    if recipe is not None:
        pool = {"source": "recipe", "recipe": recipe.to_dict(), **pool}
    else:
        pool = {"source": "stored", **pool}
    body = {"schema": RECORDING_SCHEMA, **meta, "shape": dict(shape or {}), "pool": pool, "numpy": np.__version__}
    arrays = {
        "meta": np.array(json.dumps(body)),
        "due": record.due[:n], "sent": record.sent[:n], "done": record.done[:n], "status": record.status[:n],
        "query": np.asarray(query[:n], dtype=np.int32 if len(tensors) < 2**31 else np.int64),
        "error_index": np.asarray(errors, dtype=np.int64),
        "error_reason": np.asarray([record.reasons[i] for i in errors], dtype=str),
        "pool_items": np.asarray([t[DENSE].shape[0] for t in tensors], dtype=np.int64),
        "pool_ids": np.asarray([np.asarray(t[INDICES]).size for t in tensors], dtype=np.int64),
    }
    if recipe is None:
        arrays.update(_stored_pool(tensors))
    with open(path, "wb") as f:  # NOTE: a file object keeps numpy from appending ".npz"
        np.savez_compressed(f, **arrays)
    return path


def _split_pool(data: Mapping[str, np.ndarray], dense: np.ndarray, lengths: np.ndarray,
                indices: np.ndarray) -> Tensors:
    items, ids = data["pool_items"], data["pool_ids"]
    if dense.ndim != 2 or lengths.ndim != 2 or dense.shape[0] != lengths.shape[0] \
            or dense.shape[0] != int(items.sum()) or indices.size != int(ids.sum()):
        raise ValueError(f"pool arrays disagree: {DENSE} {list(dense.shape)}, {LENGTHS} {list(lengths.shape)}, "
                         f"{indices.size} ids for {int(items.sum())} rows and {int(ids.sum())} ids")
    rows, cut = np.cumsum(items)[:-1], np.cumsum(ids)[:-1]
    tensors = tuple({DENSE: d, LENGTHS: ln, INDICES: x}
                    for d, ln, x in zip(np.split(dense, rows), np.split(lengths, rows), np.split(indices, cut)))
    for k, t in enumerate(tensors):
        if int(t[LENGTHS].sum()) != t[INDICES].size:
            raise ValueError(f"pool query {k}: {LENGTHS} sum to {int(t[LENGTHS].sum())} but it has "
                             f"{t[INDICES].size} ids")
    return tensors


def _read(path: str, data: Mapping[str, np.ndarray]) -> Recording:
    meta = json.loads(str(data["meta"]))
    schema = meta.get("schema")
    if schema not in (RECORDING_SCHEMA, RECORDING_SCHEMA_V1):
        raise ValueError(f"unknown schema {schema!r} (this loadgen reads {RECORDING_SCHEMA} and "
                         f"{RECORDING_SCHEMA_V1})")
    due, sent, done = (np.asarray(data[k], dtype=np.float64) for k in ("due", "sent", "done"))
    status, query = np.asarray(data["status"], dtype=np.int8), np.asarray(data["query"], dtype=np.int64)
    pool_items = np.asarray(data["pool_items"], dtype=np.int64)
    if not due.ndim == 1 or any(a.shape != due.shape for a in (sent, done, status, query)):
        raise ValueError("per-request arrays (due, sent, done, status, query) differ in length")
    if query.size and (query.min() < 0 or query.max() >= pool_items.size):
        raise ValueError(f"requests name pool queries outside 0..{pool_items.size - 1}")
    if status.size and (status.min() < 0 or status.max() > 2):
        raise ValueError("status values outside 0..2")
    reasons = dict(zip(data["error_index"].tolist(), data["error_reason"].tolist()))
    recipe, tensors = None, None
    if schema == RECORDING_SCHEMA_V1:
        target = meta.get("target", {})
        meta["shape"] = {k: target[k] for k in _SHAPE_KEYS if k in target}
        tensors = _split_pool(data, data[DENSE], data[LENGTHS], data[INDICES])
    elif meta["pool"]["source"] == "recipe":
        recipe = PoolRecipe.from_dict(meta["pool"]["recipe"])
        expected = np.asarray(recipe.sizes * recipe.slices, dtype=np.int64)
        if not np.array_equal(expected, pool_items):
            raise ValueError("pool_items disagree with the pool's recipe")
    else:
        planes = np.ascontiguousarray(data["sparse_indices_bytes"])
        if planes.ndim != 2 or planes.shape[0] not in (1, 2, 4, 8):
            raise ValueError(f"sparse_indices_bytes has shape {list(planes.shape)}, expected [1|2|4|8, ids]")
        ids = np.ascontiguousarray(planes.T).view(f"<u{planes.shape[0]}").reshape(-1).astype(np.int64)
        tensors = _split_pool(data, np.asarray(data[DENSE], dtype=np.float32),
                              np.asarray(data[LENGTHS], dtype=np.int32), ids)
        if pool_digest(tensors) != meta["pool"].get("digest"):
            raise ValueError("its stored queries do not match the recorded digest")
    return Recording(meta, due, sent, done, status, query, reasons, pool_items, recipe, path, tensors)


def load_recording(path: str | Path) -> Recording:
    """Read a file written by ``save_recording`` (format 1 or 2) whole; ValueError naming it if it is not one."""
    name = str(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {key: npz[key] for key in npz.files}  # NOTE: read every member now, so a bad one fails here
    except FileNotFoundError:
        raise ValueError(f"cannot read recording {name!r}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"cannot read recording {name!r}: not a complete .npz file "
                         f"(truncated or corrupted: {type(exc).__name__}: {exc})") from None
    try:
        return _read(name, data)
    except KeyError as exc:
        raise ValueError(f"{name!r} is not a sixfold loadgen recording (missing {exc})") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"recording {name!r} is refused: {exc}") from None
