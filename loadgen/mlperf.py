"""MLPerf LoadGen (``mlperf_loadgen``) driving any KServe v2 server: Server and Offline scenarios.

MLCommons' LoadGen decides when queries go out and judges the run (VALID or
INVALID: latency bound met at the percentile, minimum duration and query count
reached, early-stopping criterion satisfied); this module is the system under
test (SUT) that forwards each LoadGen sample to the server over gRPC or REST
(``protocol``), with TLS when the config says ``ssl``.

As in the MLPerf DLRM reference, one LoadGen *sample* is one user query: a
request of 100..700 items drawn from the MLPerf query-size distribution (or
another ``--query-size``). The query sample library (QSL) is ``samples``
queries generated and encoded before the test (the server's own tensor
signature, learnt as for any loadgen run), so LoadGen's clock never waits on
request generation. In the Server scenario a LoadGen query carries one sample;
in Offline one query carries them all, and at most ``offline_inflight`` are
outstanding at a time; a request the server refuses as over its queue bound
(RESOURCE_EXHAUSTED) is sent again after a short backoff, since Offline measures
throughput (in Server it is a failure).

Threads: LoadGen calls ``issue_queries`` on its own thread; the calls are handed
to an asyncio loop on a second thread, which sends them and calls
``QuerySamplesComplete`` with the scores' bytes as each answer arrives. A failed
or timed-out request still completes its sample (with no data), so LoadGen
never hangs; failures are counted and reported beside LoadGen's verdict.
"""

from __future__ import annotations

import array
import asyncio
import math
import re
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sixfold.models.requests import parse_query_sizes

from sixfold.loadgen.config import LoadConfig
from sixfold.loadgen.runner import ClientFactory, Target, generator_for
from sixfold.loadgen.transport import RequestFailed, Transport

__all__ = ["MLPerfSettings", "MLPerfResult", "run_mlperf", "parse_summary", "MLPERF_MIN_QUERIES",
           "MLPERF_MIN_DURATION_S"]

MLPERF_MIN_QUERIES = {"server": 270_336, "offline": 24_576}
"""MLPerf Inference rules (DLRM): queries in a Server run, samples in an Offline run."""
MLPERF_MIN_DURATION_S = 600.0
"""MLPerf Inference rules: every performance run lasts at least 10 minutes."""


