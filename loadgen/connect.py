"""The control-plane client and the transport a run uses, over gRPC (``transport``) or REST (``rest``).

Above both protocol modules, so neither imports the other.
"""

from __future__ import annotations

from typing import Any

import tritonclient.grpc.aio as tritonaio

from sixfold.loadgen.config import CLIENTS, IDS_DTYPES, PROTOCOLS
from sixfold.loadgen.rest import HttpControlClient, RawHttpTransport, TritonHttpTransport
from sixfold.loadgen.transport import (CHANNEL_OPTIONS, RawGrpcTransport, SharedMemoryTransport, TritonClientTransport,
                                       Transport, read_root_certificates)

__all__ = ["make_client", "make_transport"]


def make_client(url: str, *, protocol: str = "grpc", ssl: bool = False,
                root_certificates: str | None = None) -> Any:
    """The control-plane client (readiness, metadata, config), with quick reconnects: tritonclient's
    asyncio gRPC client, or for ``protocol="http"`` an adapter over its REST one with the same methods
    (``sixfold.loadgen.rest.HttpControlClient``)."""
    if protocol == "http":
        return HttpControlClient(url, ssl=ssl, root_certificates=root_certificates)
    if protocol != "grpc":
        raise ValueError(f"bad protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if ssl:
        read_root_certificates(root_certificates)  # NOTE: a missing file named as the flag, not as tritonclient's error
    return tritonaio.InferenceServerClient(url, ssl=ssl, root_certificates=root_certificates,
                                           channel_args=CHANNEL_OPTIONS)


def make_transport(kind: str, url: str, client: Any, model: str, version: str = "", channels: int = 1,
                   ids_dtype: str = "int64", *, protocol: str = "grpc", ssl: bool = False,
                   root_certificates: str | None = None, deadline_s: float | None = None) -> Transport:
    """The transport named by ``LoadConfig.client`` over ``protocol`` (``channels``, ``ids_dtype``, ``ssl``,
    ``root_certificates``, ``deadline_s``: see ``LoadConfig``); ``client`` is what ``make_client`` made."""
    if ids_dtype not in IDS_DTYPES:
        raise ValueError(f"bad ids_dtype {ids_dtype!r}: expected one of {', '.join(IDS_DTYPES)}")
    if kind not in CLIENTS:
        raise ValueError(f"bad client {kind!r}: expected one of {', '.join(CLIENTS)}")
    tls = {"ssl": ssl, "root_certificates": root_certificates}
    if protocol == "http":
        if deadline_s is not None:
            raise ValueError("a deadline per request (--deadline-ms) is sent as a gRPC deadline: use protocol grpc")
        if kind == "raw":
            return RawHttpTransport(url, model, version, ids_dtype, **tls)
        if kind == "tritonclient":
            return TritonHttpTransport(client, model, version, ids_dtype)
        raise ValueError("the shm client needs protocol grpc (sixfold's REST serves no shared memory)")
    if protocol != "grpc":
        raise ValueError(f"bad protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if kind == "raw":
        return RawGrpcTransport(url, model, version, channels, ids_dtype, **tls, deadline_s=deadline_s)
    if kind == "tritonclient":
        return TritonClientTransport(client, model, version, ids_dtype, deadline_s)
    return SharedMemoryTransport(url, model, version, channels, ids_dtype, **tls, deadline_s=deadline_s)
