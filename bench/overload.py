"""Overload benchmark: drive a served model at a multiple of its capacity and check it degrades well.

Phases, against one server:
  1. capacity  closed loop (64 outstanding: enough to fill every card) for a few seconds: achieved queries/s
  2. overload  open loop (Poisson) at ``--factor`` x capacity for ``--duration`` seconds
  3. recovery  ``--probes`` single requests one after another once the load is gone

What "degrades well" means, and what the report shows: the server stays up;
excess requests are refused with RESOURCE_EXHAUSTED at once (rejection latency
p99); admitted requests keep a bounded p99 (queue bound x service time, not the
length of the overload); the server's RSS stays flat (peak) and comes back down (after); and right after the load
drops, requests succeed at once. With admission by work (``max_queue_work_ms``) the
admitted p99 is about the work bound plus one batch's service time under load.

    .venv/bin/python bench/overload.py                 # rm2 on 6 simcards in a child process, 30 s at 3x
    .venv/bin/python bench/overload.py --mlperf --plot runs/overload-rss.png   # MLPerf sizes, RSS over time
    .venv/bin/python bench/overload.py --url 127.0.0.1:8001 --model rm2 --pid 12345 --duration 30

By default the started server's simcards are throttled (``--slow-factor 5000``)
so the cards are the bottleneck and the batcher's bounded queue is what sheds
load. With unthrottled cards and large rm2 queries (``--slow-factor 1
--max-batch-rows 1024 --query-size uniform:20-80``) a 2-core host saturates in
the gRPC/event-loop layer first: requests (~1.5 MB each) pile up before they
reach the batcher, so refusals come late and RSS grows; that needs admission
control in the transport, not in the batcher.

``--mlperf`` is that case at MLPerf DLRM's query sizes (100-700 items; ~8.6 MB per rm2 query at
120 lookups per table): unthrottled cards, batches of up to 1024 items, and the transports' receive
budget (``--max-queue-bytes-mb``, docs/serving.md "Limits") bounding what is buffered before admission.
The server's RSS is sampled every 0.2 s (``rss_timeline``) and ``--plot`` draws it against the bound
idle + queue bytes + fixed overhead. Issue 33 saw RSS reach 15 GB (OOM) at 3x before that budget.

In ``--mlperf`` mode the load comes from ``bench.serialized_load``: a small pool of requests
(``--pool``, sizes drawn from MLPerf's distribution) serialized once and sent as they are (a gRPC
generic unary call whose request serializer is identity) by ``--senders`` processes that split
the rate. The report's ``generator`` says the rate offered against the rate sent and how late
sends were (``kept_up``): a run whose generator did not keep up says nothing about 10x.

On a host with 2 or more usable CPUs the started server and the generator (capacity phase and
senders) run on CPUs of their own, printed and kept in the report's ``pinning`` (``--server-cpus``,
``--generator-cpus``; ``none`` shares them): a generator on the server's cores steals the CPU the
capacity R and the overload are measured with. With ``--mlperf`` the report's ``time_breakdown``
says where an admitted request's time went: in the model (queue, host and card stages, from its
metrics) against its time from send to answer, and how many were refused unread, by the receive
budget or by the model (docs/admission.md, "Refused before the message is read").

``tests/server/scheduling/test_overload.py`` runs the same phases for 8 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness.report import write_json  # noqa: E402
from sixfold.loadgen import LoadConfig, MonotonicClock, Target, drive, plan_run, summarize  # noqa: E402
from sixfold.loadgen.record import ERROR, OK  # noqa: E402

__all__ = ["OverloadResult", "ServerProcess", "rss_mb", "run_overload", "run_overload_serialized"]

REJECTED = "resource_exhausted"


def rss_mb(pid: int | None = None) -> float:
    """Resident set size of ``pid`` (default: this process) in MiB, from /proc."""
    with open(f"/proc/{pid or 'self'}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc status")


def _p(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values.size else None


@dataclass
class OverloadResult:
    capacity_qps: float
    offered_qps: float
    duration_s: float
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    refused_pct: float = 0.0
    """Share of sent requests refused with RESOURCE_EXHAUSTED, in percent."""
    other_errors: dict[str, int] = field(default_factory=dict)
    admitted_ms: dict[str, float | None] = field(default_factory=dict)
    """Latency of answered requests (from their scheduled time): p50, p99, max."""
    rejected_ms: dict[str, float | None] = field(default_factory=dict)
    """Time to a RESOURCE_EXHAUSTED answer: p50, p99, max."""
    goodput_qps: float = 0.0
    rss_mb: dict[str, float] = field(default_factory=dict)
    """Server RSS before the overload, at its peak, and after recovery."""
    rss_timeline: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the overload began, server RSS in MiB), every 0.2 s during it."""
    recovery_ms: list[float] = field(default_factory=list)
    recovery_errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    generator: dict[str, Any] = field(default_factory=dict)
    """``--mlperf``: rate offered vs sent, send lateness, whether the generator kept up (bench.serialized_load)."""
    time_breakdown: dict[str, Any] = field(default_factory=dict)
    """``--mlperf`` with a started server: where an admitted request's time went (``where_time_went``)."""
    pinning: dict[str, list[int]] = field(default_factory=dict)
    """CPUs the server and the generator ran on (capacity and overload alike); empty: not pinned."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _sample_rss(pid: int | None, peak: list[float], stop: asyncio.Event,
                      timeline: list[tuple[float, float]] | None = None) -> None:
    started = time.monotonic()
    while not stop.is_set():
        now = rss_mb(pid)
        peak[0] = max(peak[0], now)
        if timeline is not None:
            timeline.append((round(time.monotonic() - started, 2), round(now, 1)))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass


async def run_overload(url: str, model: str, *, factor: float = 3.0, duration_s: float = 30.0,
                       query_size: str = "uniform:1-8", capacity_s: float = 3.0, concurrency: int = 64,
                       probes: int = 10, pid: int | None = None, seed: int = 0,
                       capacity_qps: float | None = None) -> OverloadResult:
    """The three phases against ``url``; ``pid`` is the server's, for its RSS (None: this process)."""
    clock = MonotonicClock()
    if capacity_qps is None:
        closed = LoadConfig(url=url, model=model, qps=0, duration_s=capacity_s, concurrency=concurrency,
                            query_size=query_size, seed=seed, warmup_s=0.5)
        async with Target(closed) as target:
            schedule = plan_run(closed, target.shape, target.transport.prepare)
            record, _, _ = await drive(closed, schedule, target.transport, clock=clock)
        capacity_qps = summarize(record, closed, {}).achieved_qps
    offered = factor * capacity_qps
    config = LoadConfig(url=url, model=model, qps=offered, duration_s=duration_s, query_size=query_size,
                        seed=seed + 1, drain_timeout_s=30.0)
    result = OverloadResult(capacity_qps=round(float(capacity_qps), 2), offered_qps=round(float(offered), 2),
                            duration_s=duration_s)
    async with Target(config) as target:
        schedule = plan_run(config, target.shape, target.transport.prepare)
        before = rss_mb(pid)
        peak, stop = [before], asyncio.Event()
        sampler = asyncio.ensure_future(_sample_rss(pid, peak, stop, result.rss_timeline))
        record, _, _ = await drive(config, schedule, target.transport, clock=clock)
        stop.set()
        await sampler
        # Recovery: the load is gone; single requests one after another must succeed at once.
        first = schedule.pool.payloads[int(schedule.query[0])]
        items = int(schedule.items[0])
        for _ in range(probes):
            t0 = time.perf_counter()
            try:
                await target.transport.infer(first, items)
            except Exception as exc:  # noqa: BLE001 - reported, and asserted on by the test
                result.recovery_errors.append(str(exc))
            result.recovery_ms.append(round((time.perf_counter() - t0) * 1e3, 2))
        result.rss_mb = {"before": round(before, 1), "peak": round(peak[0], 1), "after": round(rss_mb(pid), 1)}
    n = len(record)
    status, latency = record.status[:n], record.latency()[:n]
    rejected = np.array([record.reasons.get(i) == REJECTED for i in range(n)], dtype=bool)
    result.sent = int(np.count_nonzero(~np.isnan(record.sent[:n])))
    result.ok = int(np.count_nonzero(status == OK))
    result.rejected = int(np.count_nonzero(rejected))
    result.refused_pct = round(100.0 * result.rejected / max(1, result.sent), 1)
    for i in np.flatnonzero((status == ERROR) & ~rejected).tolist():
        reason = record.reasons.get(i, "unknown")
        result.other_errors[reason] = result.other_errors.get(reason, 0) + 1
    answer = record.done[:n] - record.sent[:n]  # the server's own time, without the generator's lateness
    for name, mask in (("admitted_ms", status == OK), ("rejected_ms", rejected)):
        setattr(result, name, {"p50": _p(latency[mask], 50), "p99": _p(latency[mask], 99),
                               "max": _p(latency[mask], 100), "p99_from_send": _p(answer[mask], 99)})
    report = summarize(record, config, {})
    result.goodput_qps = round(float(report.achieved_qps), 2)
    result.warnings = list(report.warnings)
    return result


