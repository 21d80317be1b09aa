"""What clients may hold before admission (issue 33): bytes in flight, slow and idle connections, stalled
TLS handshakes. Real servers on loopback, real sockets, stock tritonclient."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.transport.limits import TransportLimits, grpc_options
from sixfold.server.transport.receive_budget import ReceiveBudget
from tests.conftest import free_port
from tests.server.transport.test_http import json_request

MIB = 1 << 20


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=200, cards=1)


def _server(rm1, limits: TransportLimits, **config) -> BackgroundServer:
    _, partitioned = rm1
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=metrics, batching=BatchingConfig())
    return BackgroundServer(InferenceCore([served]), ServerConfig(
        grpc_port=0, http_port=0, metrics_port=free_port(), limits=limits, **config), metrics)


def _grpc_infer(client: tc.InferenceServerClient, request: dict[str, np.ndarray]) -> np.ndarray:
    inputs = []
    for name, array in request.items():
        item = tc.InferInput(name, list(array.shape), {np.float32: "FP32", np.int32: "INT32",
                                                        np.int64: "INT64"}[array.dtype.type])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return client.infer("rm1", inputs, client_timeout=10).as_numpy("scores")


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, TimeoutError):
        return False


def test_budget_refuses_at_once_only_when_bodies_held_leave_no_room() -> None:
    async def scenario() -> None:
        budget = ReceiveBudget(limit=4 * MIB, max_message_bytes=2 * MIB)
        assert await budget.start_read(1.0) and await budget.start_read(1.0)  # two reads: 4 MiB reserved
        waiting = asyncio.ensure_future(budget.start_read(5.0))  # a third waits for them to settle...
        await asyncio.sleep(0.05)
        budget.end_read(100)  # one was 100 bytes: 2 MiB + 100 held, still no room for 2 MiB more
        await asyncio.sleep(0.05)
        assert not waiting.done()
        budget.end_read(3 * MIB // 2)  # ...and starts once both have
        assert await asyncio.wait_for(waiting, 1.0) and budget.held == 100 + 3 * MIB // 2 + 2 * MIB
        budget.end_read(None)  # a read that failed holds nothing
        assert budget.held == 100 + 3 * MIB // 2 and budget.reading == 0
        assert budget.try_hold(2 * MIB)
        started = time.monotonic()
        assert not await budget.start_read(5.0)  # 3.5 MiB of bodies held: no room for 2 MiB, refused at once
        assert time.monotonic() - started < 0.1 and not budget.try_hold(1 * MIB) and budget.refused == 2
        budget.release(100 + 3 * MIB // 2 + 2 * MIB)
        assert budget.held == 0 and budget.try_hold(64 * MIB)  # an empty server takes any one request
    asyncio.run(scenario())


def test_grpc_options_turn_off_read_ahead_and_carry_the_limits() -> None:
    options = dict(grpc_options(TransportLimits(max_connections=7, idle_timeout_s=2, max_connection_age_s=0)))
    assert options["grpc.http2.bdp_probe"] == 0 and options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.max_connection_idle_ms"] == 2000 and "grpc.max_connection_age_ms" not in options
    with pytest.raises(ValueError, match="body_timeout_s"):
        TransportLimits(body_timeout_s=-1)


def test_bytes_in_flight_are_refused_before_their_body_is_read(rm1) -> None:
    """A REST body held open by a slow sender takes the whole budget: a second REST request is 429 before
    it sends its body, a gRPC one RESOURCE_EXHAUSTED at once; once the stalled body times out (408) both
    are served again."""
    model, _ = rm1
    request = models.RequestGenerator.for_config(model.config, seed=4).make(3)
    limits = TransportLimits(receive_bytes=1 * MIB, body_timeout_s=1.5)
    with _server(rm1, limits, max_message_bytes=1 * MIB) as server, \
            tc.InferenceServerClient(server.url) as client:
        assert _grpc_infer(client, request).shape == (3, 1)
        host, port = server.http_url.split(":")
        stalled = socket.create_connection((host, int(port)), timeout=10)
        stalled.sendall(("POST /v2/models/rm1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {MIB}\r\n\r\n").encode() + b"{" * 100)
        time.sleep(0.3)
        body = json.dumps(json_request(request)).encode()
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.putrequest("POST", "/v2/models/rm1/infer")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()  # the body is not sent: the answer comes without it
        started = time.monotonic()
        answer = conn.getresponse()
        assert answer.status == 429 and b"--max-queue-bytes-mb" in answer.read()
        assert time.monotonic() - started < 1.0
        conn.close()
        with pytest.raises(tc.InferenceServerException, match="max-queue-bytes-mb") as refused:
            _grpc_infer(client, request)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        stalled.settimeout(5)
        assert stalled.recv(4096).startswith(b"HTTP/1.1 408 ")  # the slow body is cut at --body-timeout-s
        stalled.close()
        assert _grpc_infer(client, request).shape == (3, 1)
        with urllib.request.urlopen(urllib.request.Request(
                f"http://{server.http_url}/v2/models/rm1/infer", data=body,
                headers={"Content-Type": "application/json"}), timeout=10) as ok:
            assert ok.status == 200


def test_a_flood_of_large_grpc_requests_holds_no_more_than_the_budget(rm1) -> None:
    """60 requests of ~0.9 MB at once against a 4 MiB budget (1 MiB messages): each is answered or refused
    RESOURCE_EXHAUSTED, never held past the budget, and the server answers normally afterwards."""
    model, _ = rm1
    request = models.RequestGenerator.for_config(model.config, seed=6).make(150)
    size = sum(a.nbytes for a in request.values())
    assert 0.5 * MIB < size < MIB
    inputs = []
    for name, array in request.items():
        item = tc.InferInput(name, list(array.shape), {np.float32: "FP32", np.int32: "INT32",
                                                        np.int64: "INT64"}[array.dtype.type])
        item.set_data_from_numpy(array)
        inputs.append(item)
    with _server(rm1, TransportLimits(receive_bytes=4 * MIB), max_message_bytes=1 * MIB) as server, \
            tc.InferenceServerClient(server.url) as client:
        outcomes: list[str] = []
        done = []
        gc.disable()  # what refcounting frees, not what a collection happens to find
        try:
            for _ in range(60):
                client.async_infer("rm1", inputs, lambda result, error: (
                    outcomes.append("OK" if error is None else error.status()), done.append(1)), client_timeout=30)
            deadline = time.monotonic() + 30
            while len(done) < 60 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            alive = sum(type(o).__name__ == "InferRequestView" for o in gc.get_objects())
        finally:
            gc.enable()
        assert alive == 0  # grpc's request iterator once kept each call's message until a collection
        budget = server.server.receive_budget
        assert len(outcomes) == 60 and set(outcomes) <= {"OK", "StatusCode.RESOURCE_EXHAUSTED"}, outcomes
        assert "OK" in outcomes and budget.peak <= 4 * MIB and budget.held == 0
        assert _grpc_infer(client, models.RequestGenerator.for_config(model.config, seed=7).make(2)).shape == (2, 1)


def test_two_hundred_slow_connections_do_not_starve_the_server(rm1) -> None:
    """200 connections to each of REST and /metrics dribble a request a byte every 0.4 s: health,
    /metrics and gRPC inference on an open connection still answer promptly, and every slow
    connection is closed once its headers pass --header-timeout-s."""
    model, _ = rm1
    request = models.RequestGenerator.for_config(model.config, seed=5).make(2)
    limits = TransportLimits(header_timeout_s=1.5)
    with _server(rm1, limits) as server, tc.InferenceServerClient(server.url) as client:
        _grpc_infer(client, request)  # the connection is open before the slow ones come
        quiet = min(_timed(lambda: _grpc_infer(client, request)) for _ in range(5))
        host, http_port = server.http_url.split(":")
        metrics_port = server.server.metrics_port
        slow = [socket.create_connection((host, port), timeout=5)
                for port in (int(http_port), metrics_port) for _ in range(200)]
        line = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
        busy = []
        for step in range(4):  # bounded: 4 bytes each, 0.4 s apart
            for sock in slow:
                try:
                    sock.send(line[step:step + 1])
                except OSError:
                    pass
            busy.append(_timed(lambda: _grpc_infer(client, request)))
            busy.append(_timed(lambda: urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready",
                                                              timeout=5).read()))
            busy.append(_timed(lambda: urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics",
                                                              timeout=5).read()))
            time.sleep(0.4)
        assert max(busy) < 1.0, (quiet, busy)
        closed = sum(_closed_by_server(sock, 3.0) for sock in slow)
        for sock in slow:
            sock.close()
        assert closed == len(slow)


def _timed(call) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_connections_past_the_cap_are_closed_at_once(rm1) -> None:
    with _server(rm1, TransportLimits(max_connections=20)) as server:
        host, http_port = server.http_url.split(":")
        grpc_held = [socket.create_connection((host, server.server.port), timeout=5) for _ in range(20)]
        time.sleep(0.2)
        assert _closed_by_server(socket.create_connection((host, server.server.port), timeout=5), 3.0)
        for sock in grpc_held:
            sock.close()
        for port in (int(http_port), server.server.metrics_port):
            held = [socket.create_connection((host, port), timeout=5) for _ in range(20)]
            time.sleep(0.2)
            extra = socket.create_connection((host, port), timeout=5)
            extra.settimeout(3)
            assert extra.recv(4096).startswith(b"HTTP/1.1 503 ")
            assert _closed_by_server(extra, 3.0)
            for sock in held + [extra]:
                sock.close()
            time.sleep(0.2)
            page = "/metrics" if port == server.server.metrics_port else "/v2/health/live"
            assert urllib.request.urlopen(f"http://{host}:{port}{page}", timeout=5).status == 200


def test_stalled_tls_handshakes_are_closed_after_the_timeout(rm1, certificate) -> None:
    cert, key = certificate
    limits = TransportLimits(handshake_timeout_s=1.0)
    with _server(rm1, limits, tls_cert=str(cert), tls_key=str(key)) as server:
        host, http_port = server.http_url.split(":")
        ports = {"REST": int(http_port), "metrics": server.server.metrics_port, "gRPC": server.server.port}
        stalled = {name: [socket.create_connection((host, port), timeout=5) for _ in range(20)]
                   for name, port in ports.items()}  # connect, never say hello
        started = time.monotonic()
        for name, socks in stalled.items():
            assert all(_closed_by_server(sock, 6.0) for sock in socks), name
            for sock in socks:
                sock.close()
        assert time.monotonic() - started < 8.0
