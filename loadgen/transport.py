"""How one pre-generated query goes over the wire, and what counts as a failure.

Three clients over KServe v2 gRPC (``protocol="grpc"``, the default; REST is ``sixfold.loadgen.rest``; ``sixfold.loadgen.connect`` picks one):

- ``raw`` (default): each pooled query is encoded once into a serialized
  ``ModelInferRequest`` before the clock starts; a send is one gRPC call on an
  already-open channel with no per-request encoding. A large recommendation
  query (rm2, 270 items: ~8.6 MB of ids) costs ~5 ms of CPU to encode, so
  encoding per send would make the generator itself the bottleneck.
- ``tritonclient``: every send goes through
  ``tritonclient.grpc.aio.InferenceServerClient.infer`` with pre-built
  ``InferInput`` objects, exactly as a user of the stock client would.
- ``shm`` (a server on the same host): each pooled query's tensors are written
  once into a POSIX shared memory segment registered with the server (Triton's
  system shared memory extension); a send is a small pre-serialized request
  that names the region, so the ids never cross the socket.

``ids_dtype="int32"`` (``--ids-dtype int32``) sends ``sparse_indices`` as INT32: half the bytes of
the signature's INT64, for a server that takes them (sixfold does for table-batched models).

``ssl=True`` (``--ssl``): the channels are TLS, trusting ``root_certificates`` (a PEM file;
default the system's roots), for every client and for readiness and discovery.

Either way a failed request raises ``RequestFailed`` with a short reason
(the gRPC status name, lower case, or ``bad_output``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Mapping
from multiprocessing import shared_memory
from typing import Any, Protocol

import grpc
import numpy as np
import tritonclient.grpc.aio as tritonaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sixfold.models.signature import INDICES, SCORES

from sixfold.loadgen.errors import LoadgenError

__all__ = ["Transport", "RequestFailed", "RawGrpcTransport", "TritonClientTransport", "SharedMemoryTransport",
           "wire_tensors", "DATATYPES", "CHANNEL_OPTIONS", "connection_options",
           "read_root_certificates"]

DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
    # NOTE: gRPC backs off up to 120 s between reconnects by default; while waiting for a
    # server that is still starting we want to notice it within a second.
    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class RequestFailed(Exception):
    """One request got an error answer; ``reason`` is the label in ``errors_by_reason``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class Transport(Protocol):
    """Encodes queries once (before the run) and sends them (during it)."""

    def prepare(self, request: Mapping[str, np.ndarray]) -> Any:
        """Encode one query; the result is what ``infer`` gets."""
        ...

    async def connect(self, timeout_s: float) -> None:
        """Open the connection before the clock starts, so the first request does not pay for it."""
        ...

    async def infer(self, payload: Any, items: int) -> bytes:
        """Send one query and check the answer; return the scores' bytes (FP32, little-endian).

        Raise ``RequestFailed`` on any error."""
        ...

    async def close(self) -> None: ...


def wire_tensors(request: Mapping[str, np.ndarray], ids_dtype: str) -> Mapping[str, np.ndarray]:
    """The request as sent: ``sparse_indices`` narrowed to int32 when ``ids_dtype`` says so.

    Runs in ``prepare``, before the clock starts; an id that does not fit int32 is refused.
    """
    ids = request.get(INDICES)
    if ids_dtype != "int32" or ids is None or ids.dtype == np.int32:
        return request
    if ids.size and (int(ids.max()) > np.iinfo(np.int32).max or int(ids.min()) < np.iinfo(np.int32).min):
        raise LoadgenError(f"--ids-dtype int32: an id of '{INDICES}' does not fit int32 "
                           f"(range {int(ids.min())}..{int(ids.max())}); send int64 ids")
    return {name: (array.astype(np.int32) if name == INDICES else array) for name, array in request.items()}


