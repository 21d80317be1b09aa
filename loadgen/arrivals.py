"""Arrival processes: when each request of an open-loop run is due.

A process turns a target rate and a window into sorted send offsets (seconds
from the start). Poisson is the default, as in MLPerf Server and DeepRecInfra:
independent users make the gaps exponential. Constant spacing is there for
debugging and for comparing with closed-loop tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["ArrivalProcess", "PoissonArrivals", "ConstantArrivals", "parse_arrival", "ARRIVAL_KINDS"]


class ArrivalProcess(Protocol):
    """Send offsets for a run at ``qps`` over ``window_s`` seconds."""

    name: str

    def offsets(self, qps: float, window_s: float, rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
        """Sorted float64 offsets in [0, window_s), at most ``limit`` of them."""
        ...


def _check(qps: float, window_s: float) -> None:
    if not qps > 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if not window_s > 0:
        raise ValueError(f"the run window must be > 0 s, got {window_s}")


@dataclass(frozen=True)
class PoissonArrivals:
    """Exponential gaps with mean 1/qps (coefficient of variation 1)."""

    name: str = "poisson"

    def offsets(self, qps: float, window_s: float, rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
        _check(qps, window_s)
        expected = qps * window_s
        # Draw a little more than needed (mean + 6 sigma), then top up if unlucky.
        chunk = int(expected + 6 * np.sqrt(expected) + 16)
        if limit is not None:
            chunk = min(chunk, limit)
        times = np.cumsum(rng.exponential(1.0 / qps, size=chunk))
        while times[-1] < window_s and (limit is None or times.size < limit):
            more = np.cumsum(rng.exponential(1.0 / qps, size=chunk)) + times[-1]
            times = np.concatenate([times, more])
        # The first request goes out at t=0 rather than after one gap.
        times = np.concatenate([[0.0], times[:-1]])
        times = times[times < window_s]
        return times[:limit] if limit is not None else times


@dataclass(frozen=True)
class ConstantArrivals:
    """Evenly spaced sends, exactly 1/qps apart."""

    name: str = "constant"

    def offsets(self, qps: float, window_s: float, rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
        _check(qps, window_s)
        count = int(np.ceil(window_s * qps - 1e-9))
        if limit is not None:
            count = min(count, limit)
        times = np.arange(count, dtype=np.float64) / qps
        return times[times < window_s]


ARRIVAL_KINDS: dict[str, ArrivalProcess] = {"poisson": PoissonArrivals(), "constant": ConstantArrivals()}


def parse_arrival(spec: str) -> ArrivalProcess:
    """``poisson`` or ``constant``; the error lists the kinds that exist."""
    try:
        return ARRIVAL_KINDS[spec.strip().lower()]
    except KeyError:
        raise ValueError(f"bad arrival spec {spec!r}: expected one of {', '.join(ARRIVAL_KINDS)}") from None
