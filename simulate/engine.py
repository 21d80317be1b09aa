"""One simulated run: traffic through sixfold's own batcher and runtime, on a virtual clock.

What runs is the serving code itself, built as ``sixfold.server.loading.loader`` builds it: a
``DynamicBatcher`` (priority queues, batching window, admission by count, work and
timeout, with ``sixfold.server.scheduling.admission.PlanCost`` from the plan) feeding ``PlanRuntime.run``
(host stage, host-dense tuning, query splitting over idle cards, the least-loaded
router, card deadlines and hedging). Only the executables are virtual
(``sixfold.simulate.devices``): each stage is a FIFO server whose service time is the cost
model's. The loop is ``sixfold.simulate.vloop.VirtualTimeLoop``, so every ``sleep``, timer and
timeout in that code takes simulated seconds and no real ones.

The front end (gRPC decode, validation, encode) is one more FIFO server: each request
costs ``Platform.per_request_s`` (plus ``per_item_s`` an item) of the event loop before it is
queued. Latency is
measured from the request's scheduled arrival, as ``sixfold-loadgen`` measures it.

Not modelled: bytes-based admission (``max_queue_bytes``: batches carry no bytes here),
contention between host threads (the host stage, host-dense and front end are
independent servers, as if each had its own core), and card faults.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sixfold.loadgen.stats import percentiles
from sixfold.models.signature import DENSE, INDICES
from sixfold.server.scheduling.admission import PlanCost
from sixfold.server.scheduling.batcher import (DEFAULT_QUEUE_WORK_MS, DEFAULT_TIMEOUT_US, BatchingConfig, DynamicBatcher)
from sixfold.server.errors import ServingError
from sixfold.server.execution.runtime import DEFAULT_CARD_SCHEDULING, DEFAULT_MIN_SPLIT_ROWS, PlanRuntime

from sixfold.simulate.devices import POOLED, Server, VirtualLane, VirtualStage, empty_rows
from sixfold.simulate.platform import Platform
from sixfold.simulate.traffic import Arrivals
from sixfold.simulate.vloop import run_virtual

__all__ = ["ServingSettings", "RunResult", "simulate", "EVENTS_PER_REQUEST"]

MIN_PARALLEL_REQUESTS = 20_000
"""Below this many requests one process is faster than starting several."""
EVENTS_PER_REQUEST = 400
"""Event budget per request (a request takes ~10-40 loop callbacks); past it the run stops."""


@dataclass(frozen=True)
class ServingSettings:
    """The server's scheduling knobs, as ``sixfold-serve`` takes them (its defaults here)."""

    batching: BatchingConfig = field(default_factory=lambda: BatchingConfig(
        max_batch_rows=1024, max_queue_delay_microseconds=2000, max_queue_size=256,
        default_timeout_microseconds=DEFAULT_TIMEOUT_US, max_queue_work_ms=DEFAULT_QUEUE_WORK_MS))
    max_card_rows: int | None = 256
    """``--max-card-batch-rows`` (None: never split for size)."""
    min_split_rows: int = DEFAULT_MIN_SPLIT_ROWS
    card_scheduling: str = DEFAULT_CARD_SCHEDULING
    """``--card-scheduling``: "fifo" or "greedy"."""
    host_dense_max_rows: int = -1
    card_timeout_multiple: float = 10.0
    card_timeout_floor_s: float = 0.5


@dataclass
class RunResult:
    """What one simulated run measured, over the requests that arrived in the measured window."""

    rate: float
    """Offered rate, queries/s (a trace's own rate when replaying one)."""
    duration_s: float
    requests: int
    ok: int
    errors: dict[str, int]
    latency_ms: dict[str, float | None]
    """p50, p90, p95, p99, p999, max (nearest rank, answered requests) and mean."""
    queue_ms: dict[str, float | None]
    """Time in the batcher's queue (p50, p99, mean)."""
    queue_len: dict[str, float]
    """Requests waiting in the batcher, seen by arrivals (mean, p99, max)."""
    utilisation: dict[str, float]
    """Busy share of the measured window per device: frontend, host, host-dense, card0.. ."""
    batches: int
    mean_batch_rows: float
    host_dense_batches: int
    """Batches whose dense part ran on the host CPU."""
    card_batches: int
    """Batches (and parts of split batches) the cards ran, hedged copies included."""
    hedges: int
    items_per_s: float
    achieved_qps: float
    virtual_s: float
    """Virtual seconds simulated (warm-up and drain included)."""
    events: int
    wall_s: float = 0.0
    """Real seconds the simulation took."""
    latencies_s: np.ndarray | None = field(default=None, repr=False)
    """Latency of each measured request, seconds (NaN: refused or failed)."""
    queue_s: np.ndarray | None = field(default=None, repr=False)
    queue_lengths: np.ndarray | None = field(default=None, repr=False)
    jobs: int = 1
    """Processes that simulated it (``simulate``'s ``jobs``)."""

    @property
    def error_rate(self) -> float:
        return sum(self.errors.values()) / self.requests if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("latencies_s", "queue_s", "queue_lengths")}
        return out


