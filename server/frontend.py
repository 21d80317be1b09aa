"""A front end of ``sixfold-serve --workers N``: the protocols on the shared ports, no model of its own.

Each front end serves gRPC and REST on the server's ports (SO_REUSEPORT: the kernel spreads
connections over the front ends) and parses requests on its own event loop, one core's worth of
protocol work each. It holds no model, table or batcher: inference goes to the engine through
shared memory (``sixfold.server.workers.engine_channel``), so requests from every front end meet in
the engine's one batcher, and everything else (readiness, metadata, configuration, statistics,
model control, table deltas, shared memory regions) is forwarded to the engine's own gRPC or REST
service and answered from its truth. A front end can therefore be restarted at any time and
answer as the other front ends do.

Inference requests whose tensors are in a client's shared memory region, or of BYTES, are forwarded
to the engine whole (the region's tensors are in shared memory already; BYTES cannot be viewed in place).

Run by the supervisor (``sixfold.server.workers.supervisor``) as
``python -m sixfold.server.frontend SPEC``, SPEC being a ``FrontEndSpec`` as JSON; the
metrics token comes in ``SIXFOLD_METRICS_TOKEN``, never in the process list.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Counter, Gauge
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sixfold.server.app import ServerConfig, SixfoldServer
from sixfold.server.core import InferenceCore
from sixfold.server.errors import (DeadlineExceeded, InternalError, InvalidInput, ModelNotFound, Overloaded,
                                   ServingError, Unauthenticated, Unavailable)
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.protocol.codec import decode_inputs, encode_response, request_priority, requested_outputs
from sixfold.server.protocol.http_codec import HEADER_LENGTH, decode_request
from sixfold.server.protocol.http_codec import encode_response as encode_rest_response
from sixfold.server.protocol.shared_memory import check_local_peer, grpc_peer_host
from sixfold.server.transport.grpc_servicer import InferenceServicer, _grpc_errors
from sixfold.server.transport.http_app import read_body_within, _http_exception, _name_version, _rest_errors, _Routes
from sixfold.server.transport.limits import TransportLimits
from sixfold.server.workers.engine_channel import ENGINE_GRPC_SOCKET, EngineClient
from sixfold.server.workers.process import READY_PREFIX
from sixfold.server.workers.worker_set import WorkerSet
from sixfold.server.workers.supervisor import follow_supervisor, worker_ports_line

__all__ = ["FrontEndSpec", "EngineMirror", "FrontEndServicer", "front_end_app", "front_end_metrics", "main"]

log = logging.getLogger(__name__)

_READY_POLL_S = 0.25
_CODE_ERRORS: dict[grpc.StatusCode, type[ServingError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput, grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable, grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated}


@dataclass(frozen=True)
class FrontEndSpec:
    """What a front end needs to serve: the server's network settings and where the engine is."""

    folder: str
    """The server's run folder: the engine's sockets, the arenas."""
    index: int
    count: int
    host: str
    grpc_port: int
    http_port: int | None
    engine_http: str | None
    """The engine's own REST ``HOST:PORT`` (loopback); None when REST is off."""
    metrics: bool = True
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = 64 << 20
    drain_seconds: float = 0.0
    arena_bytes: int = 512 << 20
    """Each arena's size (inputs, outputs): ``--max-queue-bytes-mb``, the engine's bound on queued inputs."""
    limits: dict = field(default_factory=dict)
    """``TransportLimits`` fields."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "FrontEndSpec":
        return FrontEndSpec(**json.loads(text))


class EngineMirror(InferenceCore):
    """A front end's core: no models; ready while the engine last said it was (polled every 0.25 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared_memory = None  # regions live in the engine; requests that name one are forwarded to it
        self.engine_ready = False

    @property
    def ready(self) -> bool:
        return self.accepting and not self.draining and self.engine_ready

    def readiness_changes(self) -> list:
        return []

    async def shutdown(self) -> None:
        """Refuse new requests; those in the engine are still answered (the engine drains its own queue)."""
        self.accepting = False


def _forwarded_error(exc: grpc.aio.AioRpcError) -> ServingError:
    """The engine's gRPC error, as the ServingError that gives the client the same code and message."""
    error = _CODE_ERRORS.get(exc.code(), InternalError)(exc.details() or "")
    error.code = exc.code()
    return error


def _uses_regions(request: service_pb2.ModelInferRequest) -> bool:
    """Whether a tensor of the request is in (or goes to) a client's shared memory region."""
    return (any("shared_memory_region" in t.parameters for t in request.inputs)
            or any("shared_memory_region" in o.parameters for o in request.outputs))


