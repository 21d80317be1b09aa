"""The REST endpoint's wiring: HTTPS with the server's TLS files, the body limit, a busy port,
shutdown, and sixfold-serve's --http-port."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.http as th

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from tests.conftest import ServeProcess, free_port

from tests.server.transport.test_http import http_client, http_inputs, json_request


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=200, cards=1)


def _server(rm1, **config) -> BackgroundServer:
    model, partitioned = rm1
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=metrics, batching=BatchingConfig())
    return BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, **config), metrics)


def _expected(model, request: dict[str, np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in
                       ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


def test_rest_is_https_with_the_servers_tls_files(rm1, certificate) -> None:
    cert, key = certificate
    model = rm1[0]
    with _server(rm1, http_port=0, tls_cert=str(cert), tls_key=str(key)) as server:
        request = models.RequestGenerator.for_config(model.config, seed=4).make(3)
        context = ssl.create_default_context(cafile=str(cert))
        body = json.dumps(json_request(request)).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"https://{server.http_url}/v2/models/rm1/infer", data=body, method="POST"),
                context=context, timeout=30) as response:
            scores = np.asarray(json.loads(response.read())["outputs"][0]["data"], np.float32).reshape(3, 1)
        np.testing.assert_allclose(scores, _expected(model, request), atol=1e-4, rtol=0)
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{server.http_url}/v2/health/live", timeout=5)


def test_a_streamed_body_over_the_limit_gets_413_and_the_server_keeps_serving(rm1) -> None:
    model = rm1[0]
    with _server(rm1, http_port=0, max_message_bytes=1 << 20) as server:
        host, port = server.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:  # chunked: no Content-Length to refuse it by, so the limit is met while reading
            conn.request("POST", "/v2/models/rm1/infer", body=iter([b" " * (256 << 10)] * 5),
                         encode_chunked=True)
            response = conn.getresponse()
            assert response.status == 413
            assert "over the 1048576-byte limit" in json.loads(response.read())["error"]
        finally:
            conn.close()
        with http_client(server.http_url) as client:
            request = models.RequestGenerator.for_config(model.config, seed=5).make(2)
            scores = client.infer("rm1", http_inputs(th, request, binary=True)).as_numpy("scores")
        np.testing.assert_allclose(scores, _expected(model, request), atol=1e-4, rtol=0)


def test_a_busy_rest_port_is_an_error_naming_it(rm1) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = _server(rm1, http_port=port)
        with pytest.raises(OSError, match=f"REST: could not bind 127.0.0.1:{port}"):
            server.start()


def test_rest_off_by_default_in_the_library_and_closed_after_stop(rm1) -> None:
    with _server(rm1) as server:
        assert server.http_url == ""
    with _server(rm1, http_port=0) as server:
        url = server.http_url
        assert urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=10).status == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{url}/v2/health/live", timeout=5)


def test_an_idle_keep_alive_connection_outlives_uvicorns_default_5_s(rm1) -> None:
    import time

    with _server(rm1, http_port=0) as server:
        host, port = server.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", "/v2/health/ready")
            assert conn.getresponse().read() == b""
            time.sleep(6.0)  # past uvicorn's default keep-alive (5 s), well inside ours (75 s)
            conn.request("GET", "/v2/health/live")  # the same connection: http.client would not reconnect
            assert conn.getresponse().status == 200
        finally:
            conn.close()


def test_sixfold_serve_http_port() -> None:
    port = free_port()
    serve = ServeProcess("--model", "rm1", "--max-rows", "300", "--cards", "1", "--backend", "onnxruntime",
                         "--grpc-port", "0", "--metrics-port", "-1", "--http-port", str(port))
    try:
        assert serve.url, serve.output
        assert f"REST http://127.0.0.1:{port}/v2" in serve.output
        with http_client(f"127.0.0.1:{port}") as client:
            assert client.is_server_ready() and client.is_model_ready("rm1")
            request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=2).make(4)
            assert client.infer("rm1", http_inputs(th, request, binary=False)).as_numpy("scores").shape == (4, 1)
    finally:
        assert serve.stop() == 0
    off = ServeProcess("--model", "rm1", "--max-rows", "300", "--cards", "1", "--backend", "onnxruntime",
                       "--grpc-port", "0", "--metrics-port", "-1", "--http-port", "-1")
    try:
        assert off.url, off.output
        assert "REST off" in off.output
    finally:
        assert off.stop() == 0


def test_repository_index_load_and_unload_over_rest(tmp_path, rm1) -> None:
    from sixfold.partitioner.artifacts import write_artifacts

    model, partitioned = rm1
    write_artifacts(partitioned, tmp_path / "repo" / "alpha" / "1")
    port, token = free_port(), "s3cret"
    serve = ServeProcess("--model-repository", str(tmp_path / "repo"), "--model-control-mode", "explicit",
                         "--control-token", token, "--backend", "onnxruntime", "--grpc-port", "0",
                         "--metrics-port", "-1", "--http-port", str(port))
    try:
        assert serve.url, serve.output
        with http_client(f"127.0.0.1:{port}") as client:
            assert client.get_model_repository_index() == [
                {"name": "alpha", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}]
            with pytest.raises(th.InferenceServerException, match="authorization: Bearer") as caught:
                client.load_model("alpha")
            assert caught.value.status() == "401"
            auth = {"authorization": f"Bearer {token}"}
            with pytest.raises(th.InferenceServerException, match="'parameters'"):
                client.load_model("alpha", headers=auth, config="{}")
            client.load_model("alpha", headers=auth)
            assert client.is_model_ready("alpha")
            assert client.get_model_repository_index()[0]["state"] == "READY"
            request = models.RequestGenerator.for_config(model.config, seed=6).make(3)
            scores = client.infer("alpha", http_inputs(th, request, binary=True)).as_numpy("scores")
            np.testing.assert_allclose(scores, _expected(model, request), atol=1e-4, rtol=0)
            client.unload_model("alpha", headers=auth)
            assert not client.is_model_ready("alpha")
    finally:
        assert serve.stop() == 0


def test_stop_answers_every_rest_request_it_received(rm1) -> None:
    """Requests sent before stop() are answered (scores, or 503 once draining); none is dropped."""
    model = rm1[0]
    server = _server(rm1, http_port=0, grace_seconds=20.0).start()
    big = models.RequestGenerator.for_config(model.config, seed=8).make(1000)
    outcomes: list[str] = []
    first_done = threading.Event()

    def call() -> None:
        with http_client(server.http_url) as client:
            try:
                scores = client.infer("rm1", http_inputs(th, big, binary=True)).as_numpy("scores")
                outcomes.append("ok" if scores.shape == (1000, 1) else f"shape {scores.shape}")
            except th.InferenceServerException as exc:
                outcomes.append(exc.status())
        first_done.set()

    threads = [threading.Thread(target=call) for _ in range(10)]
    try:
        for t in threads:
            t.start()
        assert first_done.wait(60)
    finally:
        server.stop()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 10, outcomes
    assert set(outcomes) <= {"ok", "503"} and "ok" in outcomes, outcomes


def test_grpc_refuses_a_config_override_on_load_as_rest_does(tmp_path, rm1) -> None:
    """tritonclient's load_model(config=...) over gRPC: INVALID_ARGUMENT with REST's message (400 there)."""
    import tritonclient.grpc as tg

    from sixfold.partitioner.artifacts import write_artifacts

    write_artifacts(rm1[1], tmp_path / "repo" / "alpha" / "1")
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    serve = ServeProcess("--model-repository", str(tmp_path / "repo"), "--model-control-mode", "explicit",
                         "--control-token-file", str(token_file), "--backend", "onnxruntime", "--grpc-port", "0",
                         "--metrics-port", "-1", "--http-port", str(port))
    try:
        assert serve.url, serve.output
        auth = {"authorization": "Bearer s3cret"}
        config = json.dumps({"max_batch_size": 8})
        with tg.InferenceServerClient(serve.url) as client:
            with pytest.raises(tg.InferenceServerException) as grpc_caught:
                client.load_model("alpha", headers=auth, config=config)
            assert grpc_caught.value.status() == "StatusCode.INVALID_ARGUMENT", grpc_caught.value
            assert not client.is_model_ready("alpha")
        with http_client(f"127.0.0.1:{port}") as client:
            with pytest.raises(th.InferenceServerException) as rest_caught:
                client.load_model("alpha", headers=auth, config=config)
            assert rest_caught.value.status() == "400"
        assert "'parameters' ['config'] are not supported" in grpc_caught.value.message()
        assert grpc_caught.value.message() == rest_caught.value.message()
        with tg.InferenceServerClient(serve.url) as client:
            client.load_model("alpha", headers=auth)  # without the override it loads
            assert client.is_model_ready("alpha")
            client.unload_model("alpha", headers=auth)  # tritonclient's unload_dependents is taken, as over REST
            assert not client.is_model_ready("alpha")
    finally:
        assert serve.stop() == 0