def _frontend(arrivals: np.ndarray, items: np.ndarray, per_request_s: float, per_item_s: float,
              server: Server) -> np.ndarray:
    """When each request reaches the batcher: a FIFO front end of ``per_request_s + per_item_s x items``
    each (Lindley's recursion)."""
    if per_request_s <= 0 and per_item_s <= 0:
        return arrivals.copy()
    out = np.empty_like(arrivals)
    busy = -math.inf
    lo, hi = server.window
    busy_s = 0.0
    cost = (per_request_s + per_item_s * items.astype(np.float64)).tolist()
    for i, t in enumerate(arrivals.tolist()):
        start = t if t > busy else busy
        busy = start + cost[i]
        out[i] = busy
        b = min(busy, hi) - max(start, lo)
        if b > 0:
            busy_s += b
    server.busy_s, server.batches, server.busy_until = busy_s, int(arrivals.size), busy
    return out


def _last(arrive: Callable[[int], None], i: int, woken: asyncio.Future) -> None:
    arrive(i)
    woken.set_result(None)


def simulate(platform: Platform, arrivals: Arrivals, *, settings: ServingSettings = ServingSettings(),
             warmup_s: float = 0.0, progress: Callable[[float, float], None] | None = None,
             max_events: int | None = None, jobs: int = 1, overlap_s: float = 2.0) -> RunResult:
    """Run ``arrivals`` through the platform; statistics over those due at or after ``warmup_s``.

    ``progress(virtual_now, virtual_end)`` is called every few thousand requests. The run is
    bounded: ``max_events`` loop callbacks (default ``EVENTS_PER_REQUEST`` per request) and a
    virtual time of the traffic's span plus 10 minutes; past either it raises
    ``sixfold.simulate.vloop.SimulationLimit``.

    ``jobs`` > 1 cuts the measured window into that many consecutive segments simulated at once
    in as many processes (time-parallel simulation): each segment starts ``overlap_s`` earlier
    than it measures, so its queues are warm, and the measured requests are merged. Not
    bit-identical to one process (a segment forgets what queued more than ``overlap_s`` before
    it), but the same system on the same arrivals; deterministic for a given ``jobs``.
    """
    import time

    if jobs > 1 and len(arrivals) >= MIN_PARALLEL_REQUESTS:
        return _parallel(platform, arrivals, settings, warmup_s, jobs, overlap_s)
    n = len(arrivals)
    if n == 0:
        raise ValueError("no requests to simulate: the traffic drew none (raise --duration or the rate)")
    started = time.perf_counter()
    due = arrivals.offsets
    window_end = float(arrivals.window_s)
    frontend = Server("frontend")
    frontend.window = (warmup_s, window_end)
    enqueue_at = _frontend(due, arrivals.items, platform.per_request_s, platform.per_item_s, frontend)
    budget = max_events or EVENTS_PER_REQUEST * n + 100_000
    latency = np.full(n, np.nan)
    queue_s = np.full(n, np.nan)
    queue_len = np.zeros(n, dtype=np.int64)
    reasons: list[str | None] = [None] * n
    state: dict[str, Any] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        host = VirtualStage(platform.host, (DENSE, INDICES), POOLED, ids_per_item=platform.ids_per_item)
        lanes = [VirtualLane(stages, f"card{i}") for i, stages in enumerate(platform.lanes)]
        host_dense = (VirtualStage(platform.host_dense, (DENSE, POOLED), "scores")
                      if platform.host_dense is not None and settings.host_dense_max_rows != 0 else None)
        for stage in [host, *([host_dense] if host_dense else [])]:
            stage.server.window = (warmup_s, window_end)
        for lane in lanes:
            for server in lane.servers:
                server.window = (warmup_s, window_end)
        runtime = PlanRuntime(host, lanes, reload_card=None, max_card_rows=settings.max_card_rows,
                              min_split_rows=settings.min_split_rows, card_scheduling=settings.card_scheduling,
                              card_timeout_multiple=settings.card_timeout_multiple,
                              card_timeout_floor_s=settings.card_timeout_floor_s, host_dense=host_dense,
                              host_dense_max_rows=settings.host_dense_max_rows if host_dense else 0,
                              max_inline_s=0.0, clock=loop.time)
        batching = settings.batching
        inflight = batching.max_inflight_batches or len(lanes) + 1
        batcher = DynamicBatcher(runtime.run, batching, max_inflight=inflight, clock=loop.time,
                                 cost=PlanCost.from_plan(platform.plan) if platform.plan is not None else None,
                                 trim=None)
        state.update(host=host, lanes=lanes, host_dense=host_dense, runtime=runtime)
        outstanding = [0]
        finished = loop.create_future()
        requests: dict[tuple[int, int], dict] = {}
        rows_of, ids_of, due_at = arrivals.items.tolist(), arrivals.ids.tolist(), due.tolist()
        path_delay = [platform.path_delay_s(int(r)) for r in rows_of]  # gRPC and the client: no shared resource

        def answered(i: int, item: Any, future: asyncio.Future) -> None:
            outstanding[0] -= 1
            if future.cancelled():
                reasons[i] = "cancelled"
            else:
                exc = future.exception()
                if exc is None:
                    latency[i] = loop.time() - due_at[i] + path_delay[i]
                    if item.info is not None:
                        queue_s[i] = item.info.queue_s
                else:
                    batcher.abandon(item)
                    reasons[i] = getattr(exc, "reason", None) or type(exc).__name__
            if outstanding[0] == 0 and state.get("all_sent") and not finished.done():
                finished.set_result(None)

        every = max(1, n // 200)
        enqueue = batcher.enqueue

        def arrive(i: int) -> None:
            rows, ids = rows_of[i], ids_of[i]
            inputs = requests.get((rows, ids))
            if inputs is None:
                inputs = requests[(rows, ids)] = {DENSE: empty_rows(rows), INDICES: empty_rows(ids, "int64")}
            queue_len[i] = batcher.queued
            try:
                item = enqueue(inputs, rows)
            except ServingError as exc:
                reasons[i] = exc.reason
            else:
                outstanding[0] += 1
                item.future.add_done_callback(lambda f, i=i, item=item: answered(i, item, f))
            if progress is not None and i % every == 0:
                progress(loop.time(), window_end)

        # NOTE: arrivals are timers scheduled a chunk at a time (a timer each costs less than a
        # coroutine sleeping between them, and the heap stays small); the chunk's last one wakes us.
        chunk = 128
        for first in range(0, n, chunk):
            last = min(n, first + chunk)
            for i in range(first, last - 1):
                loop.call_at(float(enqueue_at[i]), arrive, i)
            woken = loop.create_future()
            loop.call_at(float(enqueue_at[last - 1]), _last, arrive, last - 1, woken)
            await woken
        state["all_sent"] = True
        if outstanding[0]:
            await finished
        state["end"] = loop.time()
        state["events"] = loop.events  # type: ignore[attr-defined]
        await batcher.close(drain=False)
        runtime.close()

    run_virtual(main(), max_events=budget, max_time_s=window_end + 600.0)
    return _result(arrivals, due, warmup_s, latency, queue_s, queue_len, reasons, frontend, state, budget,
                   time.perf_counter() - started)


def _result(arrivals: Arrivals, due: np.ndarray, warmup_s: float, latency: np.ndarray, queue_s: np.ndarray,
            queue_len: np.ndarray, reasons: list, frontend: Server, state: dict, budget: int,
            wall_s: float) -> RunResult:
    window = float(arrivals.window_s) - warmup_s
    mask = due >= warmup_s
    measured = latency[mask]
    ok = ~np.isnan(measured)
    errors: dict[str, int] = {}
    for i in np.flatnonzero(mask).tolist():
        if reasons[i] is not None:
            errors[reasons[i]] = errors.get(reasons[i], 0) + 1
    lat = percentiles(measured[ok], scale=1e3)
    lat["mean"] = float(measured[ok].mean() * 1e3) if ok.any() else None
    q = queue_s[mask]
    q = q[~np.isnan(q)]
    qp = percentiles(q, {"p50": 50, "p99": 99}, scale=1e3)
    qp["mean"] = float(q.mean() * 1e3) if q.size else None
    ql = queue_len[mask]
    util = {"frontend": frontend.busy_s / window}
    host, host_dense, lanes = state["host"], state["host_dense"], state["lanes"]
    util["host"] = host.server.busy_s / window
    if host_dense is not None:
        util["host-dense"] = host_dense.server.busy_s / window
    for lane in lanes:
        for server in lane.servers:
            util[server.name] = server.busy_s / window
    runtime = state["runtime"]
    items = arrivals.items[mask]
    answered_items = float(items[ok].sum())
    end = max(float(state.get("end", arrivals.window_s)), float(arrivals.window_s))
    span = max(window, end - warmup_s) if ok.any() else window
    return RunResult(
        rate=arrivals.rate, duration_s=window, requests=int(mask.sum()), ok=int(ok.sum()), errors=errors,
        latency_ms=lat, queue_ms=qp,
        queue_len={"mean": float(ql.mean()) if ql.size else 0.0,
                   "p99": float(np.percentile(ql, 99)) if ql.size else 0.0, "max": int(ql.max()) if ql.size else 0},
        utilisation={k: round(v, 4) for k, v in util.items()}, batches=host.server.batches,
        mean_batch_rows=host.server.rows / host.server.batches if host.server.batches else 0.0,
        host_dense_batches=host_dense.server.batches if host_dense is not None else 0,
        card_batches=sum(lane.servers[0].batches for lane in lanes), hedges=runtime.hedges, items_per_s=answered_items / span,
        achieved_qps=float(ok.sum()) / span, virtual_s=end, events=int(state.get("events", 0)), wall_s=wall_s,
        latencies_s=latency[mask], queue_s=queue_s[mask], queue_lengths=ql)


_JOB: dict[str, Any] = {}


def _segment(k: int) -> RunResult:
    job = _JOB
    return simulate(job["platform"], job["segments"][k][0], settings=job["settings"], warmup_s=job["segments"][k][1])


def _parallel(platform: Platform, arrivals: Arrivals, settings: ServingSettings, warmup_s: float, jobs: int,
              overlap_s: float) -> RunResult:
    """``simulate`` over ``jobs`` consecutive segments in parallel processes, merged (see its docstring)."""
    import multiprocessing
    import time

    started = time.perf_counter()
    end = float(arrivals.window_s)
    bounds = np.linspace(warmup_s, end, jobs + 1)
    segments = []
    for k in range(jobs):
        lo = 0.0 if k == 0 else max(0.0, bounds[k] - overlap_s)
        keep = (arrivals.offsets >= lo) & (arrivals.offsets < bounds[k + 1])
        part = Arrivals(arrivals.offsets[keep], arrivals.items[keep], arrivals.ids[keep], arrivals.rate,
                        float(bounds[k + 1]))
        segments.append((part, float(bounds[k])))
    _JOB.update(platform=platform, settings=settings, segments=segments)
    try:
        # NOTE: fork: the children inherit the platform (its plan and prices) and run no torch code.
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            parts = pool.map(_segment, range(jobs))
    finally:
        _JOB.clear()
    return _merge(parts, arrivals, warmup_s, time.perf_counter() - started)


def _merge(parts: list[RunResult], arrivals: Arrivals, warmup_s: float, wall_s: float) -> RunResult:
    window = float(arrivals.window_s) - warmup_s
    latency = np.concatenate([p.latencies_s for p in parts])
    queue = np.concatenate([p.queue_s for p in parts])
    lengths = np.concatenate([p.queue_lengths for p in parts])
    ok = ~np.isnan(latency)
    errors: dict[str, int] = {}
    for p in parts:
        for reason, count in p.errors.items():
            errors[reason] = errors.get(reason, 0) + count
    lat = percentiles(latency[ok], scale=1e3)
    lat["mean"] = float(latency[ok].mean() * 1e3) if ok.any() else None
    q = queue[~np.isnan(queue)]
    qp = percentiles(q, {"p50": 50, "p99": 99}, scale=1e3)
    qp["mean"] = float(q.mean() * 1e3) if q.size else None
    util = {name: round(sum(p.utilisation[name] * p.duration_s for p in parts) / window, 4)
            for name in parts[0].utilisation}
    batches = sum(p.batches for p in parts)
    items = arrivals.items[arrivals.offsets >= warmup_s]
    return RunResult(
        rate=arrivals.rate, duration_s=window, requests=int(latency.size), ok=int(ok.sum()), errors=errors,
        latency_ms=lat, queue_ms=qp,
        queue_len={"mean": float(lengths.mean()) if lengths.size else 0.0,
                   "p99": float(np.percentile(lengths, 99)) if lengths.size else 0.0,
                   "max": int(lengths.max()) if lengths.size else 0},
        utilisation=util, batches=batches,
        mean_batch_rows=sum(p.mean_batch_rows * p.batches for p in parts) / batches if batches else 0.0,
        host_dense_batches=sum(p.host_dense_batches for p in parts), card_batches=sum(p.card_batches for p in parts),
        hedges=sum(p.hedges for p in parts), items_per_s=float(items[ok].sum()) / window,
        achieved_qps=float(ok.sum()) / window, virtual_s=max(p.virtual_s for p in parts),
        events=sum(p.events for p in parts), wall_s=wall_s, latencies_s=latency, queue_s=queue,
        queue_lengths=lengths, jobs=len(parts))