def read_root_certificates(path: str | None) -> bytes | None:
    """The PEM bytes of ``--root-certificates`` (None: trust the system's roots)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise LoadgenError(f"--root-certificates {path!r}: {exc.strerror or exc}") from None


def connection_options(config: Any) -> dict[str, Any]:
    """``protocol``, ``ssl`` and ``root_certificates`` of a LoadConfig, as make_client/make_transport take them."""
    return {"protocol": config.protocol, "ssl": config.ssl, "root_certificates": config.root_certificates}


def _grpc_channel(url: str, options: list[tuple[str, Any]], ssl: bool, root_certificates: str | None,
                  aio: bool = True) -> Any:
    module = grpc.aio if aio else grpc
    if not ssl:
        return module.insecure_channel(url, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=read_root_certificates(root_certificates))
    return module.secure_channel(url, credentials, options=options)


def _check_scores(shape: list[int] | tuple[int, ...], name: str, items: int) -> None:
    # NOTE: [1, items, 1] is the same scores from a model that takes a leading batch dimension (LoadConfig.batch_dim)
    if name != SCORES or list(shape) not in ([items, 1], [1, items, 1]):
        raise RequestFailed("bad_output", f"expected {SCORES} [{items}, 1], got {name} {list(shape)}")


def _scores_bytes(response: Any) -> bytes:
    """The one output's values as raw FP32 bytes, whether sent raw or as typed contents."""
    if response.raw_output_contents:
        return bytes(response.raw_output_contents[0])
    return np.asarray(response.outputs[0].contents.fp32_contents, dtype="<f4").tobytes()


class RawGrpcTransport:
    """Pre-serialized ModelInferRequests on grpc.aio channels, round robin (see module docstring).

    ``channels`` > 1: each its own connection (a local subchannel pool, or gRPC would share one), so
    a server of several processes on one port (``sixfold-serve --workers``) sees them all.
    """

    def __init__(self, url: str, model: str, version: str = "", channels: int = 1, ids_dtype: str = "int64", *,
                 ssl: bool = False, root_certificates: str | None = None, deadline_s: float | None = None) -> None:
        self.url, self.model, self.version, self.ids_dtype, self.ssl = url, model, version, ids_dtype, ssl
        self.deadline_s = deadline_s
        options = CHANNEL_OPTIONS if channels == 1 else [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self._channels = [_grpc_channel(url, options, ssl, root_certificates) for _ in range(channels)]
        calls = [channel.unary_unary(_MODEL_INFER, request_serializer=None,  # payloads are already bytes
                                     response_deserializer=service_pb2.ModelInferResponse.FromString)
                 for channel in self._channels]
        turns = itertools.cycle(calls)
        self._call = calls[0] if channels == 1 else lambda payload, timeout=None: next(turns)(payload, timeout=timeout)

    def prepare(self, request: Mapping[str, np.ndarray]) -> bytes:
        message = service_pb2.ModelInferRequest(model_name=self.model, model_version=self.version)
        for name, array in wire_tensors(request, self.ids_dtype).items():
            message.inputs.add(name=name, datatype=DATATYPES[array.dtype], shape=list(array.shape))
            message.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        message.outputs.add(name=SCORES)
        return message.SerializeToString()

    async def connect(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in self._channels)), timeout_s)
        except asyncio.TimeoutError:
            hint = (" (TLS: does the server serve TLS, and do --root-certificates trust its certificate?)"
                    if self.ssl else "")
            raise LoadgenError(f"cannot open a gRPC channel to {self.url} within {timeout_s:g} s{hint}") from None

    async def infer(self, payload: bytes, items: int) -> bytes:
        try:
            response = await self._call(payload, timeout=self.deadline_s)
        except grpc.aio.AioRpcError as exc:
            raise RequestFailed(exc.code().name.lower(), exc.details() or "") from None
        if len(response.outputs) != 1:
            raise RequestFailed("bad_output", f"expected 1 output, got {len(response.outputs)}")
        _check_scores(response.outputs[0].shape, response.outputs[0].name, items)
        return _scores_bytes(response)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class SharedMemoryTransport(RawGrpcTransport):
    """Raw gRPC calls whose inputs live in shared memory segments the server maps (module docstring).

    One segment per pooled query, made and registered in ``prepare`` (before the clock starts),
    unregistered and unlinked in ``close``. The segments are the stdlib's, so the process's
    resource tracker unlinks them even if loadgen dies without closing.
    """

    def __init__(self, url: str, model: str, version: str = "", channels: int = 1, ids_dtype: str = "int64", *,
                 ssl: bool = False, root_certificates: str | None = None, deadline_s: float | None = None) -> None:
        super().__init__(url, model, version, channels, ids_dtype, ssl=ssl, root_certificates=root_certificates,
                         deadline_s=deadline_s)
        self._control = _grpc_channel(url, CHANNEL_OPTIONS, ssl, root_certificates, aio=False)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._control)
        self._segments: list[shared_memory.SharedMemory] = []
        self._tag = uuid.uuid4().hex[:8]

    def prepare(self, request: Mapping[str, np.ndarray]) -> bytes:
        arrays = {name: np.ascontiguousarray(array) for name, array in wire_tensors(request, self.ids_dtype).items()}
        name = f"sixfold-loadgen-{self._tag}-{len(self._segments)}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=max(1, sum(a.nbytes for a in arrays.values())))
        self._segments.append(segment)
        message = service_pb2.ModelInferRequest(model_name=self.model, model_version=self.version)
        offset = 0
        for input_name, array in arrays.items():
            np.ndarray(array.shape, array.dtype, segment.buf, offset)[...] = array
            tensor = message.inputs.add(name=input_name, datatype=DATATYPES[array.dtype], shape=list(array.shape))
            tensor.parameters["shared_memory_region"].string_param = name
            tensor.parameters["shared_memory_byte_size"].int64_param = array.nbytes
            tensor.parameters["shared_memory_offset"].int64_param = offset
            offset += array.nbytes
        try:
            self._stub.SystemSharedMemoryRegister(service_pb2.SystemSharedMemoryRegisterRequest(
                name=name, key=f"/{segment.name}", offset=0, byte_size=segment.size), timeout=30)
        except grpc.RpcError as exc:
            raise LoadgenError(f"the server at {self.url} refused shared memory segment /{segment.name} "
                               f"({exc.code().name}: {exc.details()}); --client shm needs a sixfold or Triton "
                               "server on this host with system shared memory on") from None
        message.outputs.add(name=SCORES)
        return message.SerializeToString()

    async def close(self) -> None:
        try:
            for segment in self._segments:
                with contextlib.suppress(grpc.RpcError):
                    self._stub.SystemSharedMemoryUnregister(
                        service_pb2.SystemSharedMemoryUnregisterRequest(name=segment.name), timeout=5)
        finally:
            for segment in self._segments:
                segment.close()
                segment.unlink()
            self._segments.clear()
            self._control.close()
            await super().close()


