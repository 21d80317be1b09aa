"""An open-loop load generator that can offer many times a server's rate of MLPerf-sized queries.

Why not sixfold-loadgen's driver for an overload at MLPerf sizes: its schedule pools one query per
distinct size drawn (~600 for 100-700 items: ~5 GB of serialized rm2 requests, minutes to build
on a small host), and with the generator on the same cores as the server it could not offer rm2
10x its rate. Here a small pool (``pool`` queries, their sizes drawn from the same distribution)
is serialized once; a send is one gRPC generic unary call whose request serializer is identity
(the pooled bytes go as they are) and whose answer is not decoded (its status is the outcome);
several sender processes split the rate, each with its own connection. Every run reports the
rate offered against the rate actually sent and how late sends were, so a result says whether the
generator kept up (``kept_up``) before anything is concluded about the server.

    from bench.serialized_load import build_pool, run_senders, summarize_sends
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

__all__ = ["SerializedPool", "Sends", "build_pool", "open_loop", "closed_loop", "run_senders", "summarize_sends",
           "OK", "REFUSED", "FAILED", "SKIPPED"]

_MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
OK, REFUSED, FAILED, SKIPPED = 0, 1, 2, 3
"""A send's outcome: answered; RESOURCE_EXHAUSTED; another error; not sent (``max_outstanding`` reached)."""
KEPT_UP_SHARE = 0.95
"""The generator kept up when it sent at least this share of the scheduled requests..."""
KEPT_UP_LAG_MS = 50.0
"""...with sends at most this late (p99) after their scheduled time."""


@dataclass(frozen=True)
class SerializedPool:
    """Serialized ModelInferRequests and their items (queries) each."""

    payloads: tuple[bytes, ...]
    items: np.ndarray

    @property
    def mean_bytes(self) -> float:
        return float(np.mean([len(p) for p in self.payloads]))


async def _build_pool(url: str, model: str, size: int, query_size: str, seed: int) -> SerializedPool:
    from sixfold.loadgen import LoadConfig, Target
    from sixfold.loadgen.runner import generator_for
    from sixfold.models.requests import parse_query_sizes

    config = LoadConfig(url=url, model=model, qps=1, duration_s=1, query_size=query_size, seed=seed)
    async with Target(config) as target:
        generator = generator_for(config, target.shape)
        items = np.sort(np.asarray(parse_query_sizes(query_size).sample(np.random.default_rng(seed), size), np.int64))
        payloads = tuple(target.transport.prepare(generator.make(int(n))) for n in items)
    return SerializedPool(payloads, items)


def build_pool(url: str, model: str, *, size: int = 16, query_size: str = "mlperf", seed: int = 0) -> SerializedPool:
    """``size`` queries for ``model`` at ``url`` (its shape asked from the server), serialized once."""
    if size < 1:
        raise ValueError(f"pool size must be >= 1, got {size}")
    return asyncio.run(_build_pool(url, model, size, query_size, seed))


@dataclass
class Sends:
    """One run's requests, times in seconds since its start: scheduled, sent (NaN: never), answered."""

    scheduled: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    outcome: np.ndarray
    items: np.ndarray
    errors: dict[str, int]

    @staticmethod
    def merge(parts: list["Sends"]) -> "Sends":
        errors: dict[str, int] = {}
        for p in parts:
            for k, v in p.errors.items():
                errors[k] = errors.get(k, 0) + v
        return Sends(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                       ("scheduled", "sent", "done", "outcome", "items")), errors)


