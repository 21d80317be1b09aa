"""Per-request metrics are plain numbers read at scrape time: the exposition must still be Prometheus's."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_request_series_count_sum_and_bucket_like_prometheus_client():
    metrics = ServerMetrics()
    v1, v2 = metrics.for_model("rm2", "1"), metrics.for_model("rm2", "2")
    v1.record_success(10, 0.001, 0.0004, 0.0002, 0.0003)   # 1 ms: exactly on a bucket bound, counts in it
    v1.record_success(5, 0.003, 0.0, 0.001, 0.001)
    v2.record_success(7, 9.0, 0.5, 0.1, 0.2)               # above every bound: +Inf only
    s = _samples(metrics)
    model = (("model", "rm2"),)
    assert s[("sixfold_inference_request_success_total", model)] == 3      # versions summed
    assert s[("sixfold_inference_count_total", model)] == 22
    assert s[("sixfold_request_duration_seconds_count", model)] == 3
    assert abs(s[("sixfold_request_duration_seconds_sum", model)] - 9.004) < 1e-9
    bucket = lambda le: s[("sixfold_request_duration_seconds_bucket", (("le", le), ("model", "rm2")))]  # noqa: E731
    assert (bucket("0.0005"), bucket("0.001"), bucket("0.002"), bucket("0.005"), bucket("5.0"), bucket("+Inf")) == \
        (0, 1, 1, 2, 2, 3)
    assert s[("sixfold_queue_duration_seconds_bucket", (("le", "0.0005"), ("model", "rm2")))] == 2
    one, two = (("model", "rm2"), ("version", "1")), (("model", "rm2"), ("version", "2"))
    assert s[("nv_inference_request_success", one)] == 2 and s[("nv_inference_request_success", two)] == 1
    assert s[("nv_inference_count", one)] == 15
    assert abs(s[("nv_inference_request_duration_us", one)] - 4000.0) < 1e-6
    assert abs(s[("nv_inference_compute_infer_duration_us", two)] - 2e5) < 1e-6


def test_a_server_with_no_requests_exports_no_request_samples():
    s = _samples(ServerMetrics())
    assert not [k for k in s if k[0].startswith(("sixfold_inference_request_success", "nv_inference_count"))]


def test_batch_series_count_sum_and_bucket_like_prometheus_client():
    metrics = ServerMetrics()
    v1, v2 = metrics.for_model("dlrm", "1"), metrics.for_model("dlrm", "2")
    v1.record_batch(8, 0.0004, 0.003, 16, True)
    v1.record_batch(300, 0.02, 0.004, 16, False)
    v2.record_batch(1, 0.0001, 0.0001, 0, True)
    s = _samples(metrics)
    model = (("model", "dlrm"),)
    assert s[("sixfold_inference_exec_count_total", model)] == 3            # versions summed
    assert s[("sixfold_host_dense_batches_total", model)] == 2
    assert s[("sixfold_batch_rows_count", model)] == 3 and s[("sixfold_batch_rows_sum", model)] == 309
    rows = lambda le: s[("sixfold_batch_rows_bucket", (("le", le), ("model", "dlrm")))]  # noqa: E731
    assert (rows("1.0"), rows("8.0"), rows("256.0"), rows("512.0"), rows("+Inf")) == (1, 2, 2, 3, 3)
    assert abs(s[("sixfold_card_stage_duration_seconds_sum", model)] - 0.0071) < 1e-12
    assert s[("sixfold_host_stage_duration_seconds_bucket", (("le", "0.0005"), ("model", "dlrm")))] == 2
    assert s[("nv_inference_exec_count", (("model", "dlrm"), ("version", "1")))] == 2
    assert s[("sixfold_host_dense_max_rows", model)] == 0                   # the gauge: last value set
