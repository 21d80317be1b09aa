"""Run the REST app with uvicorn on the running event loop (the one grpc.aio serves on).

The socket is bound here, so a busy port is an OSError naming it (uvicorn would
``sys.exit``), and uvicorn installs no signal handlers: the CLI owns SIGINT and
SIGTERM and stops both front ends in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from sixfold.server.transport.http_limits import BodyGuard, guarded_protocol
from sixfold.server.transport.limits import TransportLimits
from sixfold.server.transport.receive_budget import ReceiveBudget

__all__ = ["RestServer"]


KEEP_ALIVE_S = 75
"""Seconds an idle REST connection stays open: longer than common load balancers' idle timeout (60 s)."""


class _EmbeddedUvicorn(uvicorn.Server):
    handshake_timeout_s: float = 60.0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn would replace the process's SIGINT/SIGTERM handlers while it serves.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start on the sockets given, with a TLS handshake timeout (uvicorn leaves asyncio's 60 s)."""
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state, _loop=_loop)

        loop = asyncio.get_running_loop()
        tls = {"ssl_handshake_timeout": self.handshake_timeout_s or None} if config.ssl else {}
        self.servers = [await loop.create_server(create_protocol, sock=sock, ssl=config.ssl, backlog=config.backlog,
                                                 **tls) for sock in sockets or ()]
        self.started = True


class RestServer:
    """uvicorn serving an ASGI app on ``host:port`` (0: a free port), HTTPS when given cert and key;
    ``reuse_port``: the port is shared with sibling processes (``sixfold-serve --workers``)."""

    def __init__(self, app, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                 grace_seconds: float = 10.0, reuse_port: bool = False, limits: TransportLimits | None = None,
                 budget: ReceiveBudget | None = None, max_body_bytes: int = 64 << 20, metrics=None) -> None:
        self.host, self.requested_port, self.reuse_port = host, port, reuse_port
        self.port: int | None = None
        # NOTE: log_config=None leaves the process's logging alone; uvicorn's own logger only warns.
        # Keep-alive 75 s, not uvicorn's 5: a client (or a load balancer, ALB/nginx idle 60 s) that reuses
        # an idle connection just as the server closes it gets "server disconnected" on a POST it cannot
        # safely retry; tritonclient.http.aio hit it when building large JSON bodies took > 5 s.
        limits = limits or TransportLimits()
        budget = budget or ReceiveBudget(limits.receive_bytes, max_body_bytes)
        app = BodyGuard(app, budget, budget.max_message_bytes, limits.body_timeout_s, metrics)
        self.config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_config=None, log_level="warning",
                                     access_log=False, server_header=False, ssl_certfile=tls_cert,
                                     ssl_keyfile=tls_key, timeout_graceful_shutdown=max(1, int(grace_seconds)),
                                     timeout_keep_alive=KEEP_ALIVE_S,
                                     http=guarded_protocol(limits.max_connections, limits.header_timeout_s))
        self._server = _EmbeddedUvicorn(self.config)
        self._server.handshake_timeout_s = limits.handshake_timeout_s
        self._task: asyncio.Task | None = None

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            return socket.create_server((self.host, self.requested_port), family=family, reuse_port=self.reuse_port)
        except OSError as exc:
            raise OSError(f"REST: could not bind {self.host}:{self.requested_port}: {exc.strerror or exc}") from None

    async def start(self, timeout_s: float = 30.0) -> int:
        """Bind, start serving, and return the bound port once uvicorn accepts connections."""
        sock = self._bind()
        self.port = sock.getsockname()[1]
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what stopped it
                raise OSError(f"REST server on {self.host}:{self.port} stopped while starting")
            if loop.time() > deadline:
                raise TimeoutError(f"REST server on {self.host}:{self.port} did not start in {timeout_s:.0f}s")
            await asyncio.sleep(0.005)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the grace), close connections."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
