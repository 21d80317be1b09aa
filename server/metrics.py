"""Prometheus metrics (one registry per server, so tests can run several servers in a process).

Per-request and per-batch series are plain counters and bucket counts on ``ModelMetrics``,
read by a collector when /metrics is scraped: a prometheus-client ``inc`` takes a lock and
checks its type (~1.5 us), and a request records ten series and a batch seven, which was a
fifth of sixfold's own time per request on the event loop. Gauges that change rarely (per-card
rows in flight, simulation lag, the host-dense threshold) and failures stay prometheus-client
metrics.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = ["ServerMetrics", "ModelMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_ROW_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.failure = Counter("sixfold_inference_request_failure", "Failed inference requests", ["model", "reason"], registry=r)
        self.card_outstanding = Gauge("sixfold_card_outstanding_rows", "Rows in flight on each card", ["model", "card"], registry=r)
        self.host_dense_max_rows = Gauge("sixfold_host_dense_max_rows", "Batches of at most this many rows run their dense part on the host CPU (0: none)", ["model"], registry=r)
        self.sim_lag = Gauge("sixfold_simcard_lag_seconds", "Total time simulated cards finished later than modelled (host too slow)", ["model", "card"], registry=r)

        # Triton's own names (cumulative microsecond counters), so Triton dashboards work unchanged.
        # NOTE: Gauges that only go up: prometheus-client would export a Counter as "<name>_total",
        # and Triton's series carry no suffix.
        labels = ["model", "version"]
        self.nv_failure = Gauge("nv_inference_request_failure", "Failed requests (Triton name)", [*labels, "reason"], registry=r)
        self._models: dict[tuple[str, str], ModelMetrics] = {}
        r.register(_RequestCollector(self._models))

    def for_model(self, model: str, version: str) -> "ModelMetrics":
        """One model version's metric children, made once and then reused."""
        key = (model, version)
        bound = self._models.get(key)
        if bound is None:
            bound = self._models[key] = ModelMetrics(self, model, version)
        return bound

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics over HTTP on ``host:port``."""
        start_http_server(port, addr=host, registry=self.registry)


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
        self.request_s = self.queue_s = self.host_s = self.card_s = 0.0
        self.request_seconds, self.queue_seconds = _Buckets(_LATENCY_BUCKETS), _Buckets(_LATENCY_BUCKETS)
        # Per-batch series, the same way.
        self.batches = self.host_dense_batches = 0
        self.batch_rows = _Buckets(_ROW_BUCKETS)
        self.host_seconds, self.card_seconds = _Buckets(_LATENCY_BUCKETS), _Buckets(_LATENCY_BUCKETS)
        self.host_dense_max_rows = m.host_dense_max_rows.labels(model)
        self._host_dense_max_rows: int | None = None
        self._cards: dict[int, tuple] = {}

    def card(self, index: int) -> tuple:
        """(outstanding rows gauge, simulation lag gauge) of card ``index``."""
        children = self._cards.get(index)
        if children is None:
            label = f"card{index}"
            children = self._cards[index] = (self._m.card_outstanding.labels(self.model, label),
                                             self._m.sim_lag.labels(self.model, label))
        return children

    def record_success(self, rows: int, total_s: float, queue_s: float, host_s: float, card_s: float) -> None:
        """One answered request (on the event loop; a scrape reads these from another thread)."""
        self.requests += 1
        self.items += rows
        self.request_s += total_s
        self.queue_s += queue_s
        self.host_s += host_s
        self.card_s += card_s
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

    def record_failure(self, reason: str) -> None:
        # NOTE: failures are rare; labels() per call keeps the reason set open.
        self._m.failure.labels(self.model, reason).inc()
        self._m.nv_failure.labels(self.model, self.version, reason).inc()


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
        # Triton's names (cumulative; gauges because Triton's series carry no "_total" suffix).
        names = (("nv_inference_request_success", "Successful requests (Triton name)", lambda m: m.requests),
                 ("nv_inference_count", "Inferences performed, in items (Triton name)", lambda m: m.items),
                 ("nv_inference_exec_count", "Batches executed (Triton name)", lambda m: m.batches),
                 ("nv_inference_request_duration_us", "Cumulative request time (Triton name)",
                  lambda m: m.request_s * 1e6),
                 ("nv_inference_queue_duration_us", "Cumulative queue time (Triton name)", lambda m: m.queue_s * 1e6),
                 ("nv_inference_compute_input_duration_us",
                  "Cumulative host-stage time (Triton name: compute input)", lambda m: m.host_s * 1e6),
                 ("nv_inference_compute_infer_duration_us",
                  "Cumulative card-stage time (Triton name: compute infer)", lambda m: m.card_s * 1e6))
        for name, doc, value in names:
            family = GaugeMetricFamily(name, doc, labels=["model", "version"])
            for m in bound:
                family.add_metric([m.model, m.version], value(m))
            yield family
