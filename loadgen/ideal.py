"""The latency-bounded throughput of an ideal server: what a p99 bound leaves of a machine's speed.

A server that ran every query at the machine's best offline speed, back to back, with no overhead
at all, would still queue: open-loop arrivals bunch up, and a heavy-tailed query mix puts large
queries in front of others. ``ideal_max_qps`` simulates that server (one FIFO queue, work
conserving, service time = items / ``items_per_s``) on Poisson arrivals and finds the highest
rate whose p99 latency stays within a bound. It is the yardstick for a real server's figure:
"offline q/s" ignores queueing, so no server reaches it under a tight bound.

Optimistic on purpose: every query runs at the best batch's speed whatever its size, and the
whole machine serves one query at a time (splitting a query over cores costs nothing). A real
server can only be slower, except by a different queue discipline (FIFO is what sixfold and the
servers it is compared with do per model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sixfold.models.requests import QuerySizes

__all__ = ["IdealServerResult", "ideal_latencies", "ideal_max_qps"]


def ideal_latencies(sizes: np.ndarray, gaps: np.ndarray, items_per_s: float) -> np.ndarray:
    """Seconds from arrival to answer of each query, for arrival gaps ``gaps`` (Lindley's recursion)."""
    service = np.asarray(sizes, dtype=np.float64) / items_per_s
    latencies = np.empty_like(service)
    wait = 0.0
    for i, (s, gap) in enumerate(zip(service.tolist(), gaps.tolist())):
        wait = max(0.0, wait - gap) if i else 0.0
        latencies[i] = wait + s
        wait += s
    return latencies


@dataclass(frozen=True)
class IdealServerResult:
    max_qps: float
    """Highest rate whose p99 is within the bound (0: the largest query alone exceeds it)."""
    p99_ms: float
    """p99 at that rate."""
    capacity_qps: float
    """items_per_s / mean query size: the rate with no latency bound."""

    @property
    def fraction_of_capacity(self) -> float:
        return self.max_qps / self.capacity_qps if self.capacity_qps else 0.0


def ideal_max_qps(items_per_s: float, query_sizes: QuerySizes, p99_ms: float, *, queries: int = 50_000,
                  seed: int = 0, tolerance: float = 0.002) -> IdealServerResult:
    """Bisect the Poisson rate at which the ideal server's p99 is ``p99_ms`` (within ``tolerance``, relative).

    One stream of sizes and unit exponential gaps is drawn once and scaled per rate (common random
    numbers), so p99 rises monotonically with the rate and the bisection is exact for that stream.
    """
    if items_per_s <= 0 or p99_ms <= 0 or queries < 100:
        raise ValueError(f"need items_per_s > 0, p99_ms > 0 and queries >= 100; got {items_per_s}, {p99_ms}, {queries}")
    rng = np.random.default_rng(seed)
    sizes = query_sizes.sample(rng, queries)
    unit_gaps = rng.exponential(1.0, queries)
    capacity = items_per_s / float(sizes.mean())
    bound_s = p99_ms / 1e3

    def p99(rate: float) -> float:
        return float(np.percentile(ideal_latencies(sizes, unit_gaps / rate, items_per_s), 99))

    alone = p99(1e-9)  # queries never queued
    if alone > bound_s:  # the p99 query is too slow by itself
        return IdealServerResult(0.0, alone * 1e3, capacity)
    lo, hi = 0.0, capacity  # at capacity the queue grows without bound
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p99(mid) <= bound_s else (lo, mid)
    return IdealServerResult(lo, (p99(lo) if lo else alone) * 1e3, capacity)
