"""KServe v2 over REST (``protocol="http"``, ``sixfold-loadgen --protocol http``): control plane and sends.

- ``HttpControlClient``: readiness, ModelMetadata and ModelConfig over ``GET /v2/...``, with the
  methods (and the protobuf answers) of tritonclient's asyncio gRPC client that
  ``sixfold.loadgen.target`` uses, so discovery is the same code for both protocols.
- ``RawHttpTransport`` (``--client raw``): each pooled query is encoded once, before the clock
  starts, as a binary-data-extension body (a small JSON header, then the tensors' bytes; the header
  ``Inference-Header-Content-Length`` gives the JSON's length), asking for ``scores`` as binary; a
  send is one ``POST /v2/models/NAME/infer`` on a pool of kept-alive connections.
- ``TritonHttpTransport`` (``--client tritonclient``): every send through the stock
  ``tritonclient.http.aio.InferenceServerClient.infer``.

HTTP/1.1 carries one request per connection at a time, so concurrent requests open connections as
they need them, up to ``HTTP_CONNECTIONS``; a request beyond that waits for one (counted in its
latency, which runs from the scheduled time). ``ssl=True`` is HTTPS, trusting ``root_certificates``
(a PEM file; default the system's roots).

Failures raise ``RequestFailed`` with the gRPC status name the HTTP status stands for (``HTTP_REASONS``:
429 is ``resource_exhausted``, 503 ``unavailable``, 504 ``deadline_exceeded``...), so reports of both
protocols count errors alike.
"""

from __future__ import annotations

import asyncio
import json
import ssl as _ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from sixfold.models.signature import SCORES

from sixfold.loadgen.errors import LoadgenError
from sixfold.loadgen.transport import DATATYPES, RequestFailed, _check_scores, read_root_certificates, wire_tensors

__all__ = ["HttpControlClient", "RawHttpTransport", "TritonHttpTransport", "HTTP_REASONS", "HTTP_CONNECTIONS",
           "ssl_context", "encode_request", "decode_scores"]

HTTP_CONNECTIONS = 256
"""Connections a run keeps open to the server at most (HTTP/1.1: one request on each at a time)."""
HTTP_REASONS = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
                408: "deadline_exceeded", 413: "resource_exhausted", 429: "resource_exhausted", 499: "cancelled",
                500: "internal", 501: "unimplemented", 503: "unavailable", 504: "deadline_exceeded"}
"""HTTP status -> the gRPC status name (lower case) it stands for in KServe v2 / Triton; others: ``http_NNN``."""
_CONNECTION_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


def reason_for(status: int) -> str:
    return HTTP_REASONS.get(status, f"http_{status}")


def ssl_context(ssl: bool, root_certificates: str | None) -> _ssl.SSLContext | bool:
    """For aiohttp: a verifying context trusting ``root_certificates`` (else the system's), or False (plain)."""
    if not ssl:
        return False
    pem = read_root_certificates(root_certificates)
    return _ssl.create_default_context(cadata=pem.decode("ascii", "replace")) if pem else _ssl.create_default_context()


def _session(ssl: bool, root_certificates: str | None, limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(ssl=ssl_context(ssl, root_certificates), limit=limit)
    # NOTE: no total timeout: the driver ends a run (drain timeout), MLPerf's SUT bounds each request.
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=False)


def _base(url: str, ssl: bool) -> str:
    return f"{'https' if ssl else 'http'}://{url.rstrip('/')}"


def _model_path(model: str, version: str) -> str:
    return f"/v2/models/{quote(model)}" + (f"/versions/{quote(version)}" if version else "")


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


