"""Prometheus metrics (one registry per server, so tests can run several servers in a process).

Per-request and per-batch series are plain counters and bucket counts on ``ModelMetrics``,
read by a collector when /metrics is scraped: a prometheus-client ``inc`` takes a lock and
checks its type (~1.5 us), and a request records ten series and a batch seven, which was a
fifth of sixfold's own time per request on the event loop. Gauges that change rarely (per-card
rows in flight, simulation lag, the host-dense threshold) and failures stay prometheus-client
metrics.

Triton's ``nv_*`` series are written as Triton writes them: counters with no ``_total``
suffix (prometheus-client would add one) and ``nv_inference_pending_request_count`` as a
gauge, so Triton dashboards, alerts and autoscaling rules work unchanged. Each model version's
series are there from the moment it is served, at zero, failures included: one
``nv_inference_request_failure`` per Triton reason (``REJECTED``, ``CANCELED``, ``BACKEND``,
``OTHER``) and sixfold reason (label ``sixfold_reason``), so ``rate()`` and ``increase()`` see
the first failure. The host's CPU and memory are Triton's ``nv_cpu_*`` and the cards
``sixfold_card_*`` (``sixfold.server.observability.system``). Only ``/metrics`` answers; any
other path is 404, so an HTTP probe aimed at the port cannot pass by accident.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from sixfold.server.observability.metrics_http import MetricsEndpoint
from sixfold.server.observability.system import CardCollector, HostCollector

__all__ = ["MetricsEndpoint", "ServerMetrics", "ModelMetrics", "TRITON_REASONS", "FAILURE_REASONS", "triton_reason"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_ROW_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)

TRITON_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
"""Triton's failure reasons (``nv_inference_request_failure``'s label ``reason``)."""
FAILURE_REASONS: dict[str, str] = {
    # refused by the scheduler: its queue full, its deadline passed while queued, the server stopping
    "overloaded": "REJECTED", "deadline": "REJECTED", "unavailable": "REJECTED",
    "cancelled": "CANCELED",  # the client gave up
    # the cards (and the host fallback) could not compute it
    "backend": "BACKEND", "card_hang": "BACKEND", "card_error": "BACKEND", "no_healthy_card": "BACKEND",
    "host_fallback_error": "BACKEND",
    "invalid_input": "OTHER", "internal": "OTHER",
}
"""Each reason a served model's request can fail for (sixfold's, ``ServingError.reason``) -> Triton's."""


