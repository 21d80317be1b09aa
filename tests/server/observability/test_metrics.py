"""Per-request metrics are plain numbers read at scrape time: the exposition must still be Prometheus's."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sixfold.server.observability.metrics import FAILURE_REASONS, TRITON_REASONS, ServerMetrics, triton_reason

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the page, by the name it is written under (not the parser's normalized one)."""
    text = metrics.exposition().decode()
    list(text_string_to_metric_families(text))  # the page as a whole must parse as Prometheus text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, labels, value = _SAMPLE.match(line).groups()
            samples[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = float(value)
    return samples


def _types(metrics: ServerMetrics) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics.exposition().decode(), re.M))


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


def test_a_server_with_no_model_exports_no_request_samples():
    s = _samples(ServerMetrics())
    assert not [k for k in s if k[0].startswith(("sixfold_inference_request_success", "nv_inference"))]


_TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count",
                    "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                    "nv_inference_compute_output_duration_us")


def test_a_served_version_has_every_triton_series_at_zero_before_its_first_request():
    """rate() and increase() miss a series' first sample: each one is there, at 0, from the start."""
    metrics = ServerMetrics()
    metrics.for_model("rm2", "1")
    metrics.for_model("rm2", "2")
    s = _samples(metrics)
    for version in ("1", "2"):
        labels = (("model", "rm2"), ("version", version))
        for name in (*_TRITON_COUNTERS, "nv_inference_pending_request_count"):
            assert s[(name, labels)] == 0, (name, version)
        failures = {dict(k[1])["reason"]: v for k, v in s.items()
                    if k[0] == "nv_inference_request_failure" and dict(k[1])["version"] == version}
        assert sorted(failures) == sorted(TRITON_REASONS) and not any(failures.values())
    every = {dict(k[1])["sixfold_reason"]: dict(k[1])["reason"] for k in s if k[0] == "nv_inference_request_failure"}
    assert every == FAILURE_REASONS


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


def test_triton_series_are_typed_as_triton_types_them():
    metrics = ServerMetrics()
    m = metrics.for_model("rm2", "1")
    m.record_success(4, 0.002, 0.001, 0.0005, 0.0005)
    for reason in ("overloaded", "overloaded", "invalid_input", "cancelled", "card_hang", "deadline", "not_a_reason"):
        m.record_failure(reason)
    m.pending = lambda: 7
    types, s = _types(metrics), _samples(metrics)
    for name in (*_TRITON_COUNTERS, "nv_inference_request_failure"):
        assert types[name] == "counter", name
        assert f"{name}_total" not in types   # Triton's names carry no suffix
    assert types["nv_inference_pending_request_count"] == "gauge"
    one = (("model", "rm2"), ("version", "1"))
    assert s[("nv_inference_pending_request_count", one)] == 7
    # what is left of the request after queue, host and card: 2 - 1 - 0.5 - 0.5 ms
    assert s[("nv_inference_compute_output_duration_us", one)] == pytest.approx(0.0, abs=1e-6)
    failed = lambda reason, detail: s[("nv_inference_request_failure", (  # noqa: E731
        ("model", "rm2"), ("reason", reason), ("sixfold_reason", detail), ("version", "1")))]
    assert failed("REJECTED", "overloaded") == 2 and failed("REJECTED", "deadline") == 1
    assert failed("OTHER", "invalid_input") == 1 and failed("OTHER", "not_a_reason") == 1
    assert failed("CANCELED", "cancelled") == 1 and failed("BACKEND", "card_hang") == 1
    by_triton = {r: sum(v for k, v in s.items() if k[0] == "nv_inference_request_failure" and ("reason", r) in k[1])
                 for r in TRITON_REASONS}
    assert by_triton == {"REJECTED": 3, "CANCELED": 1, "BACKEND": 1, "OTHER": 2}
    assert triton_reason("unavailable") == "REJECTED" and triton_reason("no_healthy_card") == "BACKEND"
    assert s[("sixfold_inference_request_failure_total", (("model", "rm2"), ("reason", "overloaded")))] == 2


def test_compute_output_is_the_rest_of_the_request():
    metrics = ServerMetrics()
    m = metrics.for_model("rm2", "1")
    m.record_success(4, 0.010, 0.002, 0.003, 0.004)   # 1 ms left after queue, host and card
    m.record_success(4, 0.001, 0.002, 0.0, 0.0)       # clocks disagree: never below 0
    assert _samples(metrics)[("nv_inference_compute_output_duration_us", (("model", "rm2"), ("version", "1")))] == \
        pytest.approx(1000.0)


