"""A lone query's latency as sixfold-serve answers it: the plan's stages at the query's size plus the serving path.

The plan's batch time (host stage + dense stage of ``batch_rows`` items) is not what a client waits for. A
lone query on an idle server also pays the serving path around the stages: decode, validation, the batcher's
hand-off, splitting the outputs back, encode, and gRPC both ways. Measured on this project's 2-core VM
(``bench/unloaded_latency.py``), that path is ~1.5 ms plus ~1 us an item plus ~9 ns a looked-up id (the ids
dominate a request's bytes: rm2's 700-item query carries 21 MiB of them), 5-50% of a lone query's time. The
batching window is not paid: with ``all_in_dispatch`` (the default) an idle batcher dispatches at once.

The serving path is calibrated on the host where it runs (``bench/unloaded_latency.py --calibrate`` writes
``serving-path-<machine>.json`` beside the ``--host-spec auto`` cache); without that file a documented
default (``DEFAULT_SERVING_PATH``, measured on the development VM) is used and named as such.
"""

from __future__ import annotations

from sixfold.backends.host.native import write_json_atomic
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["ServingPath", "ServedLatency", "DEFAULT_SERVING_PATH", "PRICE_ROWS", "serving_path_file",
           "load_serving_path", "save_serving_path", "fit_serving_path", "price_lone_query"]

PRICE_ROWS: tuple[int, ...] = (1, 16, 64, 128, 256, 512, 1024)
"""Query sizes at which the stages are priced; other sizes interpolate between them (linear beyond the last)."""


@dataclass(frozen=True)
class ServingPath:
    """What a lone query costs outside the plan's stages: ``fixed_s + per_item_s x items + per_id_s x ids``."""

    fixed_s: float
    per_item_s: float
    source: str = "default"
    """Where the figures come from: "default", or the calibration file and its load average."""
    per_id_s: float = 0.0
    """Per looked-up id: decoding and range-checking the ids (validation) grows with them, not with the items."""

    def seconds(self, rows: int, ids_per_item: float = 0.0) -> float:
        return self.fixed_s + (self.per_item_s + self.per_id_s * ids_per_item) * rows


DEFAULT_SERVING_PATH = ServingPath(1.46e-3, 1.16e-6, "default (measured on the 2-core development VM, 2026-11-27)",
                                   9.14e-9)
"""``bench/unloaded_latency.py --calibrate`` on the development VM (load average 3.2-3.6): lone dlrm-mlperf (26 ids
an item) and rm2 (3,840 ids an item: 30 KiB of int64 ids, 21 MiB for 700 items) queries of 1-700 items over gRPC
on 127.0.0.1 (tritonclient), 10 each; per request, its client latency less its own host and dense stage times."""


def serving_path_file() -> Path:
    """The calibration file of this machine (beside ``--host-spec auto``'s cache)."""
    from sixfold.backends.host.calibrate import cache_dir, machine_key
    return cache_dir() / f"serving-path-{machine_key()}.json"