def _forwarding(method: str, peer_check: tuple[str, ...] | None = None):
    """A servicer method that asks the engine and answers what it answered."""
    @_grpc_errors
    async def forward(self: "FrontEndServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        if peer_check is not None:  # the engine sees this front end as its peer: the client is checked here
            check_local_peer(grpc_peer_host(context.peer() or ""), *peer_check)
        return await self.ask_engine(method, request, context)
    forward.__name__ = method
    return forward


class FrontEndServicer(InferenceServicer):
    """The gRPC service of a front end: inference through the engine channel, the rest forwarded."""

    def __init__(self, core: EngineMirror, engine: EngineClient, stub: Any, metrics: ServerMetrics | None,
                 answered: Any = None) -> None:
        super().__init__(core, metrics=metrics)
        self.engine, self.stub = engine, stub
        self.answered = answered
        """A counter of the inference requests this front end answered (None: not counted)."""

    async def ask_engine(self, method: str, request: Any, context: grpc.aio.ServicerContext | None,
                         timeout_s: float | None = None) -> Any:
        metadata = [(k, v) for k, v in (context.invocation_metadata() or ()) if k == "authorization"] \
            if context is not None else []
        if context is not None:
            timeout_s = context.time_remaining()
        try:
            return await getattr(self.stub, method)(request, metadata=metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _forwarded_error(exc) from None

    ServerReady = _forwarding("ServerReady")
    ServerMetadata = _forwarding("ServerMetadata")
    ModelReady = _forwarding("ModelReady")
    ModelMetadata = _forwarding("ModelMetadata")
    ModelConfig = _forwarding("ModelConfig")
    ModelStatistics = _forwarding("ModelStatistics")
    RepositoryIndex = _forwarding("RepositoryIndex")
    RepositoryModelLoad = _forwarding("RepositoryModelLoad")
    RepositoryModelUnload = _forwarding("RepositoryModelUnload")
    SystemSharedMemoryRegister = _forwarding("SystemSharedMemoryRegister", ())
    SystemSharedMemoryUnregister = _forwarding("SystemSharedMemoryUnregister", ("unregistration",))
    SystemSharedMemoryStatus = _forwarding("SystemSharedMemoryStatus")

    async def _answer(self, request: service_pb2.ModelInferRequest,
                      timeout_s: float | None) -> service_pb2.ModelInferResponse:
        if not self.core.accepting:
            raise Unavailable("server is shutting down; not accepting new requests")
        if (len(request.raw_input_contents) != len(request.inputs) or request.outputs) and _uses_regions(request):
            return await self.ask_engine("ModelInfer", request, None, timeout_s)
        try:
            inputs = decode_inputs(request)
        except ServingError as exc:
            if self.metrics is not None:
                self.metrics.record_refused("grpc", exc.reason)
            raise
        if any(array.dtype.hasobject for array in inputs.values()):  # BYTES: the engine decodes it
            return await self.ask_engine("ModelInfer", request, None, timeout_s)
        name, version, outputs = await self.engine.infer(request.model_name, request.model_version, inputs,
                                                         requested_outputs(request), timeout_s,
                                                         request_priority(request))
        if self.answered is not None:
            self.answered.inc()
        return encode_response(name, version, request.id, outputs)


_FORWARD_HEADERS = ("authorization", "content-type", "content-encoding", HEADER_LENGTH.lower())
_ANSWER_HEADERS = ("content-type", HEADER_LENGTH.lower(), "allow")


class _FrontEndRoutes(_Routes):
    """REST of a front end: inference through the engine channel, every other path forwarded to the engine."""

    def __init__(self, core: EngineMirror, engine: EngineClient, engine_http: str, *, tls: bool,
                 max_body_bytes: int, metrics: ServerMetrics | None, answered: Any = None) -> None:
        super().__init__(core, max_body_bytes, None, metrics)
        self.engine, self.answered = engine, answered
        self.engine_url = f"{'https' if tls else 'http'}://{engine_http}"
        self._session: Any = None

    async def _forward(self, request: Request, body: bytes, *, inflated: bool) -> Response:
        import aiohttp  # only a front end with REST on needs it

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=False), timeout=aiohttp.ClientTimeout(total=None))
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS
                   and not (inflated and k.lower() == "content-encoding")}
        url = self.engine_url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        async with self._session.request(request.method, url, data=body, headers=headers) as answer:
            content = await answer.read()
            return Response(content, status_code=answer.status,
                            headers={k: v for k, v in answer.headers.items() if k.lower() in _ANSWER_HEADERS})

    @_rest_errors
    async def forward(self, request: Request) -> Response:
        path = request.url.path
        if path.startswith("/v2/systemsharedmemory/") and path.endswith("register"):
            check_local_peer(request.client.host if request.client else None,
                             *(("unregistration",) if path.endswith("unregister") else ()))
        if request.method in ("GET", "HEAD"):
            body = b""
        else:
            body = await read_body_within(request, self.max_body_bytes)
        return await self._forward(request, body, inflated=False)

    @_rest_errors
    async def infer(self, request: Request) -> Response:
        if not self.core.accepting:
            raise Unavailable("server is shutting down; not accepting new requests")
        body = await self._body(request)
        header_length = request.headers.get(HEADER_LENGTH)
        head = body[:int(header_length)] if header_length and header_length.isdigit() else body
        if b"shared_memory_region" in head or b'"BYTES"' in head:  # the engine reads it whole
            return await self._forward(request, body, inflated=True)
        try:
            parsed = decode_request(body, header_length)
        except ServingError as exc:
            if self.metrics is not None:
                self.metrics.record_refused("rest", exc.reason)
            raise
        name, version = _name_version(request)
        model, served_version, outputs = await self.engine.infer(name, version, parsed.inputs, parsed.requested,
                                                                 parsed.timeout_s, parsed.priority)
        if self.answered is not None:
            self.answered.inc()
        content, length = encode_rest_response(model, served_version, parsed.id, outputs, parsed.binary_outputs)
        if length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type="application/octet-stream", headers={HEADER_LENGTH: str(length)})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def front_end_app(routes: _FrontEndRoutes) -> Starlette:
    """Triton's infer paths served here; every other path (known or not) answered by the engine."""
    model = "/v2/models/{name}"
    table = [Route(base + "/infer", routes.infer, methods=["POST"]) for base in (model, model + "/versions/{version}")]
    table.append(Route("/{path:path}", routes.forward, methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]))
    return Starlette(routes=table, exception_handlers={HTTPException: _http_exception})