def test_label_values_are_escaped():
    metrics = ServerMetrics()
    metrics.for_model('odd"name\\x', "1").record_success(1, 0.001, 0, 0, 0)
    s = _samples(metrics)
    assert s[("nv_inference_count", (("model", 'odd\\"name\\\\x'), ("version", "1")))] == 1


def _get(url: str, method: str = "GET") -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def test_only_the_metrics_path_answers_200_over_real_http():
    metrics = ServerMetrics()
    metrics.for_model("rm2", "1").record_success(3, 0.001, 0, 0, 0)
    port = metrics.serve("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{port}"
        status, body, content_type = _get(f"{base}/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert b'nv_inference_count{model="rm2",version="1"} 3.0' in body
        assert _get(f"{base}/metrics?name[]=x")[0] == 200           # a scraper's query string is fine
        status, body, _ = _get(f"{base}/metrics", "HEAD")
        assert status == 200 and body == b""
        for path in ("/", "/healthz", "/v2/health/ready", "/metrics/extra", "/metricsx"):
            status, body, _ = _get(f"{base}{path}")
            assert status == 404 and b"/metrics" in body, path     # a probe aimed here cannot pass by accident
        assert _get(f"{base}/metrics", "POST")[0] == 405
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


async def test_pending_requests_are_the_model_queue_length():
    """A served model's queue, read at scrape time: two requests wait while the first batch runs."""
    import asyncio

    import numpy as np

    from sixfold.server.scheduling.batcher import BatchingConfig, DynamicBatcher
    from sixfold.server.model.served import ServedModel

    release = asyncio.Event()

    async def run_batch(inputs, info):
        await release.wait()
        return {"scores": inputs["x"]}

    metrics = ServerMetrics()
    batcher = DynamicBatcher(run_batch, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0),
                             max_inflight=1)
    served = ServedModel(name="m", version="2", plan=None, runtime=None, batcher=batcher, metrics=metrics)  # type: ignore[arg-type]
    # NOTE: held: the metric reads a served model through a weak reference (an unloaded one reports 0)
    assert served.batcher is batcher
    pending = lambda: _samples(metrics)[("nv_inference_pending_request_count", (("model", "m"), ("version", "2")))]  # noqa: E731
    assert pending() == 0
    tasks = [asyncio.ensure_future(batcher.submit({"x": np.ones((1, 1), np.float32)}, 1)) for _ in range(3)]
    for _ in range(100):  # bounded: the first batch starts within a few loop turns
        await asyncio.sleep(0.01)
        if batcher.queued == 2:
            break
    assert pending() == 2
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert pending() == 0
    await batcher.close()


def test_metrics_over_tls_with_a_token(tmp_path):
    """With TLS the page is served over HTTPS only; with a token a scrape must carry it."""
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    metrics = ServerMetrics()
    metrics.for_model("rm2", "1").record_success(2, 0.001, 0, 0, 0)
    port = metrics.serve("127.0.0.1", 0, tls_cert=str(cert), tls_key=str(key), token="t0k")
    trusted = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}/metrics"

    def scrape(headers: dict[str, str]) -> tuple[int, bytes]:
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=trusted) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    import socket

    silent = socket.create_connection(("127.0.0.1", port), timeout=5)  # connects, never says hello
    try:
        status, body = scrape({"Authorization": "Bearer t0k"})   # answered all the same
        assert status == 200 and b'nv_inference_count{model="rm2",version="1"} 2.0' in body
        status, body = scrape({})
        assert status == 401 and b"Authorization: Bearer" in body
        assert scrape({"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(OSError):  # plaintext HTTP gets no page (the connection is reset)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        silent.close()
        metrics.close()


@pytest.mark.parametrize(("backend", "lag"), [("simcard", True), ("onnxruntime", False)])
def test_the_simulation_lag_is_exported_for_simulated_cards_only(backend: str, lag: bool) -> None:
    import tritonclient.grpc as tc

    from sixfold import models
    from tests.conftest import ServeProcess, free_port, triton_inputs

    port = free_port()
    serve = ServeProcess("--model", "tiny", "--backend", backend, "--cards", "2", "--grpc-port", "0",
                         "--http-port", "-1", "--metrics-port", str(port), "--host-dense-max-rows", "0")
    try:
        assert serve.url, serve.output
        gen = models.RequestGenerator.for_config(models.get_config("tiny"), seed=2)
        with tc.InferenceServerClient(serve.url) as client:
            for _ in range(4):
                client.infer("tiny", triton_inputs(tc, gen.make(8)))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        assert ("sixfold_simcard_lag_seconds" in samples) is lag
        assert "sixfold_card_outstanding_rows" in samples
    finally:
        serve.kill()
