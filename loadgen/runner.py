"""One whole run: wait for the server, learn the model's shape, plan, drive, summarize.

Everything slow or random (request generation, encoding, drawing arrivals and
sizes) happens before the clock starts; the measured part is only the driver.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console

from models.requests import RequestGenerator, parse_query_sizes

from .arrivals import parse_arrival
from .clock import Clock, MonotonicClock
from .config import LoadConfig
from .driver import OpenLoopDriver
from .progress import live_progress
from .record import RunRecord
from .report import Report
from .schedule import Schedule, build_schedule
from .stats import timeline, window_stats
from .target import ModelShape, ShapeOverrides, discover_shape, wait_until_ready
from .transport import Transport, make_client, make_transport

__all__ = ["run_load", "run_load_async", "plan_run", "summarize"]

ClientFactory = Callable[[str], Any]


def plan_run(config: LoadConfig, shape: ModelShape, encode: Callable[[dict[str, np.ndarray]], Any]) -> Schedule:
    """The schedule for ``config``: seeded arrivals and sizes, and the encoded query pool."""
    rng = np.random.default_rng(config.seed)
    generator = RequestGenerator(shape.table_rows, shape.dense_dim, shape.pooling, zipf=shape.zipf,
                                 seed=config.seed + 1)
    return build_schedule(parse_arrival(config.arrival), config.qps, config.warmup_s + config.duration_s,
                          parse_query_sizes(config.query_size), generator, encode,
                          pool=config.pool, rng=rng, limit=config.max_requests)


def _warnings(stats: dict[str, Any], config: LoadConfig, truncated: bool) -> list[str]:
    out = []
    lag, req = stats["send_lag_ms"], stats["requests"]
    if lag["late"]:
        share = lag["late"] / max(1, req["sent"])
        head = "GENERATOR FELL BEHIND" if lag["p99"] > lag["threshold_ms"] else "note: generator was late"
        out.append(f"{head}: {lag['late']} of {req['sent']} requests ({share:.1%}) were sent more than "
                   f"{lag['threshold_ms']:g} ms after their scheduled time (send lag p99 {lag['p99']:.1f} ms, "
                   f"max {lag['max']:.1f} ms); latencies include that lag"
                   + ("; the load offered was not the target: give the loadgen its own CPU cores "
                      "(e.g. taskset) or lower --qps" if head.startswith("GEN") else ""))
    if req["unsent"]:
        out.append(f"{req['unsent']} scheduled requests were never sent (run interrupted)")
    if req["ok"] and stats["achieved_qps"] < 0.95 * stats["scheduled_qps"]:
        out.append(f"server kept up with only {stats['achieved_qps']:.1f} of {stats['scheduled_qps']:.1f} "
                   f"queries/s (answers took {stats['answer_span_s']:.1f} s for a {stats['window_s']:g} s window)")
    if truncated:
        out.append(f"max_requests={config.max_requests} cut the schedule short: the measured window "
                   f"is {stats['window_s']:.2f} s, not {config.duration_s:g} s")
    return out


def summarize(record: RunRecord, config: LoadConfig, target: dict[str, Any], *,
              started_at: str = "", wall_s: float = 0.0) -> Report:
    """The Report of the measured window [warmup_s, warmup_s + duration_s) of ``record``."""
    duration = config.duration_s
    truncated = config.max_requests is not None and len(record) >= config.max_requests
    if truncated:
        # A schedule cut by max_requests ends early: measure over what was scheduled.
        last = float(record.due[-1]) + 1.0 / config.qps - config.warmup_s
        duration = max(min(duration, last), 1e-3)
    stats = window_stats(record, config.warmup_s, duration, lag_threshold_ms=config.lag_threshold_ms)
    stats["window_s"] = duration
    warm = window_stats(record, 0.0, config.warmup_s, lag_threshold_ms=config.lag_threshold_ms) \
        if config.warmup_s > 0 else None
    return Report(
        config=config.to_dict(), target=target, duration_s=round(duration, 6), offered_qps=config.qps,
        scheduled_qps=stats["scheduled_qps"], achieved_qps=stats["achieved_qps"],
        items_per_s=stats["items_per_s"], answer_span_s=stats["answer_span_s"], requests=stats["requests"],
        latency_ms=stats["latency_ms"], query_size=stats["query_size"], send_lag_ms=stats["send_lag_ms"],
        errors_by_reason=stats["errors_by_reason"], timeline=timeline(record, config.warmup_s, duration),
        warmup=warm["requests"] if warm else {}, warnings=_warnings(stats, config, truncated),
        started_at=started_at, wall_s=round(wall_s, 3))


async def run_load_async(config: LoadConfig, *, console: Console | None = None, clock: Clock | None = None,
                         client_factory: ClientFactory = make_client) -> Report:
    """Run ``config`` on the running event loop and return its Report.

    Raises ``LoadgenError`` when the server or model cannot be used, and
    ``ValueError`` for bad specs. Live progress goes to ``console`` if given.
    ``clock`` times the schedule (tests pass a fake one); ``client_factory``
    makes the tritonclient ``InferenceServerClient`` used for readiness and
    discovery (and for sending, with ``client="tritonclient"``).
    """
    clock = clock or MonotonicClock()
    client = client_factory(config.url)
    transport: Transport | None = None
    try:
        await wait_until_ready(client, config.url, config.model, config.model_version, config.wait_ready_s)
        overrides = ShapeOverrides(config.table_rows, config.pooling, config.dense_dim, config.zipf)
        shape = await discover_shape(client, config.model, config.model_version, overrides)
        transport = make_transport(config.client, config.url, client, config.model, config.model_version)
        prepared = time.perf_counter()
        schedule = plan_run(config, shape, transport.prepare)
        await transport.connect(max(1.0, config.wait_ready_s))
        if console is not None:
            console.print(f"{config.model} @ {config.url}: {shape.num_tables} tables, {shape.dense_dim} dense; "
                          f"{len(schedule.pool)} queries prepared in {time.perf_counter() - prepared:.1f} s; "
                          f"sending {len(schedule)} requests ({config.arrival} {config.qps:g} q/s, "
                          f"{config.warmup_s:g} s warmup + {config.duration_s:g} s)", markup=False, highlight=False)
        payloads, query = schedule.pool.payloads, schedule.query
        infer = transport.infer
        items = schedule.items

        async def send(i: int) -> None:
            await infer(payloads[query[i]], int(items[i]))

        record = RunRecord(schedule.offsets, items)
        driver = OpenLoopDriver(send, clock=clock, drain_timeout_s=config.drain_timeout_s)
        started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        wall = time.perf_counter()
        if console is not None:
            async with live_progress(record, clock, console, config.warmup_s + config.duration_s,
                                     warmup_s=config.warmup_s):
                await driver.run(record)
        else:
            await driver.run(record)
        wall_s = time.perf_counter() - wall
    finally:
        if transport is not None:
            await transport.close()
        await client.close()
    target = {"url": config.url, "model": config.model, "version": config.model_version,
              "pool_queries": len(schedule.pool), **shape.to_dict()}
    return summarize(record, config, target, started_at=started_at, wall_s=wall_s)


def run_load(config: LoadConfig, *, console: Console | None = None) -> Report:
    """Blocking ``run_load_async`` on a fresh event loop (not from inside a running loop)."""
    return asyncio.run(run_load_async(config, console=console))
