"""What a client may make the server hold before admission sees its request: bytes, connections, time.

The batcher's admission (``--max-queue-bytes-mb``, ``--max-queue-work-ms``) judges a request once
it is received and decoded. Before that, a flood of large messages, or thousands of slow or idle
connections, would be buffered without bound: issue 33 measured 15 GB of RSS at 3x rm2's
sustainable rate of MLPerf-sized queries, and file descriptors exhausted by slow connections.
These limits act before a byte of a message is buffered; sixfold-serve sets them from its flags
(docs/serving.md, "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransportLimits", "grpc_options"]


@dataclass(frozen=True)
class TransportLimits:
    """Per-server limits of both front ends and the /metrics endpoint; defaults just work."""

    receive_bytes: int = 512 << 20
    """Request bytes being received or held by requests in flight, both transports together (sixfold-serve:
    --max-queue-bytes-mb); past it a new request is refused (RESOURCE_EXHAUSTED / 429) before its body is
    read. A gRPC message's size is unknown until read, so a read reserves the message limit while it runs.
    0: no bound."""
    max_connections: int = 1000
    """Open connections per port (gRPC, REST, /metrics); a connection past it is closed at once."""
    header_timeout_s: float = 10.0
    """REST and /metrics: a request's headers must arrive this soon after its first byte."""
    body_timeout_s: float = 30.0
    """REST: a body must arrive this soon after its headers (408); gRPC: a ModelInfer message this soon
    after its read starts (DEADLINE_EXCEEDED)."""
    handshake_timeout_s: float = 10.0
    """TLS handshakes (and gRPC's HTTP/2 handshake) must finish this soon after the connection opens."""
    idle_timeout_s: float = 300.0
    """gRPC: a connection with no RPC for this long is closed (GOAWAY); REST keeps its 75 s keep-alive."""
    max_connection_age_s: float = 3600.0
    """gRPC: a connection older than this is asked to reconnect (GOAWAY, in-flight RPCs get 30 s more),
    so a load balancer sees connections spread again; 0: never."""
    max_streams_per_connection: int = 1024
    """gRPC: RPCs at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS). Past it the client
    queues RPCs where the server cannot refuse them (an overload at 10x with 128 queued 60 s in the
    client), so it is well above what the receive budget admits; an unread stream holds 64 KiB."""

    def __post_init__(self) -> None:
        for name in ("receive_bytes", "max_connections", "max_streams_per_connection"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "handshake_timeout_s", "idle_timeout_s",
                     "max_connection_age_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def grpc_options(limits: TransportLimits) -> list[tuple[str, int]]:
    """grpc.aio server options for ``limits``.

    BDP probing is off: with it on, gRPC grows each stream's receive window and buffers messages
    before the handler asks for them (362 MiB for 40 unread 8 MiB messages, 38 MiB with it off;
    an 8 MiB call took 16 ms either way on loopback), so the receive budget could not act first.
    """
    options = [("grpc.http2.bdp_probe", 0),
               ("grpc.max_concurrent_streams", limits.max_streams_per_connection or 2**31 - 1),
               ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    if limits.max_connections:
        options.append(("grpc.max_allowed_incoming_connections", limits.max_connections))
    if limits.handshake_timeout_s:
        options.append(("grpc.server_handshake_timeout_ms", _ms(limits.handshake_timeout_s)))
    if limits.idle_timeout_s:
        options.append(("grpc.max_connection_idle_ms", _ms(limits.idle_timeout_s)))
    if limits.max_connection_age_s:
        options += [("grpc.max_connection_age_ms", _ms(limits.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", 30_000)]
    return options
