"""One whole run: wait for the server, learn the model's shape, plan, drive, summarize.

Everything slow or random (request generation, encoding, drawing arrivals and
sizes) happens before the clock starts; the measured part is only the driver.
The pieces (``Target``, ``plan_run``, ``drive``, ``summarize``) are public so
that a sweep (``sixfold.loadgen.sweep``) can run many steps over one connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console

from sixfold.models.requests import RequestGenerator, parse_query_sizes

from sixfold.loadgen.arrivals import ConstantArrivals, TraceArrivals, parse_arrival
from sixfold.loadgen.batch_dim import BatchDimTransport
from sixfold.loadgen.clock import Clock, MonotonicClock
from sixfold.loadgen.config import CLOSED_LOOP_QUERIES, LoadConfig
from sixfold.loadgen.driver import ClosedLoopDriver, OpenLoopDriver
from sixfold.loadgen.errors import LoadgenError
from sixfold.loadgen.progress import live_progress
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.recording import Recording, load_recording, save_recording
from sixfold.loadgen.report import Report, endpoint_note
from sixfold.loadgen.schedule import QueryPool, Schedule, build_schedule
from sixfold.loadgen.stats import latency_cdf, timeline, window_stats
from sixfold.loadgen.target import (ModelShape, ShapeOverrides, discover_shape, published_facts, unreachable_hint,
                                    wait_until_ready)
from sixfold.loadgen.connect import make_client, make_transport
from sixfold.loadgen.transport import Transport, connection_options

__all__ = ["run_load", "run_load_async", "plan_run", "summarize", "drive", "Target", "resolve_config",
           "schedule_from_recording", "generator_for"]

FEW_SAMPLES = 100
"""Below this many answered requests in the window, the report warns that its p99 is about its max."""
ClientFactory = Callable[[str], Any]
"""Makes the control-plane client from a URL (tests pass fakes); None: ``make_client`` with the run's
protocol and TLS (``config.protocol``, ``config.ssl``, ``config.root_certificates``)."""


def generator_for(config: LoadConfig, shape: ModelShape) -> RequestGenerator:
    """The seeded request generator for ``config`` and ``shape`` (contents: seed + 1)."""
    return RequestGenerator(shape.table_rows, shape.dense_dim, shape.pooling, zipf=shape.zipf,
                            seed=config.seed + 1, fixed_pooling=shape.fixed_pooling)


def _recorded_shape(recording: Recording) -> dict[str, Any]:
    """The recording's model shape as LoadConfig overrides (empty for what it does not say)."""
    shape = recording.shape
    out: dict[str, Any] = {}
    if shape.get("table_rows"):
        out["table_rows"] = tuple(int(r) for r in shape["table_rows"])
    if shape.get("pooling"):
        out["pooling"] = tuple(int(p) for p in shape["pooling"])
    if shape.get("dense_dim"):
        out["dense_dim"] = int(shape["dense_dim"])
    if shape.get("zipf") is not None:
        zipf = shape["zipf"]
        out["zipf"] = tuple(float(z) for z in zipf) if isinstance(zipf, list) else float(zipf)
    return out


def resolve_config(config: LoadConfig, recording: Recording | None = None) -> LoadConfig:
    """Fill in what ``config`` leaves to its inputs: the trace's rate, or a replayed run's window and shape.

    A replay takes the model shape (table rows, pooling, dense dim, zipf) from
    the recording, so it needs no ``--table-rows`` even against a server that
    does not publish them; the server's own metadata is checked against it.
    """
    if recording is not None:
        recorded = recording.meta.get("config", {})
        return dataclasses.replace(
            config, qps=float(recorded.get("qps") or recording.meta.get("offered_qps") or 0.0),
            duration_s=float(recorded.get("duration_s", config.duration_s)),
            warmup_s=float(recorded.get("warmup_s", 0.0)), arrival="replay",
            query_size=str(recorded.get("query_size", config.query_size)), concurrency=None, max_requests=None,
            **_recorded_shape(recording))
    if config.concurrency is None and config.qps == 0:
        arrival = parse_arrival(config.arrival)
        if isinstance(arrival, TraceArrivals):
            return dataclasses.replace(config, qps=round(arrival.mean_qps(), 6))
    return config


