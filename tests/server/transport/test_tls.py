"""gRPC over TLS with --tls-cert/--tls-key: a TLS client is served, a plaintext one is not."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException


from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from tests.conftest import triton_inputs


def test_tls_serves_tls_clients_only(certificate) -> None:
    cert, key = certificate
    model, partitioned = partition_builtin("rm1", max_rows=200, cards=1)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=metrics, batching=BatchingConfig())
    config = ServerConfig(grpc_port=0, metrics_port=None, tls_cert=str(cert), tls_key=str(key))
    with BackgroundServer(InferenceCore([served]), config, metrics) as server:
        request = models.RequestGenerator.for_config(model.config, seed=9).make(4)
        with tc.InferenceServerClient(server.url, ssl=True, root_certificates=str(cert)) as client:
            scores = client.infer("rm1", triton_inputs(tc, request)).as_numpy("scores")
        with torch.inference_mode():
            expected = model(*[torch.from_numpy(request[k]) for k in
                               ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()
        np.testing.assert_allclose(scores, expected, atol=1e-4, rtol=0)
        with tc.InferenceServerClient(server.url) as plain, pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)


def test_tls_also_covers_the_metrics_endpoint_with_an_optional_token(certificate) -> None:
    import ssl
    import urllib.error
    import urllib.request

    cert, key = certificate
    _, partitioned = partition_builtin("rm1", max_rows=200, cards=1)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=metrics, batching=BatchingConfig())
    config = ServerConfig(grpc_port=0, metrics_port=0, tls_cert=str(cert), tls_key=str(key), metrics_token="scrape")
    with BackgroundServer(InferenceCore([served]), config, metrics) as server:
        port = server.server.metrics_port
        context = ssl.create_default_context(cafile=str(cert))
        request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics",
                                         headers={"Authorization": "Bearer scrape"})
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            assert answer.status == 200 and b"nv_inference_request_success" in answer.read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context, timeout=30)
        assert refused.value.code == 401
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext is not served beside it
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # stopping the server closed /metrics too
        urllib.request.urlopen(request, context=context, timeout=5)


def test_tls_needs_both_files() -> None:
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        ServerConfig(tls_cert="cert.pem")