def _sample_rss_thread(pid: int | None, peak: list[float], stop: threading.Event,
                       timeline: list[tuple[float, float]]) -> None:
    started = time.monotonic()
    while not stop.is_set():
        now = rss_mb(pid)
        peak[0] = max(peak[0], now)
        timeline.append((round(time.monotonic() - started, 2), round(now, 1)))
        stop.wait(0.2)


async def _probe(url: str, payload: bytes, probes: int) -> tuple[list[float], list[str]]:
    """Recovery: ``probes`` requests one after another; their times (ms) and errors."""
    import grpc

    from bench.serialized_load import _channel

    channel, call = _channel(url)
    took, errors = [], []
    try:
        for _ in range(probes):
            t0 = time.perf_counter()
            try:
                await call(payload, timeout=30)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
            took.append(round((time.perf_counter() - t0) * 1e3, 2))
    finally:
        await channel.close()
    return took, errors


def run_overload_serialized(url: str, model: str, *, factor: float = 3.0, duration_s: float = 60.0,
                            query_size: str = "mlperf", capacity_s: float = 5.0, concurrency: int = 16,
                            probes: int = 10, pid: int | None = None, seed: int = 0,
                            capacity_qps: float | None = None, senders: int = 1, pool: int = 16,
                            max_outstanding: int = 1024,
                            model_times: Callable[[], dict[str, Any]] | None = None) -> OverloadResult:
    """The three phases with ``bench.serialized_load``'s generator (pre-serialized requests, ``senders`` processes).

    ``model_times``: the served model's totals (``ServerProcess.model_times``), read before and after the
    overload for ``where_time_went``."""
    from bench.serialized_load import KEPT_UP_LAG_MS, OK as SENT_OK, build_pool, closed_loop, run_senders, \
        summarize_sends

    requests = build_pool(url, model, size=pool, query_size=query_size, seed=seed)
    if capacity_qps is None:
        capacity_qps = asyncio.run(closed_loop(url, requests, concurrency=concurrency, duration_s=capacity_s))
    offered = factor * capacity_qps
    result = OverloadResult(capacity_qps=round(float(capacity_qps), 2), offered_qps=round(float(offered), 2),
                            duration_s=duration_s)
    before = rss_mb(pid)
    peak, stop = [before], threading.Event()
    sampler = threading.Thread(target=_sample_rss_thread, args=(pid, peak, stop, result.rss_timeline), daemon=True)
    sampler.start()
    times_before = model_times() if model_times is not None else None
    try:
        sends = run_senders(url, model, offered, duration_s, senders=senders, pool_size=pool, query_size=query_size,
                            seed=seed + 1, max_outstanding=max_outstanding)
    finally:
        stop.set()
        sampler.join(5)
    if times_before is not None:
        answered = (sends.done - sends.sent)[sends.outcome == SENT_OK] * 1e3
        if answered.size:
            client = {"mean": round(float(answered.mean()), 1), "p50": round(float(np.percentile(answered, 50)), 1),
                      "p99": round(float(np.percentile(answered, 99)), 1)}
            result.time_breakdown = where_time_went(times_before, model_times(), client)
    result.recovery_ms, result.recovery_errors = asyncio.run(_probe(url, requests.payloads[0], probes))
    result.rss_mb = {"before": round(before, 1), "peak": round(peak[0], 1), "after": round(rss_mb(pid), 1)}
    summary = summarize_sends(sends, offered, duration_s)
    result.sent, result.ok, result.rejected = summary["sent"], summary["ok"], summary["refused"]
    result.refused_pct = round(100.0 * result.rejected / max(1, result.sent), 1)
    result.other_errors = summary["other_errors"]
    if summary["unanswered"]:
        result.other_errors["unanswered"] = summary["unanswered"]
    result.admitted_ms, result.rejected_ms = summary["admitted_ms"], summary["refused_ms"]
    result.goodput_qps = summary["goodput_qps"]
    result.generator = {key: summary[key] for key in ("offered_qps", "sent_qps", "scheduled", "sent", "skipped",
                                                      "send_lag_ms", "kept_up", "mean_items")}
    result.generator.update(senders=senders, pool=pool, pool_mean_mb=round(requests.mean_bytes / 2**20, 2))
    if result.goodput_qps > 1.1 * result.capacity_qps:
        result.warnings.append(f"the overload answered {result.goodput_qps} q/s, more than the capacity measured "
                               f"({result.capacity_qps} q/s): capacity was measured low (a busy host?), so the "
                               f"load was less than {factor:g}x; rerun, or give --capacity-qps")
    if not summary["kept_up"]:
        lag = summary["send_lag_ms"]["p99"]
        why = []
        if (lag or 0.0) > KEPT_UP_LAG_MS:
            why.append(f"sends were late (p99 {lag} ms): add --senders, or run the generator on other cores")
        if summary["skipped"]:
            why.append(f"{summary['skipped']} requests were not sent because {max_outstanding} were unanswered "
                       "(the server held them instead of refusing): raise --max-outstanding")
        result.warnings.append(f"the generator did not keep up: {summary['sent_qps']} q/s sent of "
                               f"{summary['offered_qps']} offered; " + "; ".join(why or ["too few sent"]))
    return result