def plan_run(config: LoadConfig, shape: ModelShape, encode: Callable[[dict[str, np.ndarray]], Any], *,
             keep_tensors: bool = False) -> Schedule:
    """The schedule for ``config``: seeded arrivals and sizes, and the encoded query pool.

    In closed loop the offsets are nominal (evenly spread over the window, used
    only to slice drifting ids); the driver sends entry ``i % len`` as it goes.
    """
    rng = np.random.default_rng(config.seed)
    window = config.warmup_s + config.duration_s
    if config.concurrency is not None:
        count = min(config.max_requests or CLOSED_LOOP_QUERIES, CLOSED_LOOP_QUERIES)
        arrival, qps, limit = ConstantArrivals(), count / window, count
    else:
        arrival, qps, limit = parse_arrival(config.arrival), config.qps, config.max_requests
    return build_schedule(arrival, qps, window, parse_query_sizes(config.query_size), generator_for(config, shape),
                          encode, pool=config.pool, rng=rng, limit=limit, drift=config.id_drift,
                          keep_tensors=keep_tensors)


def schedule_from_recording(recording: Recording, encode: Callable[[dict[str, np.ndarray]], Any],
                            *, keep_tensors: bool = False) -> Schedule:
    """The recorded run's schedule: its due times, and the very tensors each request carried."""
    tensors = recording.tensors  # rebuilt from the recipe (and checked) before anything is sent
    pool = QueryPool(tuple(encode(t) for t in tensors), np.asarray(recording.pool_items, dtype=np.int64),
                     tensors if keep_tensors else None, recording.recipe)
    return Schedule(np.asarray(recording.due, dtype=np.float64), np.asarray(recording.query), pool)


def _warnings(stats: dict[str, Any], config: LoadConfig, truncated: bool) -> list[str]:
    out = []
    lag, req = stats["send_lag_ms"], stats["requests"]
    if lag["late"] and config.concurrency is None:
        share = lag["late"] / max(1, req["sent"])
        head = "GENERATOR FELL BEHIND" if lag["p99"] > lag["threshold_ms"] else "note: generator was late"
        out.append(f"{head}: {lag['late']} of {req['sent']} requests ({share:.1%}) were sent more than "
                   f"{lag['threshold_ms']:g} ms after their scheduled time (send lag p99 {lag['p99']:.1f} ms, "
                   f"max {lag['max']:.1f} ms); latencies include that lag"
                   + ("; the load offered was not the target: give the loadgen its own CPU cores "
                      "(e.g. taskset), lower --qps, or spread the load with --processes N"
                      if head.startswith("GEN") else ""))
    if req["unsent"]:
        out.append(f"{req['unsent']} scheduled requests were never sent (run interrupted)")
    if config.concurrency is None and req["ok"] and stats["achieved_qps"] < 0.95 * stats["scheduled_qps"]:
        out.append(f"server kept up with only {stats['achieved_qps']:.1f} of {stats['scheduled_qps']:.1f} "
                   f"queries/s (answers took {stats['answer_span_s']:.1f} s for a {stats['window_s']:g} s window)")
    if truncated:
        out.append(f"max_requests={config.max_requests} cut the schedule short: the measured window "
                   f"is {stats['window_s']:.2f} s, not {config.duration_s:g} s")
    if 0 < req["ok"] < FEW_SAMPLES:
        # NOTE: nearest rank: with n < 100 answers, p99 is the slowest one (n <= 100: rank n) or next to it
        out.append(f"few samples: the latency percentiles rest on {req['ok']} answered requests; p99 needs "
                   f"{FEW_SAMPLES} or more to be more than the slowest of them (p99.9: 1000): measure longer "
                   f"(--duration) or at a higher rate for a tail worth quoting")
    return out


def summarize(record: RunRecord, config: LoadConfig, target: dict[str, Any], *,
              started_at: str = "", wall_s: float = 0.0) -> Report:
    """The Report of the measured window [warmup_s, warmup_s + duration_s) of ``record``."""
    duration = config.duration_s
    truncated = config.max_requests is not None and len(record) >= config.max_requests
    if truncated and len(record):
        # A schedule cut by max_requests ends early: measure over what was scheduled.
        gap = 1.0 / config.qps if config.qps > 0 else 1e-3
        last = float(record.due[len(record) - 1]) + gap - config.warmup_s
        duration = max(min(duration, last), 1e-3)
    stats = window_stats(record, config.warmup_s, duration, lag_threshold_ms=config.lag_threshold_ms)
    stats["window_s"] = duration
    warm = window_stats(record, 0.0, config.warmup_s, lag_threshold_ms=config.lag_threshold_ms) \
        if config.warmup_s > 0 else None
    mode = "closed" if config.concurrency is not None else ("replay" if config.replay_path else "open")
    return Report(
        config=config.to_dict(), target=target, duration_s=round(duration, 6),
        offered_qps=config.qps if mode != "closed" else 0.0,
        scheduled_qps=stats["scheduled_qps"], achieved_qps=stats["achieved_qps"],
        items_per_s=stats["items_per_s"], answer_span_s=stats["answer_span_s"], requests=stats["requests"],
        latency_ms=stats["latency_ms"], query_size=stats["query_size"], send_lag_ms=stats["send_lag_ms"],
        errors_by_reason=stats["errors_by_reason"], timeline=timeline(record, config.warmup_s, duration),
        warmup=warm["requests"] if warm else {}, warnings=_warnings(stats, config, truncated),
        started_at=started_at, wall_s=round(wall_s, 3), mode=mode, concurrency=config.concurrency,
        latency_cdf_ms=latency_cdf(record, config.warmup_s, duration))