@dataclass(frozen=True)
class MLPerfSettings:
    """What LoadGen is told. Defaults are MLPerf-compliant except ``qps`` (the caller's target)."""

    scenario: Literal["server", "offline"]
    qps: float
    """Server: ``server_target_qps`` (Poisson arrivals at this rate); Offline: ``offline_expected_qps``
    (sizes the single query: about qps x min duration samples)."""
    latency_ms: float = 60.0
    """Server: the latency bound (``server_target_latency_ns``) at ``latency_percentile``."""
    latency_percentile: float = 99.0
    min_duration_s: float = MLPERF_MIN_DURATION_S
    min_queries: int | None = None
    """LoadGen's ``min_query_count``; None: MLPerf's (``MLPERF_MIN_QUERIES``)."""
    samples: int = 1024
    """QSL size: distinct pre-generated queries (all of them are the performance set)."""
    log_dir: str = "runs/mlperf"
    """Where LoadGen writes mlperf_log_summary.txt and mlperf_log_detail.txt."""
    offline_inflight: int = 8
    """Offline: requests outstanding at once."""
    request_timeout_s: float = 30.0
    """A request unanswered this long fails (its sample completes empty), so LoadGen cannot hang."""
    warmup_queries: int = 32
    """QSL queries sent one at a time before LoadGen starts (not timed, as submissions warm up), so the
    first timed queries do not pay for the server's cold start (first allocations, tuners); 0: none."""

    def __post_init__(self) -> None:
        if self.scenario not in ("server", "offline"):
            raise ValueError(f"bad scenario {self.scenario!r}: expected 'server' or 'offline'")
        for name in ("qps", "latency_ms", "min_duration_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.latency_percentile < 100:
            raise ValueError(f"latency_percentile must be in (0, 100), got {self.latency_percentile}")
        if self.min_queries is not None and self.min_queries < 1:
            raise ValueError(f"min_queries must be >= 1, got {self.min_queries}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.warmup_queries < 0:
            raise ValueError(f"warmup_queries must be >= 0, got {self.warmup_queries}")
        if self.offline_inflight < 1:
            raise ValueError(f"offline_inflight must be >= 1, got {self.offline_inflight}")

    @property
    def min_query_count(self) -> int:
        return self.min_queries if self.min_queries is not None else MLPERF_MIN_QUERIES[self.scenario]


@dataclass
class MLPerfResult:
    """LoadGen's verdict and figures (parsed from its summary), plus what the SUT saw."""

    scenario: str
    result: str
    """``VALID`` or ``INVALID``, as LoadGen judged it."""
    samples_per_s: float | None
    """Server: completed samples per second; Offline: samples per second."""
    scheduled_samples_per_s: float | None
    latency_ms: dict[str, float]
    """Percentile (``"p50"``, ``"p99"``, ``"p99.9"``, ``"mean"``, ``"max"``...) -> ms."""
    checks: dict[str, bool]
    """LoadGen's criteria, e.g. ``{"min_duration": True, "early_stopping": False}``."""
    samples_sent: int
    retries: int
    """Offline: requests sent again after the server refused them as over its queue bound."""
    errors: int
    errors_by_reason: dict[str, int]
    summary_path: str
    detail_path: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        """LoadGen said VALID and every request was answered.

        LoadGen cannot tell a failed request from an answer (its sample still
        completes, often fast), so failures void the result here.
        """
        return self.result == "VALID" and self.errors == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "valid": self.valid}


_FIELD = re.compile(r"^\s*(?P<key>[^:\n]+?)\s*:\s*(?P<value>.*?)\s*$", re.M)
_PERCENTILE = re.compile(r"^(?P<p>\d+(?:\.\d+)?) percentile latency \(ns\)$")
_CHECKS = {"Performance constraints satisfied": "performance_constraints", "Min duration satisfied": "min_duration",
           "Min queries satisfied": "min_queries", "Early stopping satisfied": "early_stopping"}


def parse_summary(text: str) -> dict[str, Any]:
    """LoadGen's ``mlperf_log_summary.txt`` -> result, rates, latencies (ms) and criteria."""
    fields: dict[str, str] = {}
    for match in _FIELD.finditer(text):
        fields.setdefault(match["key"].strip(), match["value"])
    if "Result is" not in fields:
        raise ValueError("not a LoadGen summary: no 'Result is' line")

    def number(key: str) -> float | None:
        try:
            return float(fields[key])
        except (KeyError, ValueError):
            return None

    latency: dict[str, float] = {}
    for key, value in fields.items():
        if (m := _PERCENTILE.match(key)) and value.isdigit():
            latency[f"p{float(m['p']):g}"] = int(value) / 1e6
    for name in ("Min", "Max", "Mean"):
        if (ns := number(f"{name} latency (ns)")) is not None:
            latency[name.lower()] = ns / 1e6
    rate = number("Completed samples per second")
    return {"scenario": fields.get("Scenario", ""), "result": fields["Result is"],
            "samples_per_s": rate if rate is not None else number("Samples per second"),
            "scheduled_samples_per_s": number("Scheduled samples per second"), "latency_ms": latency,
            "checks": {name: fields[key].lower() == "yes" for key, name in _CHECKS.items() if key in fields}}


class _SUT:
    """LoadGen's issue callback on one side, an asyncio loop sending requests on the other."""

    def __init__(self, lg: Any, loop: asyncio.AbstractEventLoop, transport: Transport, payloads: list[Any],
                 items: np.ndarray, settings: MLPerfSettings) -> None:
        self.lg, self.loop, self.transport = lg, loop, transport
        self.payloads, self.items, self.timeout_s = payloads, items, settings.request_timeout_s
        self.limit = settings.offline_inflight if settings.scenario == "offline" else None
        self.sent = self.retries = 0
        self.errors: Counter[str] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()
        self._gate: asyncio.Semaphore | None = None

    def issue_queries(self, samples: list[Any]) -> None:
        """LoadGen's thread: hand (id, index) pairs to the loop and return at once."""
        work = [(s.id, s.index) for s in samples]
        self.loop.call_soon_threadsafe(self._start, work)

    def flush_queries(self) -> None:
        """Nothing is held back: every sample is sent as soon as it is issued."""

    def _start(self, work: list[tuple[int, int]]) -> None:
        if self.limit is not None and self._gate is None:
            self._gate = asyncio.Semaphore(self.limit)
        for sample_id, index in work:
            task = self.loop.create_task(self._one(sample_id, index))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _one(self, sample_id: int, index: int) -> None:
        if self._gate is not None:
            async with self._gate:
                data = await self._send(index)
        else:
            data = await self._send(index)
        buffer = array.array("B", data)
        address, length = buffer.buffer_info()
        self.lg.QuerySamplesComplete([self.lg.QuerySampleResponse(sample_id, address, length)])

    async def _send(self, index: int) -> bytes:
        self.sent += 1
        deadline = self.loop.time() + self.timeout_s
        backoff = 0.005
        while True:
            try:
                return await asyncio.wait_for(self.transport.infer(self.payloads[index], int(self.items[index])),
                                              max(0.0, deadline - self.loop.time()))
            except RequestFailed as exc:
                # NOTE: Offline is about throughput: a server's "queue full" means "later", not "failed".
                if exc.reason == "resource_exhausted" and self.limit is not None \
                        and self.loop.time() + backoff < deadline:
                    self.retries += 1
                    await asyncio.sleep(backoff)
                    backoff = min(0.1, backoff * 2)
                    continue
                self.errors[exc.reason] += 1
            except asyncio.TimeoutError:
                self.errors["timeout"] += 1
            except Exception as exc:  # noqa: BLE001 - a sample must complete whatever went wrong
                self.errors[type(exc).__name__] += 1
            return b""

    async def drain(self, timeout_s: float) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)


