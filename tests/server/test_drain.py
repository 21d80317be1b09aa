"""Drain on shutdown: not ready first, still serving through the grace, then refusing.

No timing: the grace is long (60 s) and the test ends it itself (``end_drain``, what a second
SIGTERM does), so a slow machine cannot make a request land on the wrong side of it.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from tests.conftest import triton_inputs


def _health(url: str) -> int:
    with grpc.insecure_channel(url) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def _rest_ready(http_url: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_stop_reports_not_ready_keeps_serving_through_the_grace_then_refuses() -> None:
    model, partitioned = partition_builtin("rm1", max_rows=200, cards=1)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=metrics, batching=BatchingConfig())
    config = ServerConfig(grpc_port=0, http_port=0, metrics_port=None, drain_seconds=60.0)
    server = BackgroundServer(InferenceCore([served]), config, metrics).start()
    request = models.RequestGenerator.for_config(model.config, seed=2).make(3)
    stopper = threading.Thread(target=server.stop, daemon=True)
    try:
        with tc.InferenceServerClient(server.url) as client:
            assert client.is_server_ready() and _health(server.url) == health_pb2.HealthCheckResponse.SERVING
            stopper.start()
            _wait_for(lambda: _health(server.url) == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING")
            # Not ready on every surface a load balancer asks...
            assert not client.is_server_ready() and not client.is_model_ready("rm1")
            assert _rest_ready(server.http_url) == 400
            # ...while requests are still scored.
            assert client.infer("rm1", triton_inputs(tc, request)).as_numpy("scores").shape == (3, 1)
            assert stopper.is_alive()
            server.end_drain()
            stopper.join(timeout=60)
            assert not stopper.is_alive()
            with pytest.raises(InferenceServerException):
                client.infer("rm1", triton_inputs(tc, request), client_timeout=10)
    finally:
        if stopper.is_alive():
            server.end_drain()
            stopper.join(timeout=60)
        elif not stopper.ident:
            server.stop()


def test_drain_seconds_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="drain_seconds"):
        ServerConfig(drain_seconds=-1)
