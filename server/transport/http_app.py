"""KServe v2 REST routes (Triton's paths) over the same InferenceCore as the gRPC servicer.

Thin like the servicer: each route reads the request, calls the core, and
writes JSON (``sixfold.server.protocol.http_codec`` does tensors). Domain errors become HTTP
statuses in one place (``http_status``), each answered as ``{"error": "..."}``
(what tritonclient.http reads). Readiness endpoints answer 200 or 400, as
Triton's do; tritonclient's ``is_*_ready`` only asks "200 or not".
"""

from __future__ import annotations

import functools
import json
import logging
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sixfold import __version__
from sixfold.server.deltas import delta_log as deltas
from sixfold.server.core import InferenceCore
from sixfold.server.errors import (DeadlineExceeded, InternalError, InvalidInput, ModelNotFound, Overloaded, ServingError,
                     Unauthenticated, Unavailable, clip)
from sixfold.server.protocol.http_codec import HEADER_LENGTH, decode_request, dumps, encode_response
from sixfold.server.model.served import ServedModel
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_config import to_model_config
from sixfold.server.loading.model_control import authorized_control, check_change_parameters
from sixfold.server.protocol.shared_memory import NotLocal, check_local_peer, enabled
from sixfold.server.scheduling.unread_admission import refusal_for_unread
from sixfold.server.transport.http_limits import BodyTimeout

__all__ = ["BodyTooLarge", "http_status", "build_app"]

log = logging.getLogger(__name__)


class BodyTooLarge(InvalidInput):
    """A request body over ServerConfig.max_message_bytes (HTTP 413)."""


_STATUS: dict[type[ServingError], int] = {
    BodyTooLarge: 413, NotLocal: 403, InvalidInput: 400, ModelNotFound: 404, Unauthenticated: 401, Overloaded: 429,
    BodyTimeout: 408, Unavailable: 503, DeadlineExceeded: 504, InternalError: 500, ServingError: 500,
}


def http_status(exc: ServingError) -> int:
    """The HTTP status of a domain error: the one place REST maps them (gRPC's is ServingError.code)."""
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return _json({"error": message}, status)


Handler = Callable[[Any, Request], Awaitable[Response]]


def _rest_errors(handler: Handler) -> Handler:
    """Count the request for graceful shutdown and turn every error into a JSON answer."""
    @functools.wraps(handler)
    async def wrapper(self: "_Routes", request: Request) -> Response:
        self.core.rpc_started()
        try:
            return await handler(self, request)
        except ServingError as exc:
            return _error(exc.message, http_status(exc))
        except Exception as exc:  # noqa: BLE001 - last resort: the client still gets an answer
            log.exception("%s %s failed", request.method, request.url.path)
            return _error(f"{type(exc).__name__}: {exc}", 500)
        finally:
            self.core.rpc_finished()
    return wrapper


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _int64_as_numbers(message: Any, data: dict) -> None:
    """protobuf's JSON writes 64-bit integers as strings; Triton's REST writes numbers (dims: [-1, 256])."""
    for fd, value in message.ListFields():
        if fd.name not in data:
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            for key, item in value.items():
                if value_fd.message_type is not None:
                    _int64_as_numbers(item, data[fd.name][str(key)])
        elif fd.message_type is not None:
            items = data[fd.name]
            for sub, sub_data in zip(value, items) if isinstance(items, list) else [(value, items)]:
                _int64_as_numbers(sub, sub_data)
        elif fd.type in _INT64:
            item = data[fd.name]
            data[fd.name] = [int(v) for v in item] if isinstance(item, list) else int(item)


def _model_config(model: ServedModel) -> dict:
    config = to_model_config(model.name, model.batcher.config, parameters=model.config_parameters(),
                             inputs=model.plan.inputs, outputs=model.plan.outputs)
    data = json_format.MessageToDict(config, preserving_proto_field_name=True)
    _int64_as_numbers(config, data)
    return data


def _tensors(tensors: list) -> list[dict]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]


def _duration(d: Any) -> dict:
    return {"count": d.count, "ns": d.ns}


