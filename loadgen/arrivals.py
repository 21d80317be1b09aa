"""Arrival processes: when each request of an open-loop run is due.

A process turns a target rate and a window into sorted send offsets (seconds
from the start). Poisson is the default, as in MLPerf Server and DeepRecInfra:
independent users make the gaps exponential. Constant spacing is there for
debugging and for comparing with closed-loop tools. On top of Poisson,
production traffic swings: ``bursty`` (on/off periods, optionally a
Markov-modulated Poisson process) and ``diurnal`` (a daily sine wave compressed
into the run) keep the mean rate at ``qps`` while varying it in time;
``trace`` replays recorded timestamps.

Time-varying Poisson processes are drawn by time change: unit-rate Poisson
points in "expected arrivals" space are mapped back through the cumulative
intensity Lambda(t) = integral of rate(t), so any piecewise-linear Lambda is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["ArrivalProcess", "PoissonArrivals", "ConstantArrivals", "BurstyArrivals", "DiurnalArrivals",
           "TraceArrivals", "parse_arrival", "ARRIVAL_KINDS", "ARRIVAL_FORMS"]


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


def _time_change(breaks: np.ndarray, cumulative: np.ndarray, window_s: float, rng: np.random.Generator,
                 limit: int | None) -> np.ndarray:
    """Poisson points of the intensity whose integral is the piecewise-linear (breaks, cumulative)."""
    total = float(cumulative[-1])
    count = int(rng.poisson(total))
    # Given the count, Poisson points are iid uniform in Lambda-space: sort them.
    points = np.sort(rng.uniform(0.0, total, size=count))
    times = np.interp(points, cumulative, breaks)
    times = times[times < window_s]
    return times[:limit] if limit is not None else times


@dataclass(frozen=True)
class BurstyArrivals:
    """On/off Poisson: ``on`` s at ``factor`` x the base rate, then ``off`` s at the base rate.

    The base rate is chosen so the mean over a cycle is ``qps``:
    base = qps (on + off) / (factor on + off). With ``markov`` the period
    lengths are exponential with those means (a two-state Markov-modulated
    Poisson process) instead of fixed; the run starts in an "on" period.
    """

    on_s: float = 2.0
    off_s: float = 3.0
    factor: float = 4.0
    markov: bool = False
    name: str = "bursty"

    def rates(self, qps: float) -> tuple[float, float]:
        """(rate while on, rate while off)."""
        base = qps * (self.on_s + self.off_s) / (self.factor * self.on_s + self.off_s)
        return self.factor * base, base

    def offsets(self, qps: float, window_s: float, rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
        _check(qps, window_s)
        high, low = self.rates(qps)
        breaks, cumulative, t, on = [0.0], [0.0], 0.0, True
        while t < window_s:
            mean = self.on_s if on else self.off_s
            length = rng.exponential(mean) if self.markov else mean
            t += length
            breaks.append(t)
            cumulative.append(cumulative[-1] + length * (high if on else low))
            on = not on
        return _time_change(np.asarray(breaks), np.asarray(cumulative), window_s, rng, limit)


@dataclass(frozen=True)
class DiurnalArrivals:
    """Poisson with rate qps (1 + amplitude sin(2 pi t / period + phase)): a day squeezed into ``period`` s.

    Over whole periods the mean rate is ``qps``; the peak is (1 + amplitude) qps.
    """

    amplitude: float = 0.5
    period_s: float = 60.0
    phase: float = 0.0
    name: str = "diurnal"

    def rate(self, qps: float, t: np.ndarray) -> np.ndarray:
        return qps * (1.0 + self.amplitude * np.sin(2 * np.pi * t / self.period_s + self.phase))

    def offsets(self, qps: float, window_s: float, rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
        _check(qps, window_s)
        # NOTE: 2000 grid points per period keep the trapezoid error of Lambda under 1e-6.
        steps = max(16, int(np.ceil(window_s / self.period_s * 2000)))
        breaks = np.linspace(0.0, window_s, steps + 1)
        rate = self.rate(qps, breaks)
        cumulative = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(breaks))])
        return _time_change(breaks, cumulative, window_s, rng, limit)


@dataclass(frozen=True)
class TraceArrivals:
    """Send times replayed from a file, times ``scale`` (0.5 plays twice as fast); ``qps`` is ignored.

    File format: one timestamp in seconds per line (any origin, e.g. Unix
    time; the earliest is time 0), or CSV whose first column is the
    timestamp; lines starting with ``#`` and a non-numeric header line are
    skipped. A trace shorter than the run is looped, one mean gap after its end.
    """

    times: tuple[float, ...]
    scale: float = 1.0
    path: str = ""
    name: str = "trace"

    @classmethod
    def from_file(cls, path: str, scale: float = 1.0) -> "TraceArrivals":
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise ValueError(f"bad arrival spec 'trace:{path}': cannot read it ({exc.strerror})") from None
        values = []
        for number, line in enumerate(lines):
            field = line.split(",")[0].strip()
            if not field or field.startswith("#"):
                continue
            try:
                values.append(float(field))
            except ValueError:
                if number == 0:
                    continue  # a CSV header
                raise ValueError(f"bad trace file {path!r}, line {number + 1}: {field!r} is not a number") from None
        if len(values) < 2:
            raise ValueError(f"bad trace file {path!r}: needs at least 2 timestamps, has {len(values)}")
        times = np.sort(np.asarray(values, dtype=np.float64))
        return cls(tuple((times - times[0]).tolist()), scale, path)

    def mean_qps(self) -> float:
        """The trace's own rate once scaled: what --qps would be."""
        t = np.asarray(self.times)
        return (t.size - 1) / (float(t[-1]) * self.scale) if t[-1] > 0 else float(t.size)

    def offsets(self, qps: float, window_s: float, rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
        if not window_s > 0:
            raise ValueError(f"the run window must be > 0 s, got {window_s}")
        base = np.asarray(self.times) * self.scale
        span = float(base[-1]) + (float(base[-1]) / (base.size - 1) if base[-1] > 0 else 1.0)
        loops = int(np.ceil(window_s / span)) if span > 0 else 1
        times = (base[None, :] + span * np.arange(loops)[:, None]).reshape(-1)
        times = times[times < window_s]
        return times[:limit] if limit is not None else times


ARRIVAL_KINDS: dict[str, ArrivalProcess] = {"poisson": PoissonArrivals(), "constant": ConstantArrivals()}
ARRIVAL_FORMS = ("poisson, constant, bursty[:on=S,off=S,factor=F[,markov=1]], "
                 "diurnal[:amplitude=A,period=S[,phase=RAD]], trace:PATH[,scale=X]")


def _params(spec: str, arg: str, allowed: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in arg.split(","))):
        key, eq, value = part.partition("=")
        try:
            if key not in allowed or not eq:
                raise ValueError
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"bad arrival spec {spec!r}: {part!r} is not one of "
                             f"{', '.join(k + '=NUMBER' for k in allowed)}; valid forms: {ARRIVAL_FORMS}") from None
    return out