def parse_cpus(text: str) -> set[int]:
    """``"0"``, ``"0-3"``, ``"0,2-3"`` -> a set of CPU numbers; ValueError naming the text when malformed."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"a CPU list is like 0 or 0-3 or 0,2-3, got {text!r}") from None
    if not cpus:
        raise ValueError(f"a CPU list is like 0 or 0-3 or 0,2-3, got {text!r}")
    return cpus


def choose_pinning(server: str, generator: str, usable: set[int]) -> dict[str, list[int]]:
    """CPUs for the server and for the generator; ``"auto"`` splits ``usable`` in two halves (the server
    the first) when there are at least 2, ``"none"`` (either) does not pin. Empty: not pinned.

    On a 2-core host a generator that shares the server's cores sends late and steals the server's CPU,
    so neither the offered load nor the capacity it is a multiple of is what the report says.
    """
    if "none" in (server, generator):
        return {}
    ordered = sorted(usable)
    if server == "auto" and generator == "auto":
        if len(ordered) < 2:
            return {}
        half = len(ordered) // 2
        return {"server": ordered[:half], "generator": ordered[half:]}
    mine = sorted(parse_cpus(server)) if server != "auto" else None
    theirs = sorted(parse_cpus(generator)) if generator != "auto" else None
    if mine is None:
        mine = [c for c in ordered if c not in set(theirs or [])] or ordered
    if theirs is None:
        theirs = [c for c in ordered if c not in set(mine)] or ordered
    for name, cpus in (("--server-cpus", mine), ("--generator-cpus", theirs)):
        if not set(cpus) <= usable:
            raise ValueError(f"{name} {cpus}: not all usable here (usable: {ordered})")
    return {"server": mine, "generator": theirs}


def _pin_process(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (sched_setaffinity on a pid moves only its main thread)."""
    import os

    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def _serve_child(model: str, cards: int, batching: dict[str, Any], backend_options: dict[str, Any], conn: Any,
                 max_rows: int = 2000, cpus: list[int] | None = None) -> None:
    """In a child process: serve ``model`` on simcards, send the URL up ``conn``, serve until told to stop."""
    import os

    from sixfold.server.memory.allocator import keep_freed_memory

    if cpus:  # first, so that every thread the server starts inherits it (and those numpy's import started)
        _pin_process(os.getpid(), cpus)
    # NOTE: as sixfold-serve does, before any thread: threads that allocated before it keep arenas of their
    # own, whose freed request buffers the batcher's trim does not bring back (measured: RSS idle + 4.2 GiB)
    keep_freed_memory()
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.server.app import BackgroundServer, ServerConfig
    from sixfold.server.scheduling.batcher import BatchingConfig
    from sixfold.server.core import InferenceCore
    from sixfold.server.loading.loader import load_partitioned
    from sixfold.server.observability.metrics import ServerMetrics
    from sixfold.server.transport.limits import TransportLimits

    _, partitioned = partition_builtin(model, max_rows=max_rows, seed=3, cards=cards)
    metrics = ServerMetrics()
    # NOTE: no host-dense fallback: with throttled cards the host would take the small batches,
    # and the cards would never become the bottleneck this harness is about.
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=BatchingConfig(**batching),
                              backend_options=backend_options, host_dense_max_rows=0)
    limits = TransportLimits(receive_bytes=served.batcher.config.max_queue_bytes)  # as sixfold-serve sizes it
    background = BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, limits=limits),
                                  metrics).start()
    conn.send(background.url)
    try:
        while conn.recv() == "times":  # anything else ("stop"), or EOF when the parent is gone, stops it
            conn.send(_model_times(served))
    except EOFError:
        pass
    background.stop()