class TritonClientTransport:
    """Every request through the stock ``InferenceServerClient.infer`` (see module docstring)."""

    def __init__(self, client: tritonaio.InferenceServerClient, model: str, version: str = "",
                 ids_dtype: str = "int64", deadline_s: float | None = None) -> None:
        self.client, self.model, self.version, self.ids_dtype = client, model, version, ids_dtype
        self.deadline_s = deadline_s
        self._outputs = [tritonaio.InferRequestedOutput(SCORES)]

    def prepare(self, request: Mapping[str, np.ndarray]) -> list[tritonaio.InferInput]:
        inputs = []
        for name, array in wire_tensors(request, self.ids_dtype).items():
            item = tritonaio.InferInput(name, list(array.shape), DATATYPES[array.dtype])
            item.set_data_from_numpy(np.ascontiguousarray(array))
            inputs.append(item)
        return inputs

    async def connect(self, timeout_s: float) -> None:
        """The client's channel is already open: readiness and discovery went through it."""

    async def infer(self, payload: list[tritonaio.InferInput], items: int) -> bytes:
        try:
            result = await self.client.infer(self.model, payload, model_version=self.version,
                                             outputs=self._outputs, client_timeout=self.deadline_s)
        except InferenceServerException as exc:
            raise RequestFailed((exc.status() or "error").rsplit(".", 1)[-1].lower(), exc.message() or "") from None
        response = result.get_response()
        if len(response.outputs) != 1:
            raise RequestFailed("bad_output", f"expected 1 output, got {len(response.outputs)}")
        _check_scores(response.outputs[0].shape, response.outputs[0].name, items)
        return _scores_bytes(response)

    async def close(self) -> None:
        """The client belongs to the caller, who closes it."""