def front_end_metrics(index: int, pending: Callable[[], int]) -> tuple[ServerMetrics, Any]:
    """A front end's metrics: refusals before the engine (``ServerMetrics``), and the two series of its own
    the supervisor's page shows per front end: requests answered (the returned counter) and ``pending()``,
    the requests at the engine now (``sixfold.server.workers.worker_metrics``)."""
    metrics = ServerMetrics()
    answered = Counter("sixfold_frontend_requests", "Inference requests each front end passed to the engine and "
                       "answered", ["frontend"], registry=metrics.registry).labels(str(index))
    Gauge("sixfold_frontend_pending_requests", "Inference requests each front end has at the engine now",
          ["frontend"], registry=metrics.registry).labels(str(index)).set_function(pending)
    return metrics, answered


async def _follow_engine(core: EngineMirror, stub: Any) -> None:
    """Keep ``core.engine_ready`` in step with the engine's readiness."""
    while True:
        try:
            core.engine_ready = (await stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5.0)).ready
        except grpc.aio.AioRpcError:
            core.engine_ready = False
        await asyncio.sleep(_READY_POLL_S)


async def serve(spec: FrontEndSpec) -> int:
    """Serve until SIGTERM/SIGINT (a second one ends the drain grace); the exit code."""
    folder = Path(spec.folder)
    engine = EngineClient(folder, spec.index, spec.arena_bytes, spec.arena_bytes)
    channel = grpc.aio.insecure_channel(f"unix:{folder / ENGINE_GRPC_SOCKET}",
                                        options=[("grpc.max_send_message_length", spec.max_message_bytes),
                                                 ("grpc.max_receive_message_length", spec.max_message_bytes)])
    routes = None
    try:
        await engine.connect()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        core = EngineMirror()
        metrics, answered = front_end_metrics(spec.index, engine.pending)
        config = ServerConfig(host=spec.host, grpc_port=spec.grpc_port, http_port=spec.http_port,
                              metrics_port=0 if spec.metrics else None, max_message_bytes=spec.max_message_bytes,
                              tls_cert=spec.tls_cert, tls_key=spec.tls_key,
                              metrics_token=os.environ.get("SIXFOLD_METRICS_TOKEN") or None,
                              drain_seconds=spec.drain_seconds, warmup=False, shared_memory=False,
                              workers=WorkerSet(folder, spec.index, spec.count), limits=TransportLimits(**spec.limits))
        app = None
        if spec.http_port is not None and spec.engine_http:
            routes = _FrontEndRoutes(core, engine, spec.engine_http, tls=bool(spec.tls_cert),
                                     max_body_bytes=spec.max_message_bytes, metrics=metrics, answered=answered)
            app = front_end_app(routes)
        follower = asyncio.ensure_future(_follow_engine(core, stub))
        server = SixfoldServer(core, config, metrics, servicer=FrontEndServicer(core, engine, stub, metrics, answered),
                               rest_app=app)
        port = await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():
                server.end_drain()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        print(worker_ports_line(port, server.http_port, server.metrics_port), flush=True)
        print(f"{READY_PREFIX}{spec.host}:{port}", flush=True)
        await stop.wait()
        await server.stop()
        follower.cancel()
        return 0
    finally:
        if routes is not None:
            await routes.close()
        await channel.close()
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    follow_supervisor()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = FrontEndSpec.from_json(argv[0])
    try:
        import uvloop
        return uvloop.run(serve(spec))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(serve(spec))


if __name__ == "__main__":
    sys.exit(main())