def _model_times(served: Any) -> dict[str, Any]:
    """The served model's own totals so far (from its metrics): answered requests, their summed seconds in
    the model (queue, host stage, card stage, all), and bucket counts of their time in the model and queue."""
    m = served._metrics
    return {"requests": m.requests, "total_s": m.request_s, "queue_s": m.queue_s, "host_s": m.host_s,
            "card_s": m.card_s, "bounds": list(m.request_seconds.bounds),
            "total_counts": list(m.request_seconds.counts), "queue_counts": list(m.queue_seconds.counts),
            "refused_in_model": m.failures.get("overloaded", 0),
            "refused_unread": served.metrics.refused.labels("grpc", "overloaded")._value.get(),
            "refused_by_receive_budget": served.metrics.refused.labels("grpc", "receive_budget")._value.get()}


def _bucket_p99_ms(bounds: list[float], counts: list[int]) -> float | None:
    """The bucket bound (ms) at or under which 99% of the counted values lie (None: none counted)."""
    total, running = sum(counts), 0
    for bound, count in zip([*bounds, float("inf")], counts):
        running += count
        if total and running >= 0.99 * total:
            return round(bound * 1e3, 1)
    return None


def where_time_went(before: dict[str, Any], after: dict[str, Any], client_ms: dict[str, float]) -> dict[str, Any]:
    """An admitted request's time, from the model's totals over the overload (``after`` less ``before``) and the
    client's times from send to answer (``client_ms``: mean, p50, p99): in the model (its queue, host and
    card stages; mean, and p99 as a bucket bound), and outside it (client minus model: the gRPC stream before
    the handler, the message's read and decode, the response's encode and send, the client's own)."""
    n = after["requests"] - before["requests"]
    if n <= 0:
        return {}
    mean = {k: round((after[k] - before[k]) / n * 1e3, 1) for k in ("total_s", "queue_s", "host_s", "card_s")}
    delta = {k: [a - b for a, b in zip(after[k], before[k])] for k in ("total_counts", "queue_counts")}
    return {"answered": n, "client_from_send_ms": client_ms,
            "model_ms": {"mean": mean["total_s"], "p99_le": _bucket_p99_ms(after["bounds"], delta["total_counts"])},
            "queue_ms": {"mean": mean["queue_s"], "p99_le": _bucket_p99_ms(after["bounds"], delta["queue_counts"])},
            "host_stage_ms": {"mean": mean["host_s"]}, "card_stage_ms": {"mean": mean["card_s"]},
            "outside_model_ms": {"mean": round(client_ms["mean"] - mean["total_s"], 1)},
            "refused": {k: int(after[k] - before[k]) for k in ("refused_unread", "refused_by_receive_budget",
                                                               "refused_in_model")}}