class Target:
    """``async with Target(config) as t``: a ready server, the model's shape, an open transport."""

    def __init__(self, config: LoadConfig, client_factory: ClientFactory | None = None, *,
                 recorded_shape: dict[str, Any] | None = None) -> None:
        self.config = config
        self.recorded_shape = recorded_shape
        """A replayed recording's shape: the server's must agree with it (checked on entry)."""
        self.client = (client_factory(config.url) if client_factory is not None
                       else make_client(config.url, **connection_options(config)))
        self.transport: Transport | None = None
        self.shape: ModelShape | None = None

    async def __aenter__(self) -> "Target":
        config = self.config
        try:
            await wait_until_ready(self.client, config.url, config.model, config.model_version, config.wait_ready_s,
                                   hint=unreachable_hint(config.protocol, config.ssl))
            overrides = ShapeOverrides(config.table_rows, config.pooling, config.dense_dim, config.zipf,
                                       config.batch_dim)
            if self.recorded_shape is not None:
                await self._check_recorded_shape()
            self.shape = await discover_shape(self.client, config.model, config.model_version, overrides)
            if self.recorded_shape is not None:
                for key in ("table_rows", "pooling", "dense_dim", "zipf"):
                    if key in self.recorded_shape:
                        self.shape.sources[key] = "recording"
            self.transport = make_transport(config.client, config.url, self.client, config.model,
                                            config.model_version, config.channels, config.ids_dtype,
                                            **connection_options(config), deadline_s=config.deadline_s)
            if config.batch_dim:
                self.transport = BatchDimTransport(self.transport)
            await self.transport.connect(max(1.0, config.wait_ready_s))
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _check_recorded_shape(self) -> None:
        """Refuse a replay whose recorded features or ids do not fit what the server publishes."""
        assert self.recorded_shape is not None
        config, recorded = self.config, self.recorded_shape
        where, model = repr(config.replay_path), repr(config.model)
        facts = await published_facts(self.client, config.model, config.model_version)
        dim = recorded.get("dense_dim")
        if dim is not None and facts.get("dense_dim") not in (None, dim):
            raise LoadgenError(f"recording {where} has {dim} dense features per item but model {model} "
                               f"takes {facts['dense_dim']}")
        rows = recorded.get("table_rows") or ()
        if rows and facts.get("tables") not in (None, len(rows)):
            raise LoadgenError(f"recording {where} has {len(rows)} tables but model {model} has {facts['tables']}")
        served = facts.get("table_rows")
        if rows and served:
            served = served * len(rows) if len(served) == 1 else served
            short = [(k, r, p) for k, (r, p) in enumerate(zip(rows, served)) if p < r]
            if short:
                k, r, p = short[0]
                more = f" (and {len(short) - 1} more tables)" if len(short) > 1 else ""
                raise LoadgenError(f"recording {where} was made for {r} rows in table {k}, but model {model} "
                                   f"has {p}{more}: its ids would be out of range; replay it against the "
                                   f"model shape it recorded")

    async def __aexit__(self, *exc: object) -> None:
        if self.transport is not None:
            await self.transport.close()
        await self.client.close()

    def describe(self, schedule: Schedule) -> dict[str, Any]:
        """The report's ``target``."""
        assert self.shape is not None
        return {"url": self.config.url, "protocol": self.config.protocol, "ssl": self.config.ssl,
                "model": self.config.model, "version": self.config.model_version,
                "pool_queries": len(schedule.pool), **self.shape.to_dict()}