def triton_reason(reason: str) -> str:
    """Triton's failure reason for sixfold's ``reason`` (one sixfold does not know: OTHER)."""
    return FAILURE_REASONS.get(reason, "OTHER")


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.failure = Counter("sixfold_inference_request_failure", "Failed inference requests", ["model", "reason"], registry=r)
        self.card_outstanding = Gauge("sixfold_card_outstanding_rows", "Rows in flight on each card (a pipeline "
                                      "replica's on each of its cards, lane naming the replica)", ["model", "card", "lane"], registry=r)
        self.host_dense_max_rows = Gauge("sixfold_host_dense_max_rows", "Batches of at most this many rows run their dense part on the host CPU (0: none)", ["model"], registry=r)
        self.sim_lag = Gauge("sixfold_simcard_lag_seconds", "Total time simulated cards finished later than modelled (host too slow)", ["model", "card"], registry=r)
        self.refused = Counter("sixfold_requests_refused", "Inference requests refused before reaching a model "
                               "(unknown model, undecodable or oversized tensors, shutting down)",
                               ["protocol", "reason"], registry=r)
        self.card_faults = Counter("sixfold_card_faults", "Card faults, also those a hedge or retry saved (kind: late, hang, "
                                   "error); a pipeline replica's counted on each of its cards, lane naming the replica",
                                   ["model", "card", "lane", "kind"], registry=r)
        self.delta_sequence = Gauge("sixfold_model_delta_sequence", "Table deltas applied to the served version (0: its tables as written)", ["model", "version"], registry=r)

        self._models: dict[tuple[str, str], ModelMetrics] = {}
        r.register(_RequestCollector(self._models))
        self._table_caches: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
        r.register(_TableCacheCollector(self._table_caches))
        self._runtimes: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
        r.register(CardCollector(self._runtimes))
        r.register(HostCollector())
        self._endpoint = MetricsEndpoint(self)

    def for_model(self, model: str, version: str) -> "ModelMetrics":
        """One model version's metric children, made once and then reused."""
        key = (model, version)
        bound = self._models.get(key)
        if bound is None:
            bound = self._models[key] = ModelMetrics(self, model, version)
        return bound

    def watch_cards(self, model: str, version: str, runtime: Any) -> None:
        """Export the cards of ``runtime`` (a ``PlanRuntime``: busy time, memory, health) while it lives."""
        self._runtimes[(model, version)] = runtime

    def watch_table_cache(self, model: str, version: str, stage: Any) -> None:
        """Export ``stage``'s tiered row stores (``stage.stores``: hits, misses, bytes, read times) while it lives."""
        self._table_caches[(model, version)] = stage

    def exposition(self) -> bytes:
        """The Prometheus text page: prometheus-client's series, then Triton's (typed as Triton does)."""
        return generate_latest(self.registry) + _triton_exposition(list(self._models.values())).encode()

    def record_refused(self, protocol: str, reason: str) -> None:
        """A request that never reached a model; labels are bounded (protocol: grpc|rest, reason: an error kind)."""
        self.refused.labels(protocol, reason).inc()

    def serve(self, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
              token: str | None = None, limits: Any = None) -> int:
        """Expose this page on ``host:port`` (``MetricsEndpoint.serve``); returns the port."""
        return self._endpoint.serve(host, port, tls_cert=tls_cert, tls_key=tls_key, token=token, limits=limits)

    def close(self) -> None:
        """Stop the /metrics endpoint, if it runs."""
        self._endpoint.close()



class _LaneGauge:
    """The outstanding-rows children of one lane's cards, set together."""

    __slots__ = ("_children",)

    def __init__(self, children: list[Any]) -> None:
        self._children = children

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)


class _StageLag:
    """A pipeline replica's simulation lag, set per card from each stage's own ``stats()``."""

    def __init__(self, children: list[tuple[Any, Any]]) -> None:
        self._children = children

    def set(self, _total: float) -> None:
        for child, stage in self._children:
            stats = getattr(stage, "stats", None)
            if callable(stats):
                child.set(stats().total_lag_s)