class ServerProcess:
    """``with ServerProcess(...) as s``: a sixfold server on simcards in its own process, ``s.url``, ``s.pid``.

    The load generator must not share a GIL with the server it overloads, or it
    throttles itself and the overload never reaches the server. ``batching``
    holds BatchingConfig fields; ``slow_factor`` throttles every simcard (the
    ``slow_factor`` fault), which makes the cards the bottleneck.
    """

    def __init__(self, model: str = "rm2", *, cards: int = 6, batching: dict[str, Any] | None = None,
                 slow_factor: float = 1.0, start_timeout_s: float = 180.0, max_rows: int = 2000,
                 cpus: list[int] | None = None) -> None:
        import multiprocessing

        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        options = {"faults": {"slow_factor": slow_factor}} if slow_factor != 1.0 else {}
        self.process = spawn.Process(target=_serve_child, args=(model, cards, dict(batching or {}), options, child,
                                                                max_rows, cpus), daemon=True)
        self.start_timeout_s = start_timeout_s
        self.url = ""

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def __enter__(self) -> "ServerProcess":
        self.process.start()
        try:
            if not self._conn.poll(self.start_timeout_s):
                raise EOFError
            self.url = self._conn.recv()
        except EOFError:
            self.process.kill()
            self.process.join(10)
            raise RuntimeError(f"server process did not start in {self.start_timeout_s:g} s "
                               f"(exit code {self.process.exitcode})") from None
        return self

    def model_times(self) -> dict[str, Any]:
        """The served model's own totals so far (``where_time_went`` takes two of them)."""
        self._conn.send("times")
        if not self._conn.poll(30):
            raise RuntimeError("the server process did not answer for its times in 30 s")
        return self._conn.recv()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def plot_rss(result: OverloadResult, path: str, *, queue_bytes_mb: float, overhead_mb: float,
             title: str = "") -> None:
    """RSS over the overload against idle + queue bytes + fixed overhead (docs/serving.md, "Limits")."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x for x, _ in result.rss_timeline]
    rss = [y for _, y in result.rss_timeline]
    idle = result.rss_mb.get("before", rss[0] if rss else 0.0)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, rss, label="server RSS")
    ax.axhline(idle, color="grey", linestyle=":", label=f"idle {idle:.0f} MiB")
    ax.axhline(idle + queue_bytes_mb + overhead_mb, color="red", linestyle="--",
               label=f"bound: idle + {queue_bytes_mb:.0f} (queue) + {overhead_mb:.0f} (overhead) MiB")
    ax.set_xlabel("seconds into the overload")
    ax.set_ylabel("MiB")
    ax.set_title(title or f"{result.offered_qps:g} q/s offered, {result.goodput_qps:g} q/s answered")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


OVERHEAD_MB = 512.0
"""The fixed overhead docs/serving.md states above idle + queue bytes: batch buffers of up to
--max-batch-rows items per running batch, encoded responses, allocator slack."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="drive this server (HOST:PORT) instead of starting one (rm2 on simcards)")
    p.add_argument("--pid", type=int, help="the --url server's process id, for its RSS")
    p.add_argument("--model", default="rm2")
    p.add_argument("--cards", type=int, default=6, help="simcards of the started server (default 6)")
    p.add_argument("--max-queue-size", type=int, default=32, help="queue bound of the started server (default 32)")
    p.add_argument("--max-inflight-batches", type=int, default=0,
                   help="batches past the queue at once in the started server (default 0: cards + 1)")
    p.add_argument("--max-batch-rows", type=int, default=32, help="batch bound of the started server (default 32)")
    p.add_argument("--max-queue-work-ms", type=float, help="work bound of the started server (default: BatchingConfig's)")
    p.add_argument("--max-queue-bytes-mb", type=int, help="bytes bound of the started server (default: BatchingConfig's)")
    p.add_argument("--default-timeout-us", type=int, help="queue timeout of the started server (default: BatchingConfig's)")
    p.add_argument("--slow-factor", type=float, default=5000.0,
                   help="simcard slow_factor fault of the started server: cards are the bottleneck (default 5000; "
                        "1: unthrottled, the host and gRPC layer are)")
    p.add_argument("--factor", type=float, default=3.0, help="offered load as a multiple of capacity (default 3)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of overload (default 30)")
    p.add_argument("--capacity-qps", type=float, help="skip the capacity phase and take this")
    p.add_argument("--capacity-concurrency", type=int, default=16,
                   help="--mlperf: requests outstanding in the capacity phase's closed loop (default 16; with "
                        "--mlperf 4: more only adds refused retries that cost the server, not answers)")
    p.add_argument("--query-size", default="uniform:1-8", help="loadgen query size spec (default uniform:1-8)")
    p.add_argument("--probes", type=int, default=10, help="recovery requests after the overload (default 10)")
    p.add_argument("--mlperf", action="store_true",
                   help="MLPerf DLRM query sizes (100-700 items) on unthrottled cards, batches up to 1024 items; "
                        "records RSS over time")
    p.add_argument("--max-rows", type=int, default=2000,
                   help="rows per table of the started server (default 2000; the issue's runs: 50000)")
    p.add_argument("--senders", type=int, default=1,
                   help="--mlperf: load generator processes splitting the offered rate (default 1)")
    p.add_argument("--pool", type=int, default=16,
                   help="--mlperf: distinct requests, serialized once, their sizes drawn from MLPerf's (default 16)")
    p.add_argument("--max-outstanding", type=int, default=1024,
                   help="--mlperf: unanswered requests at once, over all senders; a request due past it is not "
                        "sent and counted as the generator falling behind (default 1024)")
    p.add_argument("--server-cpus", default="auto",
                   help="CPUs of the started server, like 0 or 0-3 (default auto: the first half of the usable "
                        "CPUs when there are >= 2; none: not pinned). With --url and --pid: that server's")
    p.add_argument("--generator-cpus", default="auto",
                   help="CPUs of the load generator (capacity phase and senders alike; default auto: the "
                        "usable CPUs the server does not get)")
    p.add_argument("--plot", help="draw the server's RSS over the overload into this PNG")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.mlperf:  # flags left at their defaults take the MLPerf case's
        defaults = {"query_size": ("uniform:1-8", "mlperf"), "slow_factor": (5000.0, 1.0),
                    "max_batch_rows": (32, 1024), "max_queue_size": (32, 256),
                    "capacity_concurrency": (16, 4)}
        for name, (default, mlperf) in defaults.items():
            if getattr(args, name) == default:
                setattr(args, name, mlperf)
        from sixfold.server.scheduling.batcher import DEFAULT_QUEUE_WORK_MS, DEFAULT_TIMEOUT_US
        if args.max_queue_work_ms is None:  # as sixfold-serve at its defaults
            args.max_queue_work_ms = DEFAULT_QUEUE_WORK_MS
        if args.default_timeout_us is None:
            args.default_timeout_us = DEFAULT_TIMEOUT_US
    import os

    try:
        pinning = choose_pinning(args.server_cpus, args.generator_cpus, os.sched_getaffinity(0))
    except ValueError as exc:
        p.error(str(exc))
    if pinning:
        _pin_process(os.getpid(), pinning["generator"])  # the senders are spawned from here and inherit it
        if args.url and args.pid:
            _pin_process(args.pid, pinning["server"])
        print(f"overload: server on CPUs {pinning['server']}, generator on CPUs {pinning['generator']}",
              file=sys.stderr)
    else:
        print("overload: not pinned (server and generator share the CPUs)", file=sys.stderr)
    def go(url: str, pid: int | None, model_times: Callable[[], dict[str, Any]] | None = None) -> OverloadResult:
        if args.mlperf:
            return run_overload_serialized(url, args.model, factor=args.factor, duration_s=args.duration,
                                           query_size=args.query_size, pid=pid, capacity_qps=args.capacity_qps,
                                           probes=args.probes, senders=args.senders, pool=args.pool,
                                           concurrency=args.capacity_concurrency, model_times=model_times,
                                           max_outstanding=args.max_outstanding)
        return asyncio.run(run_overload(url, args.model, factor=args.factor, duration_s=args.duration,
                                        query_size=args.query_size, pid=pid, capacity_qps=args.capacity_qps,
                                        probes=args.probes))

    if args.url:
        result = go(args.url, args.pid)
    else:
        batching = {"max_batch_rows": args.max_batch_rows, "max_queue_size": args.max_queue_size,
                    "max_inflight_batches": args.max_inflight_batches}
        for key, value in (("max_queue_work_ms", args.max_queue_work_ms), ("default_timeout_microseconds",
                           args.default_timeout_us), ("max_queue_bytes", args.max_queue_bytes_mb and
                                                      args.max_queue_bytes_mb << 20)):
            if value is not None:
                batching[key] = value
        with ServerProcess(args.model, cards=args.cards, batching=batching, slow_factor=args.slow_factor,
                           max_rows=args.max_rows, cpus=pinning.get("server")) as server:
            result = go(server.url, server.pid, server.model_times)
            if not server.alive:
                print("overload: the server process died", file=sys.stderr)
                return 1
    result.pinning = pinning
    data = result.to_dict()
    if args.plot:
        from sixfold.server.scheduling.batcher import DEFAULT_QUEUE_BYTES
        queue_mb = args.max_queue_bytes_mb if args.max_queue_bytes_mb is not None else DEFAULT_QUEUE_BYTES >> 20
        plot_rss(result, args.plot, queue_bytes_mb=queue_mb, overhead_mb=OVERHEAD_MB)
    print(json.dumps({k: v for k, v in data.items() if k != "rss_timeline"}, indent=2))
    if args.json:
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
