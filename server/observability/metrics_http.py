"""GET /metrics on one thread for every connection: an asyncio loop of its own, with limits.

prometheus-client's and http.server's ThreadingHTTPServer start a thread per connection, so 1,000
slow clients made 293 threads (issue 33) and nothing ever closed them. Here one event loop in one
daemon thread serves every connection (the page itself is built on one more thread, so a slow
``exposition()`` does not stall the loop); a connection past ``max_connections`` is answered 503
and closed, request headers must arrive within ``header_timeout_s`` (from the connection's start
or the previous answer), and a TLS handshake within ``handshake_timeout_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import socket
import ssl
import threading
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["MetricsEndpoint"]

_HEAD_LIMIT = 16 << 10
"""Bytes of request line and headers at most (a scrape sends a few hundred)."""
_SEND_TIMEOUT_S = 30.0
_REASONS = {200: "OK", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 400: "Bad Request", 503: "Service Unavailable"}


class MetricsEndpoint:
    """GET /metrics over HTTP(S) answering ``source.exposition()`` (a server's ``ServerMetrics``, or the
    workers' pages together: ``sixfold.server.workers.worker_metrics``). Any other path is 404, any
    other method 405 (with ``Allow``), a missing or wrong bearer token (when one is set) 401."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._pages = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sixfold-metrics-page")

    def serve(self, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
              token: str | None = None, limits: Any = None) -> int:
        """Expose /metrics on ``host:port`` (0: a free port); returns the port.

        With ``tls_cert``/``tls_key`` it is served over HTTPS only (the same files as gRPC's TLS),
        and with ``token`` a scrape must send ``Authorization: Bearer <token>`` (Prometheus'
        ``authorization`` scrape setting). ``limits``: anything with ``max_connections``,
        ``header_timeout_s`` and ``handshake_timeout_s`` (``sixfold.server.transport.limits.TransportLimits``;
        None: 1000 connections, 10 s, 10 s).
        """
        self.token = token
        self.max_connections = getattr(limits, "max_connections", 1000)
        self.header_timeout_s = getattr(limits, "header_timeout_s", 10.0) or None
        handshake_s = getattr(limits, "handshake_timeout_s", 10.0) or None
        context = None
        if tls_cert and tls_key:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls_cert, tls_key)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)  # OSError here names a busy port at once
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="sixfold-metrics", daemon=True)
        self._thread.start()
        start = asyncio.start_server(self._connection, sock=sock, ssl=context, limit=_HEAD_LIMIT,
                                     **({"ssl_handshake_timeout": handshake_s} if context else {}))
        self._server = asyncio.run_coroutine_threadsafe(start, loop).result(timeout=10)
        return sock.getsockname()[1]

    def close(self) -> None:
        """Stop the /metrics endpoint, if it runs, and close its connections."""
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._thread = self._server = None
        self._pages.shutdown(wait=False)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self.max_connections > 0:
            await self._send(writer, 503, b"too many open connections to this port (--max-connections)\n",
                             close=True)
            writer.transport.abort()
            return
        self._open.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            pass
        finally:
            self._open.discard(writer)
            writer.transport.abort()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; True when the connection stays open for another."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout_s)
        except asyncio.TimeoutError:
            return False
        except asyncio.LimitOverrunError:
            await self._send(writer, 431, b"request headers over 16 KiB\n", close=True)
            return False
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await self._send(writer, 400, b"not an HTTP request\n", close=True)
            return False
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        close = version == "HTTP/1.0" or headers.get("connection", "").lower() == "close"
        body = method != "HEAD"
        if method not in ("GET", "HEAD"):  # a body, if any, is not read: the connection closes
            await self._send(writer, 405, b"method not allowed: use GET /metrics\n", close=True,
                             extra=("Allow: GET, HEAD",))
            return False
        if target.split("?", 1)[0] != "/metrics":
            await self._send(writer, 404, b"not found: metrics are served at /metrics\n", close=close, body=body)
        elif self.token is not None and not hmac.compare_digest(
                headers.get("authorization", "").encode(), f"Bearer {self.token}".encode()):
            await self._send(writer, 401, b"metrics need the header 'Authorization: Bearer <token>' (--metrics-token)\n",
                             close=close, body=body, extra=("WWW-Authenticate: Bearer",))
        else:
            page = await asyncio.get_running_loop().run_in_executor(self._pages, self.source.exposition)
            await self._send(writer, 200, page, close=close, body=body, content_type=CONTENT_TYPE_LATEST)
        return not close

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, text: bytes, *, close: bool, body: bool = True,
                    extra: tuple[str, ...] = (), content_type: str = "text/plain; charset=utf-8") -> None:
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", f"Content-Type: {content_type}",
                f"Content-Length: {len(text)}", *extra] + (["Connection: close"] if close else [])
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (text if body else b""))
        await asyncio.wait_for(writer.drain(), _SEND_TIMEOUT_S)  # a client that never reads is dropped
