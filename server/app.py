"""The server process: KServe v2 over gRPC (+ grpc.health.v1) and REST, metrics, graceful shutdown.

Both front ends run on one event loop over one InferenceCore; REST is optional
(``ServerConfig.http_port``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from starlette.applications import Starlette
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sixfold.server.memory.allocator import keep_freed_memory
from sixfold.server.core import InferenceCore
from sixfold.server.memory.gc_pause import freeze_loaded_objects
from sixfold.server.transport.http_app import build_app
from sixfold.server.transport.http_server import RestServer
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.execution.runtime import single_threaded_ops_here
from sixfold.server.transport.grpc_servicer import InferenceServicer
from sixfold.server.scheduling.unread_admission import refusal_for_unread
from sixfold.server.transport.grpc_receive import bounded_model_infer, sized_model_infer
from sixfold.server.transport.limits import TransportLimits, grpc_options
from sixfold.server.transport.receive_budget import ReceiveBudget
from sixfold.server.workers.engine_channel import ENGINE_GRPC_SOCKET, EngineChannel
from sixfold.server.workers.worker_set import WorkerSet
from sixfold.server.model.warmup import warm_up

__all__ = ["ServerConfig", "SixfoldServer", "BackgroundServer", "PortError", "check_ports", "port_problem"]

log = logging.getLogger(__name__)
_SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True)
class ServerConfig:
    """Network settings; defaults follow Triton (gRPC 8001, metrics 8002) but bind loopback."""

    host: str = "127.0.0.1"
    grpc_port: int = 8001
    """0 picks a free port (``SixfoldServer.port`` tells which)."""
    http_port: int | None = None
    """KServe v2 REST port (Triton's is 8000; sixfold-serve's default); None: no REST endpoint
    (the library default, so servers in one process never collide); 0: a free port
    (``SixfoldServer.http_port`` tells which)."""
    metrics_port: int | None = 8002
    """None disables the metrics endpoint."""
    max_message_bytes: int = 64 << 20
    """Largest request or response. 64 MiB holds the largest sensible query with room to spare: a
    1000-item rm2 query is ~30 MB of ids (docs/admission.md); larger messages are refused by gRPC
    before they are buffered whole."""
    grace_seconds: float = 10.0
    """On shutdown, how long in-flight RPCs may take to finish before they are cancelled."""
    tls_cert: str | None = None
    """PEM certificate chain; with ``tls_key``, gRPC is served over TLS only."""
    tls_key: str | None = None
    control_token: str | None = None
    """When set, model-control RPCs need ``authorization: Bearer <token>``."""
    metrics_token: str | None = None
    """When set, a /metrics scrape needs ``Authorization: Bearer <token>``. With TLS on, /metrics
    is served over HTTPS with the same certificate either way."""
    drain_seconds: float = 0.0
    """On shutdown, first report not ready (grpc.health NOT_SERVING, REST ready 400) and keep
    serving for this long, so load balancers stop sending before anything is refused; then drain.
    sixfold-serve's default is 5 s; the library's is 0 (tests and notebooks stop at once)."""
    warmup: bool = True
    """Run a few synthetic batches through every model before serving it (``sixfold.server.model.warmup``)."""
    shared_memory: bool = True
    """Accept Triton's system shared memory extension: co-located clients register /dev/shm
    segments and send tensors by region (``sixfold.server.protocol.shared_memory``); False refuses it."""
    workers: WorkerSet | None = None
    """Set in each front end of ``sixfold-serve --workers N`` (``sixfold.server.frontend``): the ports are
    shared with the other front ends (SO_REUSEPORT). None: this process alone binds the port, and a busy port is
    an error."""
    engine_folder: str | None = None
    """Set in the engine of ``sixfold-serve --workers N``: serve the front ends' channel
    (``sixfold.server.workers.engine_channel``) and this gRPC service on Unix sockets in this run folder."""
    quiet_seconds: float = 0.3
    """On shutdown, keep answering UNAVAILABLE until no request has arrived for this long
    (bounded by the grace), so a request caught mid-upload is refused, not cancelled."""
    limits: TransportLimits = TransportLimits()
    """Bytes, connections and timeouts a client may hold before admission (``sixfold.server.transport.limits``)."""
    readiness_interval_s: float = 0.25
    """How often grpc.health.v1 is brought in step with readiness (cards leave and rejoin rotation
    without any RPC); ServerReady, ModelReady and REST's ready routes read it on each call."""

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must be in 0..65535, got {self.grpc_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535 or None, got {self.http_port}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if not self.readiness_interval_s > 0:
            raise ValueError(f"readiness_interval_s must be > 0, got {self.readiness_interval_s}")


class PortError(OSError):
    """A port or address that cannot be served on; the message names it, why, and what to do."""


def _addresses(host: str, port: int) -> list[tuple]:
    try:
        return socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortError(f"cannot resolve {host!r} ({exc.strerror or exc}); give an IP address of this machine "
                        "(127.0.0.1, or 0.0.0.0 for all) or a name that resolves to one") from None


def port_problem(host: str, port: int) -> str:
    """Why a server of its own could not bind ``host:port``, and what to do ("" if it could; port 0 checks
    the address).

    A plain bind (SO_REUSEADDR, as servers set it, so a port in TIME_WAIT is free): it fails on a port
    another server listens on even where the servers themselves would share it (gRPC's SO_REUSEPORT).
    PortError when ``host`` does not resolve.
    """
    problems = []
    for family, kind, proto, _, address in _addresses(host, port):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
            return ""  # as gRPC does, one address of a name that resolves to several is enough
        except OSError as exc:
            problems.append(exc)
    for exc in problems:  # "in use" first: it is the one with a fix on this side
        if exc.errno == errno.EADDRINUSE:
            return f"it is in use ({exc.strerror}); stop what listens there, or pick another port (0: a free one)"
    exc = problems[0]
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this machine ({exc.strerror}); give one it has "
                "(127.0.0.1, or 0.0.0.0 for all)")
    if exc.errno == errno.EACCES:
        return f"binding it needs privileges ({exc.strerror}); pick a port above 1023"
    return exc.strerror or str(exc)


