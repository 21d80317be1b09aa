"""The supervisor's page from the workers' real /metrics endpoints: one process's names, types and sums."""

from __future__ import annotations

import re

from sixfold.server.observability.metrics import ServerMetrics
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


def test_counters_and_histograms_are_summed_gauges_merged_or_kept_per_worker():
    workers = [_worker(3, 2, 16), _worker(5, 1, 32)]
    ports = [w.serve("127.0.0.1", 0) for w in workers]
    try:
        page = WorkersMetrics(ports).exposition().decode()
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))
        s = scrape(page, 1.0, TARGET).samples
        version = frozenset({("model", "rm2"), ("version", "1"), ("pod", "p")})
        model = frozenset({("model", "rm2"), ("pod", "p")})
        assert types["nv_inference_request_success"] == "counter" and "nv_inference_request_success_total" not in types
        assert s["nv_inference_request_success"] == {version: 8}
        assert s["nv_inference_count"] == {version: 32}
        assert s["nv_inference_request_duration_us"][version] == 8 * 3000.0
        assert s["nv_inference_pending_request_count"] == {version: 3}
        assert s["nv_inference_request_failure"][version | {("reason", "REJECTED"), ("sixfold_reason", "overloaded")}] == 2
        assert s["sixfold_inference_request_success_total"] == {model: 8}
        assert s["sixfold_request_duration_seconds_count"] == {model: 8}
        assert s["sixfold_request_duration_seconds_bucket"][model | {("le", "0.005")}] == 8
        created = s["sixfold_inference_request_failure_created"][frozenset({("model", "rm2"), ("reason", "overloaded"),
                                                                           ("pod", "p")})]
        assert created == min(parse_page(w.exposition().decode())["sixfold_inference_request_failure_created"]
                              .samples.popitem()[1] for w in workers)
        assert s["sixfold_host_dense_max_rows"] == {model | {("worker", "0")}: 16, model | {("worker", "1")}: 32}
        assert set(s["nv_cpu_utilization"]) == {frozenset(TARGET.items())}   # the supervisor's own, unlabelled
        assert s["sixfold_worker_inference_request_success_total"] == {
            frozenset({("worker", "0"), ("pod", "p")}): 3, frozenset({("worker", "1"), ("pod", "p")}): 5}
        assert s["sixfold_worker_pending_request_count"][frozenset({("worker", "1"), ("pod", "p")})] == 1
    finally:
        for w in workers:
            w.close()


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