async def drive(config: LoadConfig, schedule: Schedule, transport: Transport, *, clock: Clock,
                console: Console | None = None) -> tuple[RunRecord, str, float]:
    """Send ``schedule`` open- or closed-loop per ``config``; (record, started_at, wall seconds)."""
    payloads, query, infer = schedule.pool.payloads, schedule.query, transport.infer
    window = config.warmup_s + config.duration_s
    if config.concurrency is not None:
        entries = len(schedule)
        all_items = schedule.items

        async def send(i: int) -> None:
            k = i % entries
            await infer(payloads[query[k]], int(all_items[k]))

        record = RunRecord.growing(min(entries, 1 << 16))
        driver: Any = ClosedLoopDriver(send, lambda i: int(all_items[i % entries]), concurrency=config.concurrency,
                                       window_s=window, limit=config.max_requests, clock=clock,
                                       drain_timeout_s=config.drain_timeout_s)
    else:
        items = schedule.items

        async def send(i: int) -> None:
            await infer(payloads[query[i]], int(items[i]))

        record = RunRecord(schedule.offsets, items)
        driver = OpenLoopDriver(send, clock=clock, drain_timeout_s=config.drain_timeout_s)
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    wall = time.perf_counter()
    if console is not None:
        async with live_progress(record, clock, console, window, warmup_s=config.warmup_s):
            await driver.run(record)
    else:
        await driver.run(record)
    return record, started_at, time.perf_counter() - wall


async def run_load_async(config: LoadConfig, *, console: Console | None = None, clock: Clock | None = None,
                         client_factory: ClientFactory | None = None) -> Report:
    """Run ``config`` on the running event loop and return its Report.

    Raises ``LoadgenError`` when the server or model cannot be used, and
    ``ValueError`` for bad specs. Live progress goes to ``console`` if given.
    ``clock`` times the schedule (tests pass a fake one); ``client_factory``
    makes the client used for readiness and discovery (and for sending, with
    ``client="tritonclient"``; default: ``make_client`` for the config's
    protocol and TLS). With
    ``config.replay_path`` the recorded schedule and tensors are sent; with
    ``config.record_path`` the run is saved (see ``sixfold.loadgen.recording``).
    """
    clock = clock or MonotonicClock()
    recording = load_recording(config.replay_path) if config.replay_path else None
    config = resolve_config(config, recording)
    keep = config.record_path is not None
    recorded = _recorded_shape(recording) if recording is not None else None
    async with Target(config, client_factory, recorded_shape=recorded) as target:
        assert target.transport is not None and target.shape is not None
        prepared = time.perf_counter()
        if recording is not None:
            schedule = schedule_from_recording(recording, target.transport.prepare, keep_tensors=keep)
        else:
            schedule = plan_run(config, target.shape, target.transport.prepare, keep_tensors=keep)
        if console is not None:
            how = (f"closed loop, {config.concurrency} outstanding" if config.concurrency is not None
                   else f"{len(schedule)} requests ({config.arrival} {config.qps:g} q/s")
            console.print(f"{config.model} @ {config.url}{endpoint_note(connection_options(config))}: "
                          f"{target.shape.num_tables} tables, "
                          f"{target.shape.dense_dim} dense; {len(schedule.pool)} queries prepared in "
                          f"{time.perf_counter() - prepared:.1f} s; sending {how}, "
                          f"{config.warmup_s:g} s warmup + {config.duration_s:g} s"
                          + (")" if config.concurrency is None else ""), markup=False, highlight=False)
        # NOTE: what this process holds (the prepared pool; in a benchmark also torch and a model) out of
        # the collector's full passes while it sends: one took ~95 ms with a model loaded, a stall that
        # would count against the server as latency (unfrozen after: the pool must be freeable)
        gc.collect()
        gc.freeze()
        try:
            record, started_at, wall_s = await drive(config, schedule, target.transport, clock=clock, console=console)
        finally:
            gc.unfreeze()
        described = target.describe(schedule)
    report = summarize(record, config, described, started_at=started_at, wall_s=wall_s)
    if config.record_path is not None:
        n = len(record)
        sent_query = schedule.query[np.arange(n) % max(1, len(schedule))] if config.concurrency else schedule.query
        assert schedule.pool.tensors is not None
        assert target.shape is not None
        shape = {k: v for k, v in target.shape.to_dict().items() if k in ("dense_dim", "table_rows", "pooling", "zipf")}
        save_recording(config.record_path, record, sent_query, schedule.pool.tensors,
                       {"config": config.to_dict(), "target": described, "started_at": started_at,
                        "mode": report.mode, "offered_qps": report.offered_qps},
                       recipe=schedule.pool.recipe, shape=shape)
        report.recording = str(config.record_path)
    return report


def run_load(config: LoadConfig, *, console: Console | None = None) -> Report:
    """Blocking ``run_load_async`` on a fresh event loop (not from inside a running loop)."""
    return asyncio.run(run_load_async(config, console=console))