def parse_arrival(spec: str) -> ArrivalProcess:
    """Any of ``ARRIVAL_FORMS``; the error lists them all."""
    text = spec.strip()
    kind, _, arg = text.partition(":")
    kind = kind.lower()
    if kind in ARRIVAL_KINDS and not arg:
        return ARRIVAL_KINDS[kind]
    bad = f"bad arrival spec {spec!r}: expected one of {ARRIVAL_FORMS}"
    if kind == "bursty":
        p = _params(spec, arg, ("on", "off", "factor", "markov"))
        process = BurstyArrivals(p.get("on", 2.0), p.get("off", 3.0), p.get("factor", 4.0), bool(p.get("markov", 0)))
        if not (process.on_s > 0 and process.off_s > 0 and process.factor >= 1):
            raise ValueError(f"{bad} (on > 0, off > 0, factor >= 1)")
        return process
    if kind == "diurnal":
        p = _params(spec, arg, ("amplitude", "period", "phase"))
        process = DiurnalArrivals(p.get("amplitude", 0.5), p.get("period", 60.0), p.get("phase", 0.0))
        if not (0 <= process.amplitude <= 1 and process.period_s > 0):
            raise ValueError(f"{bad} (0 <= amplitude <= 1, period > 0)")
        return process
    if kind == "trace" and arg:
        path, _, rest = arg.partition(",")
        p = _params(spec, rest, ("scale",))
        scale = p.get("scale", 1.0)
        if not scale > 0:
            raise ValueError(f"{bad} (scale > 0)")
        return TraceArrivals.from_file(path, scale)
    raise ValueError(bad)