class ModelMetrics:
    """The children of every per-model metric for one model version, resolved once.

    NOTE: ``labels()`` costs ~1.5 us a call against ~0.4 us for ``inc``; a request
    records ten series and a batch eight, so resolving them per call was a tenth
    of sixfold's own time on the event loop.
    """

    def __init__(self, m: ServerMetrics, model: str, version: str) -> None:
        self._m, self.model, self.version = m, model, version
        # Per-request series: plain numbers, exported by _RequestCollector at scrape time.
        self.requests = 0
        self.items = 0
        self.request_s = self.queue_s = self.host_s = self.card_s = self.output_s = 0.0
        self.request_seconds, self.queue_seconds = _Buckets(_LATENCY_BUCKETS), _Buckets(_LATENCY_BUCKETS)
        # Per-batch series, the same way.
        self.batches = self.host_dense_batches = 0
        self.batch_rows = _Buckets(_ROW_BUCKETS)
        self.host_seconds, self.card_seconds = _Buckets(_LATENCY_BUCKETS), _Buckets(_LATENCY_BUCKETS)
        self.host_dense_max_rows = m.host_dense_max_rows.labels(model)
        self._host_dense_max_rows: int | None = None
        self._cards: dict[int, Any] = {}
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)
        """Failed requests by sixfold's reason, every known one from the start (Triton's nv_inference_request_failure)."""
        self.pending: Callable[[], int] = lambda: 0
        """Requests waiting in the model's queue, read at scrape time (the served model sets it)."""
        self.ready: Callable[[], bool] = lambda: True
        """Whether the version can answer now (``ServedModel.ready``), read at scrape time; the served model sets it."""

    def lane_labels(self, index: int) -> tuple[tuple[str, ...], str]:
        """(the plan's card ids, lane label) of serving lane ``index``: one card and ``""``, or a pipeline
        replica's cards and ``replicaR``. Read from the watched runtime (``ServerMetrics.watch_cards``)."""
        runtime = self._m._runtimes.get((self.model, self.version))
        if runtime is None or not hasattr(runtime, "lane_cards"):
            return (f"card{index}",), ""
        pipelined = getattr(runtime.cards[index], "stages", None) is not None
        return tuple(runtime.lane_cards(index)), f"replica{index}" if pipelined else ""

    def card(self, index: int) -> Any:
        """The outstanding-rows gauge of lane ``index`` (``set`` sets it on each of the lane's cards)."""
        gauge = self._cards.get(index)
        if gauge is None:
            cards, lane = self.lane_labels(index)
            gauge = self._cards[index] = _LaneGauge([self._m.card_outstanding.labels(self.model, c, lane)
                                                     for c in cards])
        return gauge

    def card_lag(self, index: int) -> Any:
        """The simulation-lag gauge of lane ``index``: made only for a simulated card, which has a lag to report.

        A pipeline replica's lag is kept per card: ``set`` reads each stage's own (its total is ignored).
        """
        cards, lane = self.lane_labels(index)
        if not lane:
            return self._m.sim_lag.labels(self.model, cards[0])
        runtime = self._m._runtimes.get((self.model, self.version))
        stages = list(runtime.cards[index].stages) if runtime is not None else []
        return _StageLag([(self._m.sim_lag.labels(self.model, c), s) for c, s in zip(cards, stages)])

    def record_success(self, rows: int, total_s: float, queue_s: float, host_s: float, card_s: float) -> None:
        """One answered request (on the event loop; a scrape reads these from another thread)."""
        self.requests += 1
        self.items += rows
        self.request_s += total_s
        self.queue_s += queue_s
        self.host_s += host_s
        self.card_s += card_s
        # Triton's compute output: what is left of the request's time (answers split off the batch),
        # as ModelStatistics' compute_output
        self.output_s += max(0.0, total_s - queue_s - host_s - card_s)
        self.request_seconds.observe(total_s)
        self.queue_seconds.observe(queue_s)

    def record_batch(self, rows: int, host_s: float, card_s: float, host_dense_max_rows: int,
                     dense_on_host: bool) -> None:
        """One executed batch (on the event loop)."""
        self.batches += 1
        self.batch_rows.observe(rows)
        self.host_seconds.observe(host_s)
        self.card_seconds.observe(card_s)
        self.host_dense_batches += dense_on_host
        if host_dense_max_rows != self._host_dense_max_rows:  # a gauge: set when it moves
            self._host_dense_max_rows = host_dense_max_rows
            self.host_dense_max_rows.set(host_dense_max_rows)

    def card_fault(self, card: int, kind: str) -> None:
        """One fault of lane ``card`` ("late": passed its hedge point; "hang"; "error"), counted even when the
        batch was saved: on the plan's card, or on each card of a pipeline replica with ``lane="replicaR"``."""
        cards, lane = self.lane_labels(card)
        for card_id in cards:
            self._m.card_faults.labels(self.model, card_id, lane, kind).inc()

    def record_failure(self, reason: str) -> None:
        # NOTE: failures are rare; labels() per call keeps the reason set open.
        self._m.failure.labels(self.model, reason).inc()
        self.failures[reason] = self.failures.get(reason, 0) + 1