class HttpControlClient:
    """tritonclient's asyncio gRPC client's control methods (those ``sixfold.loadgen.target`` calls),
    over KServe v2 REST. Errors are ``InferenceServerException`` with a gRPC status name
    (``NOT_FOUND`` for an unknown model, ``UNAVAILABLE`` when nothing answers)."""

    def __init__(self, url: str, *, ssl: bool = False, root_certificates: str | None = None) -> None:
        self.url, self.ssl, self.root_certificates = url, ssl, root_certificates
        self._base = _base(url, ssl)
        self._session = _session(ssl, root_certificates, limit=4)
        self._triton: Any = None

    @property
    def triton(self) -> Any:
        """The stock ``tritonclient.http.aio.InferenceServerClient`` (made on first use, closed with this)."""
        if self._triton is None:
            import tritonclient.http.aio as httpaio
            context = ssl_context(self.ssl, self.root_certificates)
            self._triton = httpaio.InferenceServerClient(self.url, ssl=self.ssl, conn_limit=HTTP_CONNECTIONS,
                                                         ssl_context=context if self.ssl else None)
        return self._triton

    async def _get(self, path: str, timeout_s: float | None) -> tuple[int, bytes]:
        async def get() -> tuple[int, bytes]:
            async with self._session.get(self._base + path) as response:
                return response.status, await response.read()

        try:
            return await asyncio.wait_for(get(), timeout_s)
        except asyncio.TimeoutError:
            raise InferenceServerException(f"GET {path}: no answer within {timeout_s:g} s",
                                           status="DEADLINE_EXCEEDED") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise InferenceServerException(f"GET {self._base}{path}: {exc}", status="UNAVAILABLE") from None

    async def _json(self, path: str, timeout_s: float | None) -> dict[str, Any]:
        status, body = await self._get(path, timeout_s)
        if status != 200:
            text = _error_text(body)
            name = reason_for(status).upper()
            if status == 400 and "unknown model" in text.lower():  # Triton's answer for a model it lacks
                name = "NOT_FOUND"
            raise InferenceServerException(text or f"HTTP {status}", status=name)
        try:
            return json.loads(body)
        except ValueError:
            raise InferenceServerException(f"GET {path}: not JSON", status="INTERNAL") from None

    async def is_server_ready(self, client_timeout: float | None = None) -> bool:
        status, _ = await self._get("/v2/health/ready", client_timeout)
        return status == 200

    async def is_model_ready(self, model: str, version: str = "", client_timeout: float | None = None) -> bool:
        status, _ = await self._get(_model_path(model, version) + "/ready", client_timeout)
        return status == 200

    async def get_model_metadata(self, model: str, version: str = "",
                                 client_timeout: float | None = None) -> service_pb2.ModelMetadataResponse:
        data = await self._json(_model_path(model, version), client_timeout)
        return json_format.ParseDict(data, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def get_model_config(self, model: str, version: str = "",
                               client_timeout: float | None = None) -> service_pb2.ModelConfigResponse:
        data = await self._json(_model_path(model, version) + "/config", client_timeout)
        data = data.get("config", data) if isinstance(data, dict) else {}
        try:
            config = json_format.ParseDict(data, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        except json_format.ParseError:
            # NOTE: a server's enum or field this proto does not know: keep what discovery reads
            config = model_config_pb2.ModelConfig(name=str(data.get("name", model)))
            for key, value in (data.get("parameters") or {}).items():
                if isinstance(value, dict) and isinstance(value.get("string_value"), str):
                    config.parameters[key].string_value = value["string_value"]
        return service_pb2.ModelConfigResponse(config=config)

    async def close(self) -> None:
        await self._session.close()
        if self._triton is not None:
            await self._triton.close()


def encode_request(request: Mapping[str, np.ndarray], ids_dtype: str = "int64") -> tuple[bytes, int]:
    """A binary-data-extension body (JSON header + every tensor's bytes) asking for ``scores`` as binary,
    and the JSON header's length (``Inference-Header-Content-Length``)."""
    arrays = {name: np.ascontiguousarray(array) for name, array in wire_tensors(request, ids_dtype).items()}
    header = {"inputs": [{"name": name, "shape": list(array.shape), "datatype": DATATYPES[array.dtype],
                          "parameters": {"binary_data_size": array.nbytes}} for name, array in arrays.items()],
              "outputs": [{"name": SCORES, "parameters": {"binary_data": True}}]}
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([head, *(array.tobytes() for array in arrays.values())]), len(head)


def decode_scores(body: bytes, header_length: int | None, items: int) -> bytes:
    """The one output's FP32 bytes from an infer answer (binary, or JSON ``data``); ``RequestFailed`` if
    it is not ``scores`` [items, 1]."""
    try:
        header = json.loads(body[:header_length] if header_length is not None else body)
        outputs = header["outputs"]
    except (ValueError, KeyError, TypeError):
        raise RequestFailed("bad_output", "the answer is not a KServe v2 inference response") from None
    if len(outputs) != 1:
        raise RequestFailed("bad_output", f"expected 1 output, got {len(outputs)}")
    out = outputs[0]
    _check_scores(out.get("shape", []), out.get("name", ""), items)
    size = (out.get("parameters") or {}).get("binary_data_size")
    if size is not None and header_length is not None:
        data = body[header_length:header_length + int(size)]
        if out.get("datatype") != "FP32" or len(data) != 4 * items:
            raise RequestFailed("bad_output", f"expected {4 * items} bytes of FP32, got {len(data)} of "
                                              f"{out.get('datatype')}")
        return bytes(data)
    return np.asarray(out.get("data", []), dtype="<f4").tobytes()


class RawHttpTransport:
    """Pre-encoded binary-data bodies POSTed on kept-alive connections (see the module docstring)."""

    def __init__(self, url: str, model: str, version: str = "", ids_dtype: str = "int64", *, ssl: bool = False,
                 root_certificates: str | None = None, connections: int = HTTP_CONNECTIONS) -> None:
        self.url, self.model, self.version, self.ids_dtype, self.ssl = url, model, version, ids_dtype, ssl
        self._base = _base(url, ssl)
        self._infer_url = self._base + _model_path(model, version) + "/infer"
        self._session = _session(ssl, root_certificates, limit=connections)

    def prepare(self, request: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
        body, head = encode_request(request, self.ids_dtype)
        return body, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head)}

    async def connect(self, timeout_s: float) -> None:
        """One connection opened (and its TLS handshake done) before the clock starts."""
        async def get() -> None:
            async with self._session.get(self._base + "/v2/health/live") as response:
                await response.read()

        try:
            await asyncio.wait_for(get(), timeout_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            hint = (" (TLS: does the server serve HTTPS, and do --root-certificates trust its certificate?)"
                    if self.ssl else "")
            raise LoadgenError(f"cannot open an HTTP connection to {self._base} within {timeout_s:g} s "
                               f"({type(exc).__name__}: {exc}){hint}") from None

    async def infer(self, payload: tuple[bytes, dict[str, str]], items: int) -> bytes:
        body, headers = payload
        try:
            async with self._session.post(self._infer_url, data=body, headers=headers) as response:
                answer = await response.read()
                status, length = response.status, response.headers.get("Inference-Header-Content-Length")
        except _CONNECTION_ERRORS as exc:
            raise RequestFailed("unavailable", f"{type(exc).__name__}: {exc}") from None
        if status != 200:
            raise RequestFailed(reason_for(status), _error_text(answer))
        return decode_scores(answer, int(length) if length is not None else None, items)

    async def close(self) -> None:
        await self._session.close()


class TritonHttpTransport:
    """Every request through the stock ``tritonclient.http.aio`` client's ``infer`` (module docstring)."""

    def __init__(self, client: HttpControlClient, model: str, version: str = "", ids_dtype: str = "int64") -> None:
        import tritonclient.http.aio as httpaio
        self._httpaio = httpaio
        self.client, self.model, self.version, self.ids_dtype = client.triton, model, version, ids_dtype
        self._outputs = [httpaio.InferRequestedOutput(SCORES, binary_data=True)]

    def prepare(self, request: Mapping[str, np.ndarray]) -> list[Any]:
        inputs = []
        for name, array in wire_tensors(request, self.ids_dtype).items():
            item = self._httpaio.InferInput(name, list(array.shape), DATATYPES[array.dtype])
            item.set_data_from_numpy(np.ascontiguousarray(array), binary_data=True)
            inputs.append(item)
        return inputs

    async def connect(self, timeout_s: float) -> None:
        """Connections open on the first requests (readiness and discovery used another session)."""

    async def infer(self, payload: list[Any], items: int) -> bytes:
        try:
            result = await self.client.infer(self.model, payload, model_version=self.version, outputs=self._outputs)
        except InferenceServerException as exc:
            status = exc.status() or ""
            raise RequestFailed(reason_for(int(status)) if status.isdigit() else "error", exc.message() or "") from None
        except _CONNECTION_ERRORS as exc:
            raise RequestFailed("unavailable", f"{type(exc).__name__}: {exc}") from None
        response = result.get_response()
        outputs = response.get("outputs", [])
        if len(outputs) != 1:
            raise RequestFailed("bad_output", f"expected 1 output, got {len(outputs)}")
        _check_scores(outputs[0].get("shape", []), outputs[0].get("name", ""), items)
        return np.asarray(result.as_numpy(SCORES), dtype="<f4").tobytes()

    async def close(self) -> None:
        """The client belongs to the HttpControlClient, which closes it."""