async def _warm_up(transport: Transport, payloads: list[Any], items: np.ndarray, settings: MLPerfSettings) -> None:
    """Send ``settings.warmup_queries`` QSL queries one after another; their outcomes are not judged."""
    for k in range(settings.warmup_queries):
        index = k % len(payloads)
        try:
            await asyncio.wait_for(transport.infer(payloads[index], int(items[index])), settings.request_timeout_s)
        except Exception:  # noqa: BLE001 - a failed warm-up query shows again in the timed run
            pass


def _test_settings(lg: Any, settings: MLPerfSettings) -> Any:
    ts = lg.TestSettings()
    ts.scenario = lg.TestScenario.Server if settings.scenario == "server" else lg.TestScenario.Offline
    ts.mode = lg.TestMode.PerformanceOnly
    ts.server_target_qps = settings.qps
    ts.offline_expected_qps = settings.qps
    ts.server_target_latency_ns = max(1, round(settings.latency_ms * 1e6))
    ts.server_target_latency_percentile = settings.latency_percentile / 100
    ts.min_duration_ms = max(1, round(settings.min_duration_s * 1000))
    ts.min_query_count = settings.min_query_count
    return ts


def _log_settings(lg: Any, outdir: Path) -> Any:
    output = lg.LogOutputSettings()
    output.outdir = str(outdir)
    output.copy_summary_to_stdout = False
    log = lg.LogSettings()
    log.log_output = output
    log.enable_trace = False
    return log


async def _open(config: LoadConfig, client_factory: ClientFactory) -> Target:
    # NOTE: on the SUT loop's thread: grpc.aio channels and aiohttp sessions belong to the loop they are made on.
    target = Target(config, client_factory)
    return await target.__aenter__()


def run_mlperf(config: LoadConfig, settings: MLPerfSettings, *,
               client_factory: ClientFactory | None = None) -> MLPerfResult:
    """Run one LoadGen test of ``settings.scenario`` against ``config``'s server and model.

    ``config`` gives the server, model, shape overrides, seed, ``query_size``
    and client kind (its qps/duration are unused). Raises ``LoadgenError`` when
    the server or model cannot be used, ``RuntimeError`` when LoadGen wrote no
    summary. Blocks for the whole test (at least ``settings.min_duration_s``).
    """
    import mlperf_loadgen as lg

    outdir = Path(settings.log_dir).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    summary = outdir / "mlperf_log_summary.txt"
    summary.unlink(missing_ok=True)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="mlperf-sut", daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    try:
        target = call(_open(config, client_factory))
        try:
            assert target.transport is not None and target.shape is not None
            rng = np.random.default_rng(config.seed)
            items = np.asarray(parse_query_sizes(config.query_size).sample(rng, settings.samples), dtype=np.int64)
            generator = generator_for(config, target.shape)
            payloads = [target.transport.prepare(generator.make(int(n))) for n in items]
            call(_warm_up(target.transport, payloads, items, settings))
            sut = _SUT(lg, loop, target.transport, payloads, items, settings)
            lg_sut = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
            lg_qsl = lg.ConstructQSL(len(payloads), len(payloads), lambda _: None, lambda _: None)
            try:
                lg.StartTestWithLogSettings(lg_sut, lg_qsl, _test_settings(lg, settings),
                                            _log_settings(lg, outdir))
            finally:
                lg.DestroyQSL(lg_qsl)
                lg.DestroySUT(lg_sut)
            call(sut.drain(settings.request_timeout_s))
        finally:
            call(target.__aexit__(None, None, None))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    if not summary.exists():
        raise RuntimeError(f"LoadGen wrote no summary in {outdir} (see its mlperf_log_detail.txt)")
    parsed = parse_summary(summary.read_text(encoding="utf-8", errors="replace"))
    return MLPerfResult(
        scenario=settings.scenario, result=parsed["result"], samples_per_s=parsed["samples_per_s"],
        scheduled_samples_per_s=parsed["scheduled_samples_per_s"], latency_ms=parsed["latency_ms"],
        checks=parsed["checks"], samples_sent=sut.sent, retries=sut.retries, errors=sum(sut.errors.values()),
        errors_by_reason=dict(sut.errors), summary_path=str(summary),
        detail_path=str(outdir / "mlperf_log_detail.txt"),
        settings={**asdict(settings), "min_query_count": settings.min_query_count, "url": config.url,
                  "protocol": config.protocol, "ssl": config.ssl, "model": config.model, "query_size": config.query_size, "seed": config.seed,
                  "qsl_items_mean": float(items.mean())})