class _Buckets:
    """A histogram's bucket counts and sum, without locks (one writer: the event loop)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # "le": a value on a bound counts in it
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        counts, total, running = list(self.counts), self.sum, 0
        buckets = []
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), counts):  # le="8.0", as prometheus-client
            running += count
            buckets.append((bound, running))
        return buckets, total


class _TableCacheCollector:
    """Tiered tables (``sixfold.backends.host.table_store``): the DRAM row cache's counters, per model, when scraped."""

    def __init__(self, stages: "weakref.WeakValueDictionary[tuple[str, str], Any]") -> None:
        self._stages = stages

    def collect(self) -> Iterator[Metric]:
        from sixfold.backends.host.table_store import READ_BUCKETS

        hits = CounterMetricFamily("sixfold_table_cache_hits", "Table ids answered by the DRAM row cache",
                                   labels=["model"])
        misses = CounterMetricFamily("sixfold_table_cache_misses", "Table ids read from disk (not in the row cache)",
                                     labels=["model"])
        held = GaugeMetricFamily("sixfold_table_cache_bytes", "DRAM bytes of the row cache (index, rows, staging)",
                                 labels=["model"])
        budget = GaugeMetricFamily("sixfold_table_cache_budget_bytes", "The table memory budget", labels=["model"])
        rows = GaugeMetricFamily("sixfold_table_cache_rows", "Table rows held in the DRAM row cache now",
                                 labels=["model"])
        slots = GaugeMetricFamily("sixfold_table_cache_slots", "Rows the DRAM row cache can hold (its fill: "
                                  "sixfold_table_cache_rows / this)", labels=["model"])
        reads = HistogramMetricFamily("sixfold_table_read_duration_seconds",
                                      "Time to read one batch's missed rows from disk", labels=["model"])
        by_model: dict[str, list[Any]] = {}
        for (model, _), stage in list(self._stages.items()):
            by_model.setdefault(model, []).extend(getattr(stage, "stores", []))
        for model, stores in sorted(by_model.items()):
            hits.add_metric([model], sum(s.stats.hits for s in stores))
            misses.add_metric([model], sum(s.stats.misses for s in stores))
            held.add_metric([model], sum(s.nbytes for s in stores))
            budget.add_metric([model], sum(s.budget for s in stores))
            rows.add_metric([model], sum(s.cached_rows for s in stores))
            slots.add_metric([model], sum(s.slots for s in stores))
            counts = [sum(s.stats.read_buckets[i] for s in stores) for i in range(len(READ_BUCKETS) + 1)]
            cumulative, buckets = 0, []
            for bound, count in zip([*map(floatToGoString, READ_BUCKETS), "+Inf"], counts):
                cumulative += count
                buckets.append((bound, cumulative))
            reads.add_metric([model], buckets, sum(s.stats.read_seconds for s in stores))
        yield from (hits, misses, held, budget, rows, slots, reads)


