"""REST's limits before a request reaches a route: connections, header and body time, body bytes.

uvicorn closes idle keep-alive connections but never one that is sending a request slowly (each
byte re-arms nothing), nor one that sends nothing at all, and it reads a body for whoever asks.
``guarded_protocol`` caps connections per port and gives headers a deadline; ``BodyGuard`` holds a
body's bytes in the server's ReceiveBudget before reading it (429 at once when there is no room)
and gives the body a deadline (408). uvicorn reads a body only as the app asks for it (it pauses
the socket past 64 KiB), so a refused body is never buffered.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sixfold.server.errors import ServingError
from sixfold.server.transport.deadline import within
from sixfold.server.transport.receive_budget import ReceiveBudget

__all__ = ["BodyTimeout", "BodyGuard", "guarded_protocol"]

_FULL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
         b"connection: close\r\nretry-after: 1\r\ncontent-length: 58\r\n\r\n"
         b"too many open connections to this port (--max-connections)")


class BodyTimeout(ServingError):
    """A request body that did not arrive within --body-timeout-s (HTTP 408)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "body_timeout"


class _GuardedH11(H11Protocol):
    max_connections = 0
    header_timeout_s = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._in_headers = False
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            transport.write(_FULL)
            transport.close()
            return
        # NOTE: a connection that has sent nothing yet is as idle as a keep-alive one between requests
        self._arm(self.timeout_keep_alive)

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(seconds, self._expired) if seconds else None

    def _expired(self) -> None:
        self._timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._in_headers and self.conn.their_state is h11.IDLE:
            self._in_headers = True  # a request's first bytes: its headers have header_timeout_s from here
            self._arm(self.header_timeout_s)
        super().data_received(data)
        if self._in_headers and self.conn.their_state is not h11.IDLE:
            self._in_headers = False
            self._arm(0)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection past ``max_connections`` on its port at once
    (503, ``connection: close``), one idle for the keep-alive time before its first request, and one
    whose request headers take longer than ``header_timeout_s`` from their first byte (0: no limit)."""
    return type("GuardedH11Protocol", (_GuardedH11,),
                {"max_connections": max_connections, "header_timeout_s": header_timeout_s})


class BodyGuard:
    """ASGI middleware: a body is admitted by bytes before it is read, and read within a deadline."""

    _READS_BODY = frozenset({"POST", "PUT", "PATCH"})

    def __init__(self, app: Any, budget: ReceiveBudget, max_body_bytes: int, body_timeout_s: float,
                 metrics: Any = None) -> None:
        self.app, self.budget, self.max_body_bytes = app, budget, max_body_bytes
        self.body_timeout_s, self.metrics = body_timeout_s, metrics

    def _declared(self, scope: dict) -> int:
        """Bytes to hold: Content-Length, or the limit for a body of unknown length; 0 for one the app
        refuses unread (413)."""
        for name, value in scope["headers"]:
            if name == b"content-length":
                size = int(value) if value.isdigit() else 0
                return size if size <= self.max_body_bytes else 0
        return self.max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in self._READS_BODY:
            await self.app(scope, receive, send)
            return
        nbytes = self._declared(scope)
        if not self.budget.try_hold(nbytes):
            if self.metrics is not None:
                self.metrics.record_refused("rest", "receive_budget")
            await _refuse(send, 429, f"the server holds {self.budget.held >> 20} MiB of requests in flight, its "
                                     f"limit is {self.budget.limit >> 20} MiB (--max-queue-bytes-mb); retry later")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s if self.body_timeout_s else None
        timed_out = []

        async def timed_receive() -> dict:
            if deadline is None:
                return await receive()
            try:
                return await within(receive(), max(1e-3, deadline - loop.time()))
            except TimeoutError:
                timed_out.append(True)
                raise BodyTimeout(f"the request body did not arrive within {self.body_timeout_s:g} s "
                                  "(--body-timeout-s)") from None

        async def closing_send(message: dict) -> None:
            if timed_out and message["type"] == "http.response.start":  # the rest of the body is not read
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, timed_receive, closing_send)
        finally:
            self.budget.release(nbytes)


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