def load_serving_path(path: Path | None = None) -> ServingPath:
    """This host's calibrated serving path, or ``DEFAULT_SERVING_PATH`` when none was calibrated (or it is damaged)."""
    path = path or serving_path_file()
    try:
        data = json.loads(path.read_text())
        return ServingPath(float(data["fixed_s"]), float(data["per_item_s"]), str(data.get("source", path)),
                           float(data.get("per_id_s", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_SERVING_PATH


def save_serving_path(path_cost: ServingPath, path: Path | None = None) -> Path:
    """Write ``path_cost`` as this host's calibration (atomically: a concurrent reader sees a whole file)."""
    return write_json_atomic(path or serving_path_file(), asdict(path_cost))


def fit_serving_path(rows: Sequence[int], seconds: Sequence[float], source: str,
                     ids_per_item: Sequence[float] | None = None) -> ServingPath:
    """Least squares (relative error) ``fixed + per_item x rows + per_id x ids`` through measured serving-path
    seconds, all >= 0.

    The per-id term is fitted only when the points span two ids-per-item ratios (two models); else it is
    ``DEFAULT_SERVING_PATH``'s, and the other terms are fitted with it taken out.
    """
    import numpy as np

    ratios = list(ids_per_item) if ids_per_item is not None else [0.0] * len(rows)
    if not len(rows) == len(seconds) == len(ratios) or len(set(rows)) < 2:
        raise ValueError(f"fit_serving_path needs times at >= 2 distinct sizes, got sizes {list(rows)}")
    x = np.asarray(rows, dtype=float)
    ids = x * np.asarray(ratios, dtype=float)
    y = np.asarray(seconds, dtype=float)
    # relative error: a 1-item query's 1 ms counts as much as a 700-item one's 10 ms (unweighted, the large sizes
    # set the fixed term and it came out 0.5 ms high at 1 item on the development VM)
    w = 1.0 / np.maximum(y, 1e-6)
    if len(set(ratios)) >= 2:
        a = np.column_stack([np.ones_like(x), x, ids]) * w[:, None]
        (fixed, per_item, per_id), *_ = np.linalg.lstsq(a, y * w, rcond=None)
        if per_id < 0:
            per_id = 0.0
    else:
        per_id = DEFAULT_SERVING_PATH.per_id_s
    a = np.column_stack([np.ones_like(x), x]) * w[:, None]
    (fixed, per_item), *_ = np.linalg.lstsq(a, (y - per_id * ids) * w, rcond=None)
    if per_item < 0:  # a flat path: its mean, no slope
        fixed, per_item = float(np.mean(y - per_id * ids)), 0.0
    return ServingPath(max(0.0, float(fixed)), float(per_item), source, float(per_id))


def _interpolate(points: Sequence[Sequence[float]], rows: int) -> float:
    """Piecewise-linear through (rows, seconds) points, sorted by rows; the last segment's slope beyond them."""
    pts = sorted((float(r), float(s)) for r, s in points)
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
        if rows <= r1 or (r1, s1) == pts[-1]:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    return pts[-1][1]


@dataclass(frozen=True)
class ServedLatency:
    """A lone query's latency by term, at any size: host stage, dense stage, serving path, batching window."""

    host: tuple[tuple[int, float], ...]
    """(rows, seconds) of the host stage at ``PRICE_ROWS``."""
    dense: tuple[tuple[int, float], ...]
    """(rows, seconds) of the dense stage(s) on one lane (a pipeline's stages summed), transfers included."""
    serving: ServingPath
    ids_per_item: float = 0.0
    """Looked-up ids per item (the tables' pooling summed): the serving path's per-id term."""
    window_s: float = 0.0
    """The batching window a lone query waits: 0 with ``all_in_dispatch`` (an idle batcher dispatches at once)."""
    no_wait_rows: int = 0
    """Queries of at least this many items leave without the window (the batcher's ``no_wait_rows``; 0: none)."""
    dense_source: str = ""
    """How the dense term is priced when not at the cards' spec (emulated cards: ``pricing.emulated_card``)."""
    host_source: str = ""
    """How the host term is priced when not by the host spec (measured here: ``pricing.host_stage_fit``)."""

    def terms(self, rows: int) -> dict[str, float]:
        """Seconds per term for a ``rows``-item query."""
        return {"host": _interpolate(self.host, rows), "dense": _interpolate(self.dense, rows),
                "serving": self.serving.seconds(rows, self.ids_per_item),
                "window": 0.0 if self.no_wait_rows and rows >= self.no_wait_rows else self.window_s}

    def seconds(self, rows: int) -> float:
        return sum(self.terms(rows).values())

    def describe(self, rows: int) -> str:
        """One line for the start-up plan."""
        t = {k: v * 1e3 for k, v in self.terms(rows).items()}
        window = f" + batching window {t['window']:.2f}" if t["window"] else ""
        dense = f"; dense: {self.dense_source}" if self.dense_source else ""
        dense += f"; host: {self.host_source}" if self.host_source else ""
        return (f"a lone {rows}-item query: {sum(t.values()):.2f} ms (host {t['host']:.2f} + dense {t['dense']:.2f} "
                f"+ serving path {t['serving']:.2f}{window} ms; serving path {self.serving.source}{dense})")

    def to_dict(self) -> dict[str, Any]:
        return {"host": [list(p) for p in self.host], "dense": [list(p) for p in self.dense],
                "serving": asdict(self.serving), "window_s": self.window_s,
                "no_wait_rows": self.no_wait_rows, "ids_per_item": self.ids_per_item,
                **({"dense_source": self.dense_source} if self.dense_source else {}),
                **({"host_source": self.host_source} if self.host_source else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServedLatency":
        s = data["serving"]
        return cls(tuple((int(r), float(v)) for r, v in data["host"]),
                   tuple((int(r), float(v)) for r, v in data["dense"]),
                   ServingPath(float(s["fixed_s"]), float(s["per_item_s"]), str(s.get("source", "default")),
                               float(s.get("per_id_s", 0.0))),
                   float(data.get("ids_per_item", 0.0)), float(data.get("window_s", 0.0)),
                   int(data.get("no_wait_rows", 0)), str(data.get("dense_source", "")),
                   str(data.get("host_source", "")))


def price_lone_query(host_seconds: Callable[[int], float], dense_seconds: Callable[[int], float],
                     serving: ServingPath | None = None, ids_per_item: float = 0.0,
                     window_s: float = 0.0) -> ServedLatency:
    """``ServedLatency`` from the stage pricers (seconds of a ``rows``-item batch) at ``PRICE_ROWS``."""
    if window_s < 0:
        raise ValueError(f"window_s must be >= 0, got {window_s}")
    return ServedLatency(tuple((r, float(host_seconds(r))) for r in PRICE_ROWS),
                         tuple((r, float(dense_seconds(r))) for r in PRICE_ROWS),
                         serving or load_serving_path(), float(ids_per_item), window_s)