def _channel(url: str) -> tuple[Any, Any]:
    from sixfold.loadgen.transport import CHANNEL_OPTIONS

    channel = grpc.aio.insecure_channel(url, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
    # request_serializer None: the pooled bytes are sent as they are; response_deserializer None: not decoded
    return channel, channel.unary_unary(_MODEL_INFER, request_serializer=None, response_deserializer=None)


async def open_loop(url: str, pool: SerializedPool, qps: float, duration_s: float, *, seed: int = 0,
                    max_outstanding: int = 1024, deadline_s: float = 60.0, drain_s: float = 60.0,
                    start_at: float | None = None) -> Sends:
    """Poisson arrivals at ``qps`` for ``duration_s``, each a pooled request chosen at random.

    A request due while ``max_outstanding`` are unanswered is not sent (SKIPPED: the generator, not
    the server, fell behind). ``start_at``: a ``time.time()`` to begin at (senders start together).
    """
    rng = np.random.default_rng(seed)
    count = max(1, int(qps * duration_s * 1.2 + 10))
    offsets = np.cumsum(rng.exponential(1.0 / qps, count))
    offsets = offsets[offsets < duration_s]
    which = rng.integers(0, len(pool.payloads), offsets.size)
    n = offsets.size
    sent = np.full(n, np.nan)
    done = np.full(n, np.nan)
    outcome = np.full(n, SKIPPED, np.int8)
    errors: dict[str, int] = {}
    channel, call = _channel(url)
    loop = asyncio.get_running_loop()
    outstanding = 0
    tasks: set[asyncio.Task] = set()

    async def one(i: int, payload: bytes) -> None:
        nonlocal outstanding
        try:
            await call(payload, timeout=deadline_s)
            outcome[i] = OK
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            outcome[i] = REFUSED if code == grpc.StatusCode.RESOURCE_EXHAUSTED else FAILED
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                errors[code.name.lower()] = errors.get(code.name.lower(), 0) + 1
        finally:
            done[i] = loop.time() - start
            outstanding -= 1

    try:
        await asyncio.wait_for(channel.channel_ready(), 30)
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = loop.time()
        for i in range(n):
            delay = start + offsets[i] - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if outstanding >= max_outstanding:
                continue
            outstanding += 1
            sent[i] = loop.time() - start
            task = asyncio.ensure_future(one(i, pool.payloads[which[i]]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(list(tasks), timeout=drain_s)
    finally:
        for task in list(tasks):
            task.cancel()
        await channel.close()
    return Sends(offsets, sent, done, outcome, pool.items[which], errors)


async def closed_loop(url: str, pool: SerializedPool, *, concurrency: int = 16, duration_s: float = 5.0,
                      warmup_s: float = 1.0) -> float:
    """Answered requests per second with ``concurrency`` requests always outstanding (after ``warmup_s``)."""
    channel, call = _channel(url)
    answered = 0
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(channel.channel_ready(), 30)
        begin = loop.time()
        counting = begin + warmup_s
        end = counting + duration_s

        async def worker(k: int) -> None:
            nonlocal answered
            i = k
            while loop.time() < end:
                try:
                    await call(pool.payloads[i % len(pool.payloads)], timeout=60)
                    if loop.time() >= counting:
                        answered += 1
                except grpc.aio.AioRpcError:
                    pass
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    finally:
        await channel.close()
    return answered / duration_s


def _sender(url: str, model: str, qps: float, duration_s: float, pool_size: int, query_size: str, seed: int,
            max_outstanding: int, conn: Any) -> None:
    """In a sender process: build the pool (the same seed: the same pool in every sender), say ready, run."""
    try:
        pool = build_pool(url, model, size=pool_size, query_size=query_size, seed=seed)
        conn.send("ready")
        start_at = conn.recv()
        conn.send(asyncio.run(open_loop(url, pool, qps, duration_s, seed=seed + 1,
                                        max_outstanding=max_outstanding, start_at=start_at)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(RuntimeError(f"sender failed: {type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_senders(url: str, model: str, qps: float, duration_s: float, *, senders: int = 1, pool_size: int = 16,
                query_size: str = "mlperf", seed: int = 0, max_outstanding: int = 1024,
                start_timeout_s: float = 300.0) -> Sends:
    """``senders`` processes, each offering ``qps / senders`` for ``duration_s``, started together; merged."""
    if senders < 1:
        raise ValueError(f"senders must be >= 1, got {senders}")
    spawn = multiprocessing.get_context("spawn")
    links, processes = [], []
    try:
        for k in range(senders):
            mine, theirs = spawn.Pipe()
            process = spawn.Process(target=_sender, args=(url, model, qps / senders, duration_s, pool_size,
                                                          query_size, seed + 1000 * k, max_outstanding // senders
                                                          or 1, theirs), daemon=True)
            process.start()
            theirs.close()
            links.append(mine)
            processes.append(process)
        for link in links:
            if not link.poll(start_timeout_s):
                raise RuntimeError(f"a sender did not build its pool within {start_timeout_s:g} s")
            answer = link.recv()
            if isinstance(answer, BaseException):
                raise answer
        start_at = time.time() + 0.5
        for link in links:
            link.send(start_at)
        parts = []
        for link in links:
            if not link.poll(duration_s + 180):
                raise RuntimeError("a sender did not finish")
            answer = link.recv()
            if isinstance(answer, BaseException):
                raise answer
            parts.append(answer)
        return Sends.merge(parts)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


def _ms(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values.size else None


def summarize_sends(sends: Sends, offered_qps: float, duration_s: float) -> dict[str, Any]:
    """Offered vs sent, whether the generator kept up, outcomes, goodput and latencies (ms)."""
    sent = ~np.isnan(sends.sent)
    lag = sends.sent[sent] - sends.scheduled[sent]
    ok, refused = sends.outcome == OK, sends.outcome == REFUSED
    answered = ~np.isnan(sends.done)
    from_scheduled = sends.done - sends.scheduled
    from_sent = sends.done - sends.sent
    lag_p99 = _ms(lag, 99)
    scheduled = int(sends.scheduled.size)
    return {
        "offered_qps": round(offered_qps, 2),
        "scheduled": scheduled,
        "sent": int(np.count_nonzero(sent)),
        "skipped": int(np.count_nonzero(sends.outcome == SKIPPED)),
        "sent_qps": round(float(np.count_nonzero(sent)) / duration_s, 2),
        "send_lag_ms": {"p50": _ms(lag, 50), "p99": lag_p99, "max": _ms(lag, 100)},
        "kept_up": bool(np.count_nonzero(sent) >= KEPT_UP_SHARE * scheduled
                        and (lag_p99 or 0.0) <= KEPT_UP_LAG_MS),
        "ok": int(np.count_nonzero(ok)),
        "refused": int(np.count_nonzero(refused)),
        "other_errors": dict(sends.errors),
        "unanswered": int(np.count_nonzero(sent & ~answered)),
        "goodput_qps": round(float(np.count_nonzero(ok)) / duration_s, 2),
        "mean_items": round(float(np.mean(sends.items[sent])), 1) if sent.any() else None,
        "admitted_ms": {"p50": _ms(from_scheduled[ok], 50), "p99": _ms(from_scheduled[ok], 99),
                        "max": _ms(from_scheduled[ok], 100), "p99_from_send": _ms(from_sent[ok], 99)},
        "refused_ms": {"p50": _ms(from_sent[refused], 50), "p99": _ms(from_sent[refused], 99),
                       "max": _ms(from_sent[refused], 100)},
    }
