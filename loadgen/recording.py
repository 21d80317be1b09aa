"""``--record`` / ``--replay``: what a run sent, when, and what came back, in one ``.npz`` file.

A recording holds each request's timing and outcome plus the distinct query
tensors the run sent (the pool, stored once, not once per request), so a
run of millions of requests stays small. Format (``numpy.savez``; every
time is in seconds after the schedule's start):

=================  =========  =====================================================
key                dtype      meaning
=================  =========  =====================================================
``meta``           str (0-d)  JSON: ``schema``, ``config`` (LoadConfig), ``target``
                              (model shape), ``started_at`` (UTC ISO), ``mode``
``due``            float64    [R] scheduled send time (closed loop: the send time)
``sent``           float64    [R] actual send time (NaN: never sent)
``done``           float64    [R] answer time (NaN: no answer)
``latency``        float64    [R] ``done - due`` (what the report's percentiles use)
``status``         int8       [R] 0 never finished, 1 ok, 2 error
``items``          int64      [R] items in the query
``query``          int64      [R] which pool query the request carried
``error_index``    int64      [E] request numbers of the errors ...
``error_reason``   str        [E] ... and their reasons (``timeout``, gRPC status)
``pool_items``     int64      [Q] items (rows) of each pool query
``pool_ids``       int64      [Q] ids (len of ``sparse_indices``) of each pool query
``dense_features`` float32    [sum(pool_items), D] all pool queries, concatenated
``sparse_lengths`` int32      [sum(pool_items), T]
``sparse_indices`` int64      [sum(pool_ids)]
=================  =========  =====================================================

Pool query k is rows ``cumsum(pool_items)[k-1]..`` of the dense and lengths
arrays and ids ``cumsum(pool_ids)[k-1]..`` of the indices: concatenating on
dim 0 is a correct merge of canonical requests (see DESIGN.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.signature import DENSE, INDICES, LENGTHS

from .record import RunRecord

__all__ = ["Recording", "save_recording", "load_recording", "RECORDING_SCHEMA"]

RECORDING_SCHEMA = "sixfold.loadgen.recording/1"


@dataclass(frozen=True)
class Recording:
    """A loaded recording; ``tensors[k]`` is pool query k as the canonical input tensors."""

    meta: dict[str, Any]
    due: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    status: np.ndarray
    items: np.ndarray
    query: np.ndarray
    reasons: dict[int, str]
    tensors: tuple[dict[str, np.ndarray], ...]

    def __len__(self) -> int:
        return int(self.due.size)

    @property
    def latency(self) -> np.ndarray:
        """Answer time minus scheduled time per request, seconds (NaN: no answer)."""
        return self.done - self.due


def save_recording(path: str | Path, record: RunRecord, query: np.ndarray,
                   tensors: tuple[dict[str, np.ndarray], ...], meta: dict[str, Any]) -> Path:
    """Write ``record`` (request i carried pool query ``query[i]``) and the pool to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(record)
    errors = sorted(record.reasons)
    arrays = {
        "meta": np.array(json.dumps({"schema": RECORDING_SCHEMA, **meta})),
        "due": record.due[:n], "sent": record.sent[:n], "done": record.done[:n],
        "latency": record.done[:n] - record.due[:n], "status": record.status[:n], "items": record.items[:n],
        "query": np.asarray(query[:n], dtype=np.int64),
        "error_index": np.asarray(errors, dtype=np.int64),
        "error_reason": np.asarray([record.reasons[i] for i in errors], dtype=str),
        "pool_items": np.asarray([t[DENSE].shape[0] for t in tensors], dtype=np.int64),
        "pool_ids": np.asarray([t[INDICES].size for t in tensors], dtype=np.int64),
        DENSE: np.concatenate([t[DENSE] for t in tensors]),
        LENGTHS: np.concatenate([t[LENGTHS] for t in tensors]),
        INDICES: np.concatenate([t[INDICES] for t in tensors]),
    }
    with open(path, "wb") as f:  # NOTE: a file object keeps numpy from appending ".npz"
        np.savez(f, **arrays)
    return path


def load_recording(path: str | Path) -> Recording:
    """Read a file written by ``save_recording``; ValueError if it is not one."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read recording {str(path)!r}: {exc}") from None
    with data:
        try:
            meta = json.loads(str(data["meta"]))
            if meta.get("schema") != RECORDING_SCHEMA:
                raise KeyError("schema")
            rows = np.cumsum(data["pool_items"])[:-1]
            ids = np.cumsum(data["pool_ids"])[:-1]
            dense = np.split(data[DENSE], rows)
            lengths = np.split(data[LENGTHS], rows)
            indices = np.split(data[INDICES], ids)
            tensors = tuple({DENSE: d, LENGTHS: ln, INDICES: x} for d, ln, x in zip(dense, lengths, indices))
            reasons = dict(zip(data["error_index"].tolist(), data["error_reason"].tolist()))
            return Recording(meta, data["due"], data["sent"], data["done"], data["status"], data["items"],
                             data["query"], reasons, tensors)
        except KeyError as exc:
            raise ValueError(f"{str(path)!r} is not a sixfold loadgen recording (missing {exc})") from None
