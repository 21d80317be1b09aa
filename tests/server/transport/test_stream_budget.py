"""ModelStreamInfer holds the server's receive budget (--max-queue-bytes-mb) like ModelInfer does.

Real gRPC on 127.0.0.1, stock tritonclient's stream API, a real model on onnxruntime: a burst of
~0.9 MB requests on one stream against a 1 MiB budget gets some answered and the rest refused with
a RESOURCE_EXHAUSTED error_message (Triton's way of failing one stream request); the stream goes on,
nothing stays held, and the server answers other streams and unary calls afterwards.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2_grpc

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.transport.grpc_servicer import InferenceServicer
from sixfold.server.transport.receive_budget import ReceiveBudget

MIB = 1 << 20


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=200, cards=1)


class _StreamServer:
    """The servicer with a budget on a real grpc.aio server, on an event loop of its own thread."""

    def __init__(self, rm1, budget: ReceiveBudget) -> None:
        _, partitioned = rm1
        self.metrics = ServerMetrics()
        served = load_partitioned(partitioned, backend="onnxruntime", metrics=self.metrics, batching=BatchingConfig())
        self.core = InferenceCore([served])
        self.budget = budget
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def _start(self) -> None:
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.budget.max_message_bytes)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(self.core, metrics=self.metrics, receive_budget=self.budget), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def __enter__(self) -> "_StreamServer":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        asyncio.run_coroutine_threadsafe(self.server.stop(1), self.loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(self.core.shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _inputs(request: dict[str, np.ndarray]) -> list[tc.InferInput]:
    inputs = []
    for name, array in request.items():
        item = tc.InferInput(name, list(array.shape), {np.float32: "FP32", np.int32: "INT32",
                                                        np.int64: "INT64"}[array.dtype.type])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def _stream(client: tc.InferenceServerClient, inputs: list[tc.InferInput], count: int,
            within_s: float = 30) -> dict[str, tuple[str, object]]:
    """Send ``count`` requests on one stream at once; ``{id: ("OK", scores) | ("ERROR", message)}``."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(count):
            client.async_stream_infer("rm1", inputs, request_id=str(i))
        got: dict[str, tuple[str, object]] = {}
        deadline = time.monotonic() + within_s
        while len(got) < count and time.monotonic() < deadline:
            try:
                result, error = answers.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if error is None:
                got[result.get_response().id] = ("OK", result.as_numpy("scores"))
            else:
                got[f"error{len(got)}"] = ("ERROR", str(error))
        return got
    finally:
        client.stop_stream()


def test_a_burst_on_one_stream_is_answered_or_refused_within_the_budget(rm1) -> None:
    model, _ = rm1
    request = models.RequestGenerator.for_config(model.config, seed=6).make(150)
    size = sum(a.nbytes for a in request.values())
    assert 0.5 * MIB < size < MIB
    budget = ReceiveBudget(limit=1 * MIB, max_message_bytes=2 * MIB)
    inputs = _inputs(request)
    with _StreamServer(rm1, budget) as server, tc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        got = _stream(client, inputs, 40)
        assert len(got) == 40, f"{len(got)} of 40 answered"
        refused = [m for kind, m in got.values() if kind == "ERROR"]
        answered = [s for kind, s in got.values() if kind == "OK"]
        assert answered and refused, (len(answered), refused[:1])
        for message in refused:
            assert "RESOURCE_EXHAUSTED" in message and "--max-queue-bytes-mb" in message, message
        assert all(np.asarray(s).shape == (150, 1) for s in answered)
        assert budget.peak <= 1 * MIB and budget.held == 0 and budget.refused == len(refused)
        # the server goes on: a new stream of one request, and a unary call, are answered
        again = _stream(client, inputs, 1)
        assert [kind for kind, _ in again.values()] == ["OK"]
        small = _inputs(models.RequestGenerator.for_config(model.config, seed=7).make(2))
        assert client.infer("rm1", small, client_timeout=10).as_numpy("scores").shape == (2, 1)
        assert budget.held == 0


def test_a_stream_without_a_budget_holds_every_request(rm1) -> None:
    """No budget (limit 0): the same burst is answered whole; held bytes are still counted and released."""
    model, _ = rm1
    inputs = _inputs(models.RequestGenerator.for_config(model.config, seed=6).make(150))
    budget = ReceiveBudget(limit=0, max_message_bytes=2 * MIB)
    with _StreamServer(rm1, budget) as server, tc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        got = _stream(client, inputs, 10)
        assert sorted(kind for kind, _ in got.values()) == ["OK"] * 10
        assert budget.peak > 1 * MIB / 2 and budget.held == 0 and budget.refused == 0


def test_sixfold_serve_bounds_streams_with_its_max_queue_bytes() -> None:
    """The served path: ``sixfold-serve --max-queue-bytes-mb 1`` gives its streams the same budget."""
    from tests.conftest import ServeProcess

    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=200), seed=6).make(150)
    serve = ServeProcess("--model", "rm1", "--max-rows", "200", "--max-queue-bytes-mb", "1", "--grpc-port", "0",
                         "--metrics-port", "-1")
    try:
        assert serve.url, serve.output
        with tc.InferenceServerClient(serve.url) as client:
            got = _stream(client, _inputs(request), 40, within_s=60)
            assert len(got) == 40, f"{len(got)} of 40 answered"
            refused = [m for kind, m in got.values() if kind == "ERROR"]
            assert refused and all("RESOURCE_EXHAUSTED" in m and "--max-queue-bytes-mb" in m for m in refused), \
                refused[:1]
            assert any(kind == "OK" for kind, _ in got.values())
    finally:
        serve.kill()
