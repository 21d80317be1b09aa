"""The supervisor's page from the engine's and front ends' real /metrics endpoints: one process's names, types, sums."""

from __future__ import annotations

import re

import pytest

from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.frontend import front_end_metrics
from sixfold.server.workers.worker_metrics import WorkersMetrics, parse_page
from tests.server.observability.promql import scrape

TARGET = {"pod": "p"}


def _worker(requests: int, pending: int, dense_rows: int) -> ServerMetrics:
    metrics = ServerMetrics()
    m = metrics.for_model("rm2", "1")
    for _ in range(requests):
        m.record_success(4, 0.003, 0.001, 0.0005, 0.001)
    m.record_batch(4 * requests, 0.0005, 0.001, dense_rows, False)
    m.record_failure("overloaded")
    m.pending = lambda: pending
    return metrics


def test_the_engines_series_and_the_front_ends_counts_make_one_page():
    engine = _worker(8, 3, 16)
    front_ends = [front_end_metrics(1, lambda: 2), front_end_metrics(2, lambda: 1)]
    front_ends[0][1].inc(3)
    front_ends[1][1].inc(5)
    pages = [engine] + [metrics for metrics, _ in front_ends]
    ports = [p.serve("127.0.0.1", 0) for p in pages]
    try:
        page = WorkersMetrics(ports).exposition().decode()
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))
        s = scrape(page, 1.0, TARGET).samples
        version = frozenset({("model", "rm2"), ("version", "1"), ("pod", "p")})
        model = frozenset({("model", "rm2"), ("pod", "p")})
        assert types["nv_inference_request_success"] == "counter" and "nv_inference_request_success_total" not in types
        assert s["nv_inference_request_success"] == {version: 8}  # the engine's: the front ends hold no model
        assert s["nv_inference_count"] == {version: 32}
        assert s["nv_inference_request_duration_us"][version] == pytest.approx(8 * 3000.0)
        assert s["nv_inference_pending_request_count"] == {version: 3}
        assert s["nv_inference_request_failure"][version | {("reason", "REJECTED"), ("sixfold_reason", "overloaded")}] == 1
        assert s["sixfold_inference_request_success_total"] == {model: 8}
        assert s["sixfold_request_duration_seconds_count"] == {model: 8}
        assert s["sixfold_request_duration_seconds_bucket"][model | {("le", "0.005")}] == 8
        created = s["sixfold_inference_request_failure_created"][frozenset({("model", "rm2"), ("reason", "overloaded"),
                                                                           ("pod", "p")})]
        assert created == parse_page(engine.exposition().decode())["sixfold_inference_request_failure_created"] \
            .samples.popitem()[1]
        assert s["sixfold_host_dense_max_rows"] == {model | {("worker", "0")}: 16}
        assert set(s["nv_cpu_utilization"]) == {frozenset(TARGET.items())}   # the supervisor's own, unlabelled
        assert s["sixfold_frontend_requests_total"] == {frozenset({("frontend", "1"), ("pod", "p")}): 3,
                                                        frozenset({("frontend", "2"), ("pod", "p")}): 5}
        assert s["sixfold_worker_inference_request_success_total"] == {  # per front end; worker 0 is the engine
            frozenset({("worker", "1"), ("pod", "p")}): 3, frozenset({("worker", "2"), ("pod", "p")}): 5}
        assert s["sixfold_worker_pending_request_count"] == {
            frozenset({("worker", "1"), ("pod", "p")}): 2, frozenset({("worker", "2"), ("pod", "p")}): 1}
        assert set(dict(labels)["worker"] for labels in s["sixfold_worker_up"]) == {"0", "1", "2"}
    finally:
        for p in pages:
            p.close()


def test_a_worker_that_stops_answering_keeps_its_counts_and_is_marked_down():
    workers = [_worker(3, 0, 0), _worker(5, 0, 0)]
    ports = [w.serve("127.0.0.1", 0) for w in workers]
    merged = WorkersMetrics(ports)
    try:
        first = scrape(merged.exposition().decode(), 1.0, TARGET).samples
        workers[1].close()
        second = scrape(merged.exposition().decode(), 2.0, TARGET).samples
        assert first["nv_inference_request_success"] == second["nv_inference_request_success"]  # no counter goes back
        up = {dict(labels)["worker"]: value for labels, value in second["sixfold_worker_up"].items()}
        assert up == {"0": 1.0, "1": 0.0}
    finally:
        workers[0].close()