def check_ports(host: str, ports: Mapping[str, int | None], *, host_label: str = "host") -> None:
    """Before anything slow starts: ``host`` is an address of this machine, every port of ``ports`` (what it
    is for -> port; None: off, 0: a free one) can be bound on it, and no two share a number. PortError naming
    it (``host_label`` for the address), why, and the fix; else None."""
    for label, port in ports.items():
        if port is not None and not 0 <= port <= 65535:
            raise PortError(f"{label}: {port} is not a port (give 0..65535; 0: a free one)")
    given = [(label, port) for label, port in ports.items() if port]
    for i, (label, port) in enumerate(given):
        for other, number in given[i + 1:]:
            if number == port:
                raise PortError(f"{label} and {other} are both {port}: give each its own port")
    try:
        problem = port_problem(host, 0)
    except PortError as exc:
        raise PortError(f"{host_label}: {exc}") from None
    if problem:
        raise PortError(f"{host_label}: {problem}")
    for label, port in ports.items():
        if port:
            problem = port_problem(host, port)
            if problem:
                raise PortError(f"could not bind {host}:{port} for {label}: {problem}")


class SixfoldServer:
    def __init__(self, core: InferenceCore, config: ServerConfig, metrics: ServerMetrics, *,
                 servicer: InferenceServicer | None = None, rest_app: Starlette | None = None) -> None:
        """``servicer`` / ``rest_app``: served instead of the core's own (a ``--workers`` front end's, which ask
        the engine)."""
        self.core, self.config, self.metrics = core, config, metrics
        self._servicer, self._rest_app = servicer, rest_app
        self._engine_channel: EngineChannel | None = None
        if not config.shared_memory:
            core.shared_memory = None
        self.port: int | None = None
        self.http_port: int | None = None
        """The bound REST port, once started with ``config.http_port`` set."""
        self._server: grpc.aio.Server | None = None
        self._rest: RestServer | None = None
        self._health = HealthServicer()
        self.metrics_port: int | None = None
        """The bound /metrics port, once started with ``config.metrics_port`` set."""
        self._drain_over: asyncio.Event | None = None
        self.receive_budget = ReceiveBudget(config.limits.receive_bytes, config.max_message_bytes)
        """Request bytes in flight over both transports, checked before a body is read."""
        budget = self.receive_budget
        budget.unread_refusal = lambda timeout_s: refusal_for_unread(core.all_versions(), timeout_s, budget.reading)
        self._readiness: asyncio.Task | None = None
        self._serving: bool | None = None
        """What grpc.health.v1 says now (None: not set yet)."""

    async def start(self) -> int:
        if self._servicer is None:  # NOTE: a --workers front end runs no ops: it would only pay torch's ~180 MiB
            single_threaded_ops_here()  # the event loop runs small batches inline (sixfold.server.execution.runtime.StageRunner)
            keep_freed_memory()  # stage workers reuse their batch buffers (sixfold-serve sets it before any thread)
        workers = self.config.workers
        # NOTE: gRPC sets SO_REUSEPORT by default, so a second server on a busy port would bind it silently
        # and take half its connections; only the workers of one server share a port.
        options = [("grpc.max_send_message_length", self.config.max_message_bytes),
                   ("grpc.max_receive_message_length", self.config.max_message_bytes),
                   ("grpc.so_reuseport", int(workers is not None))] + grpc_options(self.config.limits)
        if self.config.warmup:  # before the port opens: the first requests find the models warm
            for model in self.core.all_versions():
                if not model.warmed_up:
                    await warm_up(model)
        server = self._server = grpc.aio.server(options=options)
        servicer = self._servicer or InferenceServicer(self.core, control_token=self.config.control_token,
                                                       metrics=self.metrics)
        if servicer.receive_budget is None:  # NOTE: ModelStreamInfer's requests hold the unary calls' budget too
            servicer.receive_budget = self.receive_budget
        # NOTE: ModelInfer's own handler first (grpc asks handlers in order): its deserializer keeps the raw
        # tensors as views of the message instead of copying them twice (sixfold.server.protocol.infer_request)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {
            "ModelInfer": grpc.stream_unary_rpc_method_handler(
                bounded_model_infer(servicer, self.receive_budget, self.config.limits.body_timeout_s, self.metrics),
                request_deserializer=sized_model_infer,
                response_serializer=service_pb2.ModelInferResponse.SerializeToString)}),))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{self.config.host}:{self.config.grpc_port}"
        try:
            if self.config.tls_cert and self.config.tls_key:
                with open(self.config.tls_key, "rb") as key, open(self.config.tls_cert, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises on a busy port (older versions returned 0)
            self.port = 0
        if self.port == 0:
            problem = port_problem(self.config.host, self.config.grpc_port)
            if not problem and self.config.tls_cert:
                problem = f"gRPC refused the TLS certificate or key ({self.config.tls_cert}, {self.config.tls_key})"
            raise PortError(f"could not bind {self.config.host}:{self.config.grpc_port} for gRPC: "
                            f"{problem or 'is another server on it?'}")
        if self.config.engine_folder is not None:  # the front ends forward every RPC but inference here
            address = f"unix:{self.config.engine_folder}/{ENGINE_GRPC_SOCKET}"
            try:
                server.add_insecure_port(address)
            except RuntimeError:
                raise OSError(f"could not bind {address}") from None
        await server.start()
        if self.config.engine_folder is not None:
            self._engine_channel = EngineChannel(self.core, Path(self.config.engine_folder))
            await self._engine_channel.start()
        if self.config.http_port is not None:
            app = self._rest_app or build_app(self.core, max_body_bytes=self.config.max_message_bytes,
                                              control_token=self.config.control_token, metrics=self.metrics)
            self._rest = RestServer(app, self.config.host, self.config.http_port, tls_cert=self.config.tls_cert,
                                    tls_key=self.config.tls_key, grace_seconds=self.config.grace_seconds,
                                    reuse_port=workers is not None, limits=self.config.limits,
                                    budget=self.receive_budget, metrics=self.metrics)
            try:
                self.http_port = await self._rest.start()
            except BaseException:
                await server.stop(None)
                raise
        await self._follow_readiness()
        self._readiness = asyncio.ensure_future(self._watch_readiness())
        if self.config.metrics_port is not None:
            # NOTE: a worker's page is for its supervisor, which serves all the workers' (sixfold.server.workers.worker_metrics)
            host = "127.0.0.1" if workers is not None else self.config.host
            try:
                self.metrics_port = self.metrics.serve(host, self.config.metrics_port,
                                                       tls_cert=self.config.tls_cert, tls_key=self.config.tls_key,
                                                       token=self.config.metrics_token,
                                                       limits=self.config.limits)
            except OSError as exc:  # e.g. taken since it was checked: close what is open, say which port
                if self._rest is not None:
                    await self._rest.stop()
                await server.stop(None)
                raise PortError(f"could not bind {host}:{self.config.metrics_port} for metrics: "
                                f"{port_problem(host, self.config.metrics_port) or exc.strerror or exc}") from None
        freeze_loaded_objects()  # full collections would otherwise walk every loaded module (sixfold.server.memory.gc_pause)
        return self.port

    async def _follow_readiness(self) -> None:
        """grpc.health.v1 ("" and the inference service) SERVING exactly while the server is ready."""
        self.core.readiness_changes()  # logs each version that went not ready or came back
        ready = self.core.ready
        if ready != self._serving:
            self._serving = ready
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", _SERVICE):
                await self._health.set(name, status)

    async def _watch_readiness(self) -> None:
        while True:
            await asyncio.sleep(self.config.readiness_interval_s)
            try:
                await self._follow_readiness()
            except Exception:  # noqa: BLE001 - the watch goes on; the next round tries again
                log.exception("readiness check failed")

    async def stop(self) -> None:
        """Report not ready and keep serving for ``drain_seconds``; then refuse new requests
        (UNAVAILABLE), answer queued and running ones, and close."""
        if self._readiness is not None:  # from here the drain and shutdown set the health status
            self._readiness.cancel()
            self._readiness = None
        if self.config.drain_seconds > 0 and self.core.accepting:
            self.core.draining = True
            for name in ("", _SERVICE):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            log.info("draining: not ready, still serving for %.1fs", self.config.drain_seconds)
            self._drain_over = asyncio.Event()
            try:
                await asyncio.wait_for(self._drain_over.wait(), self.config.drain_seconds)
            except asyncio.TimeoutError:
                pass
        await self._health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self.core.shutdown(), self.config.grace_seconds)
        except asyncio.TimeoutError:
            log.warning("requests still running after %.1fs grace; cancelling", self.config.grace_seconds)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace_seconds
        while loop.time() < deadline and (
                self.core.active_rpcs or time.monotonic() - self.core.last_rpc_at < self.config.quiet_seconds):
            await asyncio.sleep(0.02)
        if self._rest is not None:
            await self._rest.stop()
        if self._server is not None:
            await self._server.stop(self.config.grace_seconds)
        if self._engine_channel is not None:
            await self._engine_channel.close()
        if self.metrics_port is not None:
            self.metrics.close()
            self.metrics_port = None

    def end_drain(self) -> None:
        """End the drain grace now (sixfold-serve: a second SIGTERM or Ctrl-C); call on the server's loop."""
        if self._drain_over is not None:
            self._drain_over.set()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


class BackgroundServer:
    """A SixfoldServer on its own event loop in a daemon thread (tests, benchmarks, notebooks)."""

    def __init__(self, core: InferenceCore, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.server = SixfoldServer(core, config, metrics)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sixfold-server", daemon=True)

    @property
    def url(self) -> str:
        return f"{self.server.config.host}:{self.server.port}"

    @property
    def http_url(self) -> str:
        """``HOST:PORT`` of the REST endpoint, as tritonclient.http takes it ("" when REST is off)."""
        return "" if self.server.http_port is None else f"{self.server.config.host}:{self.server.http_port}"

    def start(self) -> "BackgroundServer":
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)
        except BaseException:  # e.g. a busy port: no thread left behind
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            raise
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def end_drain(self) -> None:
        """End a running ``stop()``'s drain grace now (from any thread)."""
        self._loop.call_soon_threadsafe(self.server.end_drain)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
