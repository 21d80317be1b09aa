"""gRPC servicer for inference.GRPCInferenceService: protobuf <-> core types, nothing more.

Errors become gRPC status codes in one decorator (MLServer's grpc/utils.py
pattern); every other line converts or delegates.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from sixfold import __version__
from sixfold.server.deltas import delta_log as deltas
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.protocol.codec import (decode_inputs, encode_response, output_regions, request_priority, request_timeout,
                    requested_outputs)
from sixfold.server.core import InferenceCore
from sixfold.server.errors import InvalidInput, ServingError, clip
from sixfold.server.model.served import ServedModel
from sixfold.server.loading.model_config import to_model_config
from sixfold.server.loading.model_control import authorized_control, check_change_parameters
from sixfold.server.protocol.shared_memory import check_local_peer, enabled, grpc_peer_host
from sixfold.server.transport.receive_budget import ReceiveBudget

__all__ = ["InferenceServicer"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_MESSAGE_CHARS = 2048
"""Backstop: a status message past gRPC's metadata limit (8 KiB) reaches the client as
RESOURCE_EXHAUSTED instead of the error; client strings inside are clipped to 256 already."""


def _grpc_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        self.core.rpc_started()
        try:
            return await method(self, request, context)
        except ServingError as exc:
            await context.abort(exc.code, clip(exc.message, _MESSAGE_CHARS))
        except Exception as exc:  # noqa: BLE001 - last resort: the client still gets an answer
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, clip(f"{type(exc).__name__}: {exc}", _MESSAGE_CHARS))
        finally:
            self.core.rpc_finished()
        raise AssertionError("unreachable")  # abort always raises
    return wrapper


def _tensor_metadata(tensors: list) -> list[service_pb2.ModelMetadataResponse.TensorMetadata]:
    return [service_pb2.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)
            for t in tensors]


def _model_config(model: ServedModel) -> model_config_pb2.ModelConfig:
    """The model's real batching and queue settings, in Triton's ModelConfig."""
    return to_model_config(model.name, model.batcher.config, parameters=model.config_parameters(),
                           inputs=model.plan.inputs, outputs=model.plan.outputs)


def _duration(d: Any) -> service_pb2.StatisticDuration:
    return service_pb2.StatisticDuration(count=d.count, ns=d.ns)


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: InferenceCore, *, control_token: str | None = None,
                 metrics: ServerMetrics | None = None, receive_budget: ReceiveBudget | None = None) -> None:
        self.core = core
        self.receive_budget = receive_budget
        """The server's request-byte budget (``--max-queue-bytes-mb``), which ModelStreamInfer's requests hold
        while in flight (ModelInfer's are held by ``grpc_receive.bounded_model_infer``); None: no bound."""
        self.metrics = metrics
        """Counts requests refused before they reach a model (the model counts its own failures)."""
        self.control_token = control_token
        """When set, RepositoryModelLoad/Unload need ``authorization: Bearer <token>`` metadata."""

    def _control(self, context: grpc.aio.ServicerContext, *, changes: bool):
        """The ModelControl, after checking that model control is on and the caller may use it."""
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        return authorized_control(self.core, given, self.control_token, changes=changes)

    @_grpc_errors
    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    @_grpc_errors
    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.core.ready)

    @_grpc_errors
    async def ServerMetadata(self, request, context):
        extensions = ["model_configuration", "statistics"]
        if self.core.shared_memory is not None:
            extensions.append("system_shared_memory")
        if self.core.control is not None:
            extensions.append("model_repository")
        return service_pb2.ServerMetadataResponse(name="sixfold", version=__version__, extensions=extensions)

    @_grpc_errors
    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=self.core.model_ready(request.name, request.version))

    @_grpc_errors
    async def ModelMetadata(self, request, context):
        model = self.core.model(request.name, request.version)
        return service_pb2.ModelMetadataResponse(
            name=model.name, versions=sorted(self.core.versions.get(model.name, {model.version: model}),
                                             key=lambda v: (len(v), v)), platform="sixfold",
            inputs=_tensor_metadata(model.plan.inputs), outputs=_tensor_metadata(model.plan.outputs))

    @_grpc_errors
    async def ModelConfig(self, request, context):
        return service_pb2.ModelConfigResponse(config=_model_config(self.core.model(request.name, request.version)))

    @_grpc_errors
    async def ModelStatistics(self, request, context):
        models = [self.core.model(request.name, request.version)] if request.name else self.core.all_versions()
        response = service_pb2.ModelStatisticsResponse()
        for model in models:
            s = model.stats
            response.model_stats.add(
                name=model.name, version=model.version, last_inference=s.last_inference_ms,
                inference_count=s.inference_count, execution_count=s.execution_count,
                inference_stats=service_pb2.InferStatistics(
                    success=_duration(s.success), fail=_duration(s.fail), queue=_duration(s.queue),
                    compute_input=_duration(s.compute_input), compute_infer=_duration(s.compute_infer),
                    compute_output=_duration(s.compute_output)))
        return response

    @_grpc_errors
    async def RepositoryIndex(self, request, context):
        control = self._control(context, changes=False)
        response = service_pb2.RepositoryIndexResponse()
        for state in control.index(ready_only=request.ready):
            response.models.add(name=state.name, version=state.version, state=state.state, reason=state.reason)
        return response

    @_grpc_errors
    async def RepositoryModelLoad(self, request, context):
        if not request.model_name:
            raise InvalidInput("RepositoryModelLoad: model_name is empty")
        control = self._control(context, changes=True)
        delta = deltas.delta_request({k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
                                      for k, v in request.parameters.items()})
        if delta is not None:  # a table delta or its rollback (sixfold.server.deltas.delta_log, docs/deltas.md)
            await deltas.serve_request(self.core, request.model_name, delta)
        else:
            check_change_parameters("load", request.parameters)  # as REST: a config override is refused
            await control.load(request.model_name)
        return service_pb2.RepositoryModelLoadResponse()

    @_grpc_errors
    async def RepositoryModelUnload(self, request, context):
        if not request.model_name:
            raise InvalidInput("RepositoryModelUnload: model_name is empty")
        control = self._control(context, changes=True)
        check_change_parameters("unload", request.parameters)
        await control.unload(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    @_grpc_errors
    async def SystemSharedMemoryRegister(self, request, context):
        registry = enabled(self.core.shared_memory)
        check_local_peer(grpc_peer_host(context.peer() or ""))
        registry.register(request.name, request.key, request.offset, request.byte_size)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    @_grpc_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        registry = enabled(self.core.shared_memory)
        check_local_peer(grpc_peer_host(context.peer() or ""), "unregistration")  # guarded like Register
        registry.unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    @_grpc_errors
    async def SystemSharedMemoryStatus(self, request, context):
        response = service_pb2.SystemSharedMemoryStatusResponse()
        for region in enabled(self.core.shared_memory).status(request.name):
            response.regions[region.name].CopyFrom(service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(
                name=region.name, key=region.key, offset=region.offset, byte_size=region.byte_size))
        return response

    @_grpc_errors
    def ModelInfer(self, request, context):
        # NOTE: not a coroutine of its own: it hands _answer's to the error wrapper, one frame fewer
        # for every request to pass through when it suspends and resumes.
        return self._answer(request, request_timeout(request, context))

    async def _answer(self, request: service_pb2.ModelInferRequest,
                      timeout_s: float | None) -> service_pb2.ModelInferResponse:
        """protobuf in -> core -> protobuf out: the one inference path of unary and streaming calls."""
        shared_memory = self.core.shared_memory
        try:
            model = self.core.serving(request.model_name, request.model_version)
            inputs = decode_inputs(request, shared_memory)
            regions = output_regions(request, shared_memory) if request.outputs else None
        except ServingError as exc:
            if self.metrics is not None:
                self.metrics.record_refused("grpc", exc.reason)
            raise
        outputs = await model.infer(inputs, requested_outputs(request), timeout_s, request_priority(request))
        return encode_response(model.name, model.version, request.id, outputs, regions, shared_memory)

    async def ModelStreamInfer(self, request_iterator, context):
        """Bidirectional stream: each request is answered as soon as it completes (ids tell
        them apart); a failed request becomes an ``error_message`` and the stream goes on.

        Each request holds its size in the receive budget until answered; one that does not fit is
        answered at once with a RESOURCE_EXHAUSTED ``error_message`` (how Triton reports a failed
        stream request) and dropped, and the stream goes on. The message is read before it is
        judged (a stream's next message may come any time later, so no room is reserved for it
        while the stream idles): at most one unadmitted message per stream is held, briefly."""
        answers: asyncio.Queue = asyncio.Queue()
        budget = self.receive_budget

        async def answer(request: service_pb2.ModelInferRequest, held: int) -> None:
            self.core.rpc_started()
            try:
                reply = service_pb2.ModelStreamInferResponse(
                    infer_response=await self._answer(request, request_timeout(request)))
            except Exception as exc:  # noqa: BLE001 - every request gets an answer on the stream
                if not isinstance(exc, ServingError):
                    log.exception("stream request %s failed", request.id)
                message = clip(exc.message if isinstance(exc, ServingError) else f"{type(exc).__name__}: {exc}",
                               _MESSAGE_CHARS)
                reply = _stream_error(request, message)
            finally:
                self.core.rpc_finished()
                if budget is not None:
                    budget.release(held)
            await answers.put(reply)

        def refusal(request: service_pb2.ModelInferRequest) -> service_pb2.ModelStreamInferResponse:
            assert budget is not None
            if self.metrics is not None:
                self.metrics.record_refused("grpc", "receive_budget")
            return _stream_error(request, f"RESOURCE_EXHAUSTED: the server holds {budget.held >> 20} MiB of "
                                          f"requests in flight, its limit is {budget.limit >> 20} MiB "
                                          "(--max-queue-bytes-mb); retry later")

        async def read() -> None:
            tasks: set[asyncio.Task] = set()
            try:
                async for request in request_iterator:
                    held = request.ByteSize() if budget is not None else 0
                    if budget is not None and not budget.try_hold(held):
                        await answers.put(refusal(request))
                        continue
                    task = asyncio.ensure_future(answer(request, held))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await answers.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (reply := await answers.get()) is not None:
                yield reply
        finally:
            reader.cancel()


def _stream_error(request: service_pb2.ModelInferRequest, message: str) -> service_pb2.ModelStreamInferResponse:
    """A stream's answer to one failed request: its ids and ``message`` (the stream goes on)."""
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=service_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id))
