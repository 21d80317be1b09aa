"""Simulated traffic: loadgen's arrival processes and query-size models, or a recorded run.

``Traffic`` draws an ``Arrivals`` (when each query arrives, its items and its ids) for a
rate and a window, with ``sixfold.loadgen.arrivals`` and ``sixfold.models.requests`` (the same
``--arrival`` and ``--query-size`` forms as ``sixfold-loadgen``). Arrival times and sizes
come from two seeded streams, so two rates with one seed share their random numbers
(the gaps scale with the rate, the sizes stay): a rate search compares like with like.

``Traffic.from_recording`` replays a ``sixfold-loadgen --record`` file: each request's
scheduled time, items and ids, time-scaled to a rate (or at its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sixfold.loadgen.arrivals import ArrivalProcess, PoissonArrivals, TraceArrivals, parse_arrival
from sixfold.models.requests import MLPerfQuerySizes, QuerySizes, parse_query_sizes

__all__ = ["Arrivals", "Traffic", "parse_traffic"]


@dataclass(frozen=True)
class Arrivals:
    """Query i arrives at ``offsets[i]`` s with ``items[i]`` items and ``ids[i]`` looked-up ids."""

    offsets: np.ndarray
    items: np.ndarray
    ids: np.ndarray
    rate: float
    window_s: float

    def __len__(self) -> int:
        return int(self.offsets.size)


@dataclass(frozen=True)
class Traffic:
    """What arrives: an arrival process and a query-size model, or a recorded run."""

    arrival: ArrivalProcess = PoissonArrivals()
    sizes: QuerySizes = MLPerfQuerySizes()
    label: str = "poisson mlperf"
    recorded: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """(due, items, ids) of a recording, times from 0."""

    @property
    def own_rate(self) -> float | None:
        """A trace's or recording's own rate (queries/s), None for a model."""
        if self.recorded is not None:
            due = self.recorded[0]
            return (due.size - 1) / float(due[-1]) if due[-1] > 0 else None
        if isinstance(self.arrival, TraceArrivals):
            return self.arrival.mean_qps()
        return None

    def mean_items(self, seed: int = 0) -> float:
        if self.recorded is not None:
            return float(self.recorded[1].mean())
        return float(self.sizes.sample(np.random.default_rng([seed, 9]), 20_000).mean())

    def max_items(self, quantile: float = 99.0, seed: int = 0) -> int:
        """Items of the query at ``quantile`` of the size mix (the largest query a p99 must absorb)."""
        if self.recorded is not None:
            return int(np.percentile(self.recorded[1], quantile))
        return int(np.percentile(self.sizes.sample(np.random.default_rng([seed, 9]), 20_000), quantile))

    def draw(self, rate: float | None, window_s: float, ids_per_item: float, seed: int = 0) -> Arrivals:
        """Arrivals over ``window_s`` s at ``rate`` queries/s (None: a trace's own rate)."""
        if not window_s > 0:
            raise ValueError(f"--duration must be > 0 s, got {window_s}")
        if rate is not None and not (rate > 0 and np.isfinite(rate)):
            raise ValueError(f"--qps must be > 0, got {rate}")
        if self.recorded is not None:
            due, items, ids = self.recorded
            own = self.own_rate or 1.0
            scale = own / rate if rate else 1.0
            times = due * scale
            span = float(times[-1]) + (float(times[-1]) / max(1, times.size - 1))
            loops = max(1, int(np.ceil(window_s / span)))
            offsets = (times[None, :] + span * np.arange(loops)[:, None]).reshape(-1)
            keep = offsets < window_s
            return Arrivals(offsets[keep], np.tile(items, loops)[keep], np.tile(ids, loops)[keep],
                            rate or own, window_s)
        if rate is None:
            rate = self.own_rate
            if rate is None:
                raise ValueError("--qps is required (the arrival process has no rate of its own)")
        if isinstance(self.arrival, TraceArrivals):  # replayed at ``rate``: its times scaled by own rate / rate
            speed = rate / self.arrival.mean_qps()
            offsets = self.arrival.offsets(rate, window_s * speed, np.random.default_rng([seed, 1])) / speed
            offsets = offsets[offsets < window_s]
        else:
            offsets = self.arrival.offsets(rate, window_s, np.random.default_rng([seed, 1]))
        items = np.asarray(self.sizes.sample(np.random.default_rng([seed, 2]), offsets.size), dtype=np.int64)
        ids = np.maximum(1, np.rint(items * ids_per_item)).astype(np.int64)
        return Arrivals(offsets, items, ids, rate, window_s)

    @classmethod
    def from_recording(cls, path: str) -> "Traffic":
        """A ``sixfold-loadgen --record`` file: its requests' times, items and ids."""
        from sixfold.loadgen.recording import load_recording

        try:
            rec = load_recording(path)
        except ValueError as exc:
            raise ValueError(f"--replay: {exc}") from None
        pool_ids = np.asarray([t["sparse_indices"].shape[0] for t in rec.tensors], dtype=np.int64)
        order = np.argsort(rec.due, kind="stable")
        due = rec.due[order] - rec.due[order][0]
        if due.size < 2:
            raise ValueError(f"--replay: {path} holds {due.size} request(s); need at least 2")
        return cls(label=f"replay {path}", recorded=(due, rec.items[order].astype(np.int64),
                                                     pool_ids[rec.query[order]]))


def parse_traffic(arrival: str = "poisson", sizes: str = "mlperf") -> Traffic:
    """``--arrival`` and ``--query-size`` as ``sixfold-loadgen`` reads them; ValueError naming the flag."""
    try:
        process = parse_arrival(arrival)
    except ValueError as exc:
        raise ValueError(f"--arrival: {exc}") from None
    try:
        size_model = parse_query_sizes(sizes)
    except ValueError as exc:
        raise ValueError(f"--query-size: {exc}") from None
    return Traffic(process, size_model, f"{arrival} {sizes}")