def _name_version(request: Request) -> tuple[str, str]:
    params = request.path_params
    return params["name"], params.get("version", "")


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip or deflate request body, inflated to at most ``limit`` bytes."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding.strip().lower())
    if wbits is None:
        raise InvalidInput(f"header Content-Encoding '{encoding}' is not supported; use gzip or deflate")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {encoding} data: {exc}") from None
    if len(data) > limit:
        raise BodyTooLarge(f"request body inflates past the {limit}-byte limit (--max-message-mb)")
    return data


async def read_body_within(request: Request, limit: int) -> bytes:
    """The request body as sent, refused (BodyTooLarge, 413) as soon as it passes ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit (--max-message-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


class _Routes:
    def __init__(self, core: InferenceCore, max_body_bytes: int, control_token: str | None,
                 metrics: ServerMetrics | None = None) -> None:
        self.core, self.max_body_bytes, self.control_token = core, max_body_bytes, control_token
        self.metrics = metrics
        self._reading = 0
        """Inference bodies being read: each counts as a mean request's work when the next is admitted unread."""

    async def _body(self, request: Request) -> bytes:
        """The request body, refused (413) once it passes the limit; gzip/deflate inflated."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit (--max-message-mb)")
        body = await read_body_within(request, limit)
        encoding = request.headers.get("content-encoding")
        if encoding and encoding.strip().lower() != "identity":
            body = _decompress(body, encoding, limit)
        return body

    @_rest_errors
    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    @_rest_errors
    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.core.ready else 400)

    @_rest_errors
    async def model_ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.core.model_ready(*_name_version(request)) else 400)

    @_rest_errors
    async def server_metadata(self, request: Request) -> Response:
        extensions = ["binary_tensor_data", "model_configuration", "statistics"]
        if self.core.shared_memory is not None:
            extensions.append("system_shared_memory")
        if self.core.control is not None:
            extensions.append("model_repository")
        return _json({"name": "sixfold", "version": __version__, "extensions": extensions})

    @_rest_errors
    async def model_metadata(self, request: Request) -> Response:
        model = self.core.model(*_name_version(request))
        versions = sorted(self.core.versions.get(model.name, {model.version: model}), key=lambda v: (len(v), v))
        return _json({"name": model.name, "versions": versions, "platform": "sixfold",
                      "inputs": _tensors(model.plan.inputs), "outputs": _tensors(model.plan.outputs)})

    @_rest_errors
    async def model_config(self, request: Request) -> Response:
        return _json(_model_config(self.core.model(*_name_version(request))))

    @_rest_errors
    async def statistics(self, request: Request) -> Response:
        name = request.path_params.get("name")
        models = [self.core.model(*_name_version(request))] if name else self.core.all_versions()
        stats = []
        for model in models:
            s = model.stats
            stats.append({
                "name": model.name, "version": model.version, "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count, "execution_count": s.execution_count,
                "inference_stats": {key: _duration(getattr(s, key)) for key in
                                    ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")},
                "batch_stats": []})
        return _json({"model_stats": stats})

    @_rest_errors
    async def infer(self, request: Request) -> Response:
        try:
            model = self.core.serving(*_name_version(request))
            # NOTE: the model is named in the path, so its batcher can refuse before the body is read: under
            # overload a refused 8.6 MB query then costs no read and no decode (docs/admission.md)
            refusal = refusal_for_unread([model], None, self._reading)
            if refusal:
                raise Overloaded(refusal)
            self._reading += 1
            try:
                body = await self._body(request)
            finally:
                self._reading -= 1
            parsed = decode_request(body, request.headers.get(HEADER_LENGTH), self.core.shared_memory)
        except ServingError as exc:
            if self.metrics is not None:
                self.metrics.record_refused("rest", exc.reason)
            raise
        outputs = await model.infer(parsed.inputs, parsed.requested, parsed.timeout_s, parsed.priority)
        content, header_length = encode_response(model.name, model.version, parsed.id, outputs,
                                                 parsed.binary_outputs, parsed.output_regions, self.core.shared_memory)
        if header_length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(header_length)})

    def _control(self, request: Request, *, changes: bool):
        """The ModelControl, after the same checks as the gRPC servicer's (mode, bearer token)."""
        given = request.headers.get("authorization", "")
        return authorized_control(self.core, given, self.control_token, changes=changes)

    async def _json_body(self, request: Request) -> dict:
        body = await self._body(request)
        if not body.strip():
            return {}
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidInput(f"request body must be a JSON object, got {type(data).__name__}")
        return data

    @_rest_errors
    async def shm_status(self, request: Request) -> Response:
        regions = enabled(self.core.shared_memory).status(request.path_params.get("region", ""))
        return _json([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions])

    @_rest_errors
    async def shm_register(self, request: Request) -> Response:
        registry = enabled(self.core.shared_memory)
        check_local_peer(request.client.host if request.client else None)
        body = await self._json_body(request)
        key = body.get("key")
        if not isinstance(key, str):
            raise InvalidInput(f"register: 'key' must be a string, got {clip(repr(key))}")
        registry.register(request.path_params["region"], key, body.get("offset", 0), body.get("byte_size"))
        return Response(status_code=200)

    @_rest_errors
    async def shm_unregister(self, request: Request) -> Response:
        registry = enabled(self.core.shared_memory)
        check_local_peer(request.client.host if request.client else None, "unregistration")  # as shm_register
        region = request.path_params.get("region", "")
        registry.unregister(region)
        return Response(status_code=200)

    @_rest_errors
    async def repository_index(self, request: Request) -> Response:
        control = self._control(request, changes=False)
        ready = (await self._json_body(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"'ready' must be true or false, got {ready!r}")
        return _json([{"name": s.name, "version": s.version, "state": s.state, "reason": s.reason}
                      for s in control.index(ready_only=ready)])

    async def _change(self, request: Request, action: str) -> Response:
        control = self._control(request, changes=True)
        parameters = (await self._json_body(request)).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InvalidInput(f"model {action}: 'parameters' must be a JSON object, got {parameters!r}")
        name = request.path_params["name"]
        delta = deltas.delta_request(parameters) if action == "load" else None
        if delta is not None:  # a table delta or its rollback (sixfold.server.deltas.delta_log, docs/deltas.md)
            return _json(await deltas.serve_request(self.core, name, delta))
        check_change_parameters(action, parameters)
        if action == "load":
            await control.load(name)
        else:
            await control.unload(name)
        return Response(status_code=200)

    @_rest_errors
    async def load(self, request: Request) -> Response:
        return await self._change(request, "load")

    @_rest_errors
    async def unload(self, request: Request) -> Response:
        return await self._change(request, "unload")


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (unknown path 404, wrong method 405) as JSON errors too; a 405
    keeps its ``Allow`` header, the route's methods (RFC 9110 15.5.6)."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    route = request.scope.get("route")
    methods = getattr(route, "methods", None)
    if exc.status_code == 405 and methods:
        headers["Allow"] = ", ".join(sorted(methods))
    response = _error(f"{clip(request.method, 32)} {clip(request.url.path)}: {exc.detail}", exc.status_code)
    response.headers.update(headers)
    return response


def build_app(core: InferenceCore, *, max_body_bytes: int = 1 << 30, control_token: str | None = None,
              metrics: ServerMetrics | None = None) -> Starlette:
    """The ASGI app: Triton's KServe v2 REST paths, each with and without ``/versions/{version}``."""
    r = _Routes(core, max_body_bytes, control_token, metrics)
    model = "/v2/models/{name}"
    versioned = [model, model + "/versions/{version}"]
    routes = [Route("/v2/health/live", r.live), Route("/v2/health/ready", r.ready), Route("/v2", r.server_metadata),
              Route("/v2/models/stats", r.statistics),
              Route("/v2/repository/index", r.repository_index, methods=["POST"]),
              Route("/v2/repository/models/{name}/load", r.load, methods=["POST"]),
              Route("/v2/repository/models/{name}/unload", r.unload, methods=["POST"]),
              Route("/v2/systemsharedmemory/status", r.shm_status),
              Route("/v2/systemsharedmemory/region/{region}/status", r.shm_status),
              Route("/v2/systemsharedmemory/region/{region}/register", r.shm_register, methods=["POST"]),
              Route("/v2/systemsharedmemory/unregister", r.shm_unregister, methods=["POST"]),
              Route("/v2/systemsharedmemory/region/{region}/unregister", r.shm_unregister, methods=["POST"])]
    for base in versioned:
        routes += [Route(base, r.model_metadata), Route(base + "/ready", r.model_ready),
                   Route(base + "/config", r.model_config), Route(base + "/stats", r.statistics),
                   Route(base + "/infer", r.infer, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