class _RequestCollector:
    """Exports every model version's per-request and per-batch series when /metrics is scraped.

    The sixfold_* series are per model (versions summed); Triton's nv_* are per model and version.
    """

    def __init__(self, models: dict[tuple[str, str], ModelMetrics]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        bound = list(self._models.values())
        by_model: dict[str, list[ModelMetrics]] = {}
        for m in bound:
            by_model.setdefault(m.model, []).append(m)
        counters = (("sixfold_inference_request_success", "Successful inference requests", "requests"),
                    ("sixfold_inference_count", "Items (batch rows) inferred", "items"),
                    ("sixfold_inference_exec_count", "Batches executed", "batches"),
                    ("sixfold_host_dense_batches", "Batches whose dense part ran on the host CPU",
                     "host_dense_batches"))
        for name, doc, attr in counters:
            family = CounterMetricFamily(name, doc, labels=["model"])
            for model, versions in sorted(by_model.items()):
                family.add_metric([model], sum(getattr(m, attr) for m in versions))
            yield family
        histograms = (("sixfold_request_duration_seconds", "End-to-end request time in the server", "request_seconds"),
                      ("sixfold_queue_duration_seconds", "Time a request waited in the batch queue", "queue_seconds"),
                      ("sixfold_host_stage_duration_seconds", "Host (sparse) stage time per batch", "host_seconds"),
                      ("sixfold_card_stage_duration_seconds", "Card (dense) stage time per batch, transfers included",
                       "card_seconds"),
                      ("sixfold_batch_rows", "Rows (items) per executed batch", "batch_rows"))
        for name, doc, attr in histograms:
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for model, versions in sorted(by_model.items()):
                parts = [getattr(m, attr).cumulative() for m in versions]
                merged = [(le, sum(p[0][i][1] for p in parts)) for i, (le, _) in enumerate(parts[0][0])]
                family.add_metric([model], merged, sum(p[1] for p in parts))
            yield family
        ready = GaugeMetricFamily("sixfold_model_ready", "1 while the model version can answer now (warmed up, and a "
                                  "card or the host fallback healthy), else 0: what its readiness reports",
                                  labels=["model", "version"])
        for m in bound:
            ready.add_metric([m.model, m.version], float(m.ready()))
        yield ready


# Triton's series: (name, type, help, value of one model version). Counters carry no "_total" suffix,
# as in Triton's own exposition; the failure counter is written per reason below.
_TRITON_SERIES: tuple[tuple[str, str, str, Callable[["ModelMetrics"], float]], ...] = (
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes",
     lambda m: m.requests),
    ("nv_inference_count", "counter", "Number of inferences performed (items; a batch of N counts N)",
     lambda m: m.items),
    ("nv_inference_exec_count", "counter", "Number of model executions performed (batches)", lambda m: m.batches),
    ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds",
     lambda m: m.request_s * 1e6),
    ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds",
     lambda m: m.queue_s * 1e6),
    ("nv_inference_compute_input_duration_us", "counter",
     "Cumulative compute input duration in microseconds (sixfold: the host stage)", lambda m: m.host_s * 1e6),
    ("nv_inference_compute_infer_duration_us", "counter",
     "Cumulative compute inference duration in microseconds (sixfold: the card stage)", lambda m: m.card_s * 1e6),
    ("nv_inference_compute_output_duration_us", "counter",
     "Cumulative inference compute output duration in microseconds (sixfold: the rest of the request's time "
     "after queue, host and card stages)", lambda m: m.output_s * 1e6),
    ("nv_inference_pending_request_count", "gauge",
     "Instantaneous number of pending requests awaiting execution per-model", lambda m: m.pending()),
)


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _triton_exposition(models: list[ModelMetrics]) -> str:
    """Triton's nv_* families in the Prometheus text format, one sample per model version."""
    if not models:
        return ""
    lines: list[str] = []
    for name, kind, doc, value in _TRITON_SERIES:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for m in models:
            lines.append(f'{name}{{model="{_label_value(m.model)}",version="{_label_value(m.version)}"}} '
                         f"{floatToGoString(value(m))}")
    lines += ["# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes "
              "(reason: Triton's; sixfold_reason: sixfold's)",
              "# TYPE nv_inference_request_failure counter"]
    order = {reason: i for i, reason in enumerate(TRITON_REASONS)}
    for m in models:
        failures = sorted(m.failures.items(), key=lambda item: (order[triton_reason(item[0])], item[0]))
        for reason, count in failures:
            lines.append(f'nv_inference_request_failure{{model="{_label_value(m.model)}",'
                         f'version="{_label_value(m.version)}",reason="{triton_reason(reason)}",'
                         f'sixfold_reason="{_label_value(reason)}"}} {floatToGoString(count)}')
    return "\n".join(lines) + "\n"
