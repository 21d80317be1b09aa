"""Prometheus metrics (one registry per server, so tests can run several servers in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["ServerMetrics", "ModelMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_ROW_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.success = Counter("sixfold_inference_request_success", "Successful inference requests", ["model"], registry=r)
        self.failure = Counter("sixfold_inference_request_failure", "Failed inference requests", ["model", "reason"], registry=r)
        self.items = Counter("sixfold_inference_count", "Items (batch rows) inferred", ["model"], registry=r)
        self.executions = Counter("sixfold_inference_exec_count", "Batches executed", ["model"], registry=r)
        self.request_seconds = Histogram("sixfold_request_duration_seconds", "End-to-end request time in the server", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("sixfold_queue_duration_seconds", "Time a request waited in the batch queue", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.host_seconds = Histogram("sixfold_host_stage_duration_seconds", "Host (sparse) stage time per batch", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.card_seconds = Histogram("sixfold_card_stage_duration_seconds", "Card (dense) stage time per batch, transfers included", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("sixfold_batch_rows", "Rows (items) per executed batch", ["model"], buckets=_ROW_BUCKETS, registry=r)
        self.card_outstanding = Gauge("sixfold_card_outstanding_rows", "Rows in flight on each card", ["model", "card"], registry=r)
        self.host_dense_max_rows = Gauge("sixfold_host_dense_max_rows", "Batches of at most this many rows run their dense part on the host CPU (0: none)", ["model"], registry=r)
        self.host_dense_batches = Counter("sixfold_host_dense_batches", "Batches whose dense part ran on the host CPU", ["model"], registry=r)
        self.sim_lag = Gauge("sixfold_simcard_lag_seconds", "Total time simulated cards finished later than modelled (host too slow)", ["model", "card"], registry=r)

        # Triton's own names (cumulative microsecond counters), so Triton dashboards work unchanged.
        # NOTE: Gauges that only go up: prometheus-client would export a Counter as "<name>_total",
        # and Triton's series carry no suffix.
        labels = ["model", "version"]
        self.nv_success = Gauge("nv_inference_request_success", "Successful requests (Triton name)", labels, registry=r)
        self.nv_failure = Gauge("nv_inference_request_failure", "Failed requests (Triton name)", [*labels, "reason"], registry=r)
        self.nv_count = Gauge("nv_inference_count", "Inferences performed, in items (Triton name)", labels, registry=r)
        self.nv_exec = Gauge("nv_inference_exec_count", "Batches executed (Triton name)", labels, registry=r)
        self.nv_request_us = Gauge("nv_inference_request_duration_us", "Cumulative request time (Triton name)", labels, registry=r)
        self.nv_queue_us = Gauge("nv_inference_queue_duration_us", "Cumulative queue time (Triton name)", labels, registry=r)
        self.nv_input_us = Gauge("nv_inference_compute_input_duration_us", "Cumulative host-stage time (Triton name: compute input)", labels, registry=r)
        self.nv_infer_us = Gauge("nv_inference_compute_infer_duration_us", "Cumulative card-stage time (Triton name: compute infer)", labels, registry=r)
        self._models: dict[tuple[str, str], ModelMetrics] = {}

    def for_model(self, model: str, version: str) -> "ModelMetrics":
        """One model version's metric children, made once and then reused."""
        key = (model, version)
        bound = self._models.get(key)
        if bound is None:
            bound = self._models[key] = ModelMetrics(self, model, version)
        return bound

    def record_success(self, model: str, version: str, rows: int, total_s: float, queue_s: float,
                       host_s: float, card_s: float) -> None:
        self.for_model(model, version).record_success(rows, total_s, queue_s, host_s, card_s)

    def record_failure(self, model: str, version: str, reason: str) -> None:
        self.for_model(model, version).record_failure(reason)

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
        self.success, self.items = m.success.labels(model), m.items.labels(model)
        self.request_seconds, self.queue_seconds = m.request_seconds.labels(model), m.queue_seconds.labels(model)
        self.executions, self.batch_rows = m.executions.labels(model), m.batch_rows.labels(model)
        self.host_seconds, self.card_seconds = m.host_seconds.labels(model), m.card_seconds.labels(model)
        self.host_dense_max_rows = m.host_dense_max_rows.labels(model)
        self.host_dense_batches = m.host_dense_batches.labels(model)
        self.nv_success, self.nv_count = m.nv_success.labels(model, version), m.nv_count.labels(model, version)
        self.nv_exec = m.nv_exec.labels(model, version)
        self.nv_request_us, self.nv_queue_us = m.nv_request_us.labels(model, version), m.nv_queue_us.labels(model, version)
        self.nv_input_us, self.nv_infer_us = m.nv_input_us.labels(model, version), m.nv_infer_us.labels(model, version)
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
        self.success.inc()
        self.items.inc(rows)
        self.request_seconds.observe(total_s)
        self.queue_seconds.observe(queue_s)
        self.nv_success.inc()
        self.nv_count.inc(rows)
        self.nv_request_us.inc(total_s * 1e6)
        self.nv_queue_us.inc(queue_s * 1e6)
        self.nv_input_us.inc(host_s * 1e6)
        self.nv_infer_us.inc(card_s * 1e6)

    def record_failure(self, reason: str) -> None:
        # NOTE: failures are rare; labels() per call keeps the reason set open.
        self._m.failure.labels(self.model, reason).inc()
        self._m.nv_failure.labels(self.model, self.version, reason).inc()
