"""A small fake KServe v2 server for loadgen tests: known latency, scripted stalls, checked inputs.

It runs a grpc.aio server (with the stubs tritonclient ships) on its own event
loop in a daemon thread, so both async tests and the blocking CLI can drive it.
Every ModelInfer request is decoded and validated against the canonical
signature; an invalid one gets INVALID_ARGUMENT, so a loadgen bug shows up as
errors in the report.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

__all__ = ["FakeModel", "Stall", "FakeServer"]


@dataclass(frozen=True)
class Stall:
    """Requests arriving ``start_s``..``end_s`` after the first ModelInfer wait ``extra_s`` more."""

    start_s: float
    end_s: float
    extra_s: float


@dataclass
class FakeModel:
    name: str = "fake-rm"
    dense_dim: int = 4
    table_rows: tuple[int, ...] = (100, 200, 300)
    pooling: tuple[int, ...] = (2, 3, 1)
    sixfold_params: bool = True
    """Publish sixfold.table_rows/pooling/zipf in ModelConfig (False: like a Triton server)."""
    latency_s: float = 0.005
    keep_ids: bool = False
    serial: bool = False
    """Serve one request at a time (a single server queue): saturates at 1 / latency_s requests/s."""
    stall: Stall | None = None
    ready: bool = True


@dataclass
class _Seen:
    sizes: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    ids: list[np.ndarray] = field(default_factory=list)
    """sparse_indices of each request (only when FakeModel.keep_ids)."""


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, model: FakeModel, seen: _Seen) -> None:
        self.model, self.seen = model, seen
        self.first: float | None = None
        self._lock: asyncio.Lock | None = None

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == self.model.name and self.model.ready)

    async def ModelMetadata(self, request, context):
        if request.name != self.model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{request.name}' is not found")
        m = self.model
        T = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=m.name, versions=["1"], platform="fake",
            inputs=[T(name="dense_features", datatype="FP32", shape=[-1, m.dense_dim]),
                    T(name="sparse_lengths", datatype="INT32", shape=[-1, len(m.table_rows)]),
                    T(name="sparse_indices", datatype="INT64", shape=[-1])],
            outputs=[T(name="scores", datatype="FP32", shape=[-1, 1])])

    async def ModelConfig(self, request, context):
        if request.name != self.model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{request.name}'")
        m = self.model
        config = model_config_pb2.ModelConfig(name=m.name, platform="fake")
        if m.sixfold_params:
            config.parameters["sixfold.table_rows"].string_value = ",".join(map(str, m.table_rows))
            config.parameters["sixfold.pooling"].string_value = ",".join(map(str, m.pooling))
            config.parameters["sixfold.zipf"].string_value = "1.1"
        return service_pb2.ModelConfigResponse(config=config)

    def _validate(self, request) -> int:
        m = self.model
        by_name = {t.name: (t, raw) for t, raw in zip(request.inputs, request.raw_input_contents)}
        if set(by_name) != {"dense_features", "sparse_lengths", "sparse_indices"}:
            raise ValueError(f"inputs {sorted(by_name)}")
        t, raw = by_name["dense_features"]
        dense = np.frombuffer(raw, dtype=np.float32)
        n = int(t.shape[0])
        if t.datatype != "FP32" or list(t.shape) != [n, m.dense_dim] or dense.size != n * m.dense_dim:
            raise ValueError(f"dense_features {t.datatype} {list(t.shape)}")
        t, raw = by_name["sparse_lengths"]
        lengths = np.frombuffer(raw, dtype=np.int32).reshape(n, len(m.table_rows))
        if t.datatype != "INT32" or list(t.shape) != [n, len(m.table_rows)]:
            raise ValueError(f"sparse_lengths {t.datatype} {list(t.shape)}")
        t, raw = by_name["sparse_indices"]
        ids = np.frombuffer(raw, dtype=np.int64)
        if t.datatype != "INT64" or list(t.shape) != [ids.size] or ids.size != int(lengths.sum()):
            raise ValueError(f"sparse_indices {t.datatype} {list(t.shape)} for {int(lengths.sum())} ids")
        table = np.repeat(np.tile(np.arange(len(m.table_rows)), n), lengths.reshape(-1))
        if ids.size and (ids.min() < 0 or np.any(ids >= np.asarray(m.table_rows)[table])):
            raise ValueError("id out of its table's range")
        return n

    async def ModelInfer(self, request, context):
        now = time.monotonic()
        if self.first is None:
            self.first = now
        if request.model_name != self.model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{request.model_name}'")
        try:
            n = self._validate(request)
        except ValueError as exc:
            self.seen.invalid.append(str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.seen.sizes.append(n)
        self.seen.arrivals.append(now)
        if self.model.keep_ids:
            raw = {t.name: r for t, r in zip(request.inputs, request.raw_input_contents)}["sparse_indices"]
            self.seen.ids.append(np.frombuffer(raw, dtype=np.int64).copy())
        self.seen.in_flight += 1
        self.seen.max_in_flight = max(self.seen.max_in_flight, self.seen.in_flight)
        try:
            return await self._serve(n, now, request.id)
        finally:
            self.seen.in_flight -= 1

    async def _serve(self, n: int, now: float, request_id: str):
        delay = self.model.latency_s
        stall = self.model.stall
        if stall is not None and stall.start_s <= now - self.first < stall.end_s:
            delay += stall.extra_s
        if self.model.serial:
            if self._lock is None:
                self._lock = asyncio.Lock()  # NOTE: created on the server's own loop
            async with self._lock:
                await asyncio.sleep(delay)
        else:
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - now)))
        response = service_pb2.ModelInferResponse(model_name=self.model.name, model_version="1", id=request_id)
        response.outputs.add(name="scores", datatype="FP32", shape=[n, 1])
        response.raw_output_contents.append(np.full((n, 1), 0.5, dtype=np.float32).tobytes())
        return response


class FakeServer:
    """``with FakeServer(FakeModel(...)) as s: ... s.url``; stopped on exit."""

    def __init__(self, model: FakeModel | None = None, *, port: int = 0) -> None:
        self.model = model or FakeModel()
        self.seen = _Seen()
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-kserve", daemon=True)
        self._server: grpc.aio.Server | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 30),
                                                ("grpc.max_send_message_length", 1 << 30)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self.model, self.seen), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()

    def start(self) -> "FakeServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "FakeServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
