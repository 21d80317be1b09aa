"""KServe v2 REST bodies <-> numpy: JSON tensors and Triton's binary-data extension.

A request body is a JSON header, optionally followed by binary tensor data; the
``Inference-Header-Content-Length`` header says where the JSON ends. An input
with ``parameters.binary_data_size`` takes the next that many bytes (viewed,
not copied); any other input carries ``data``, a flat or nested JSON list. An
output goes back binary when the request asks (``binary_data`` on the output,
else the request's ``binary_data_output``), else as a JSON ``data`` list.
Every mismatch is an InvalidInput that names the field and quotes the numbers,
as in ``sixfold.server.protocol.codec`` for gRPC.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sixfold.server.protocol.codec import DTYPES, datatype_of
from sixfold.server.errors import InvalidInput
from sixfold.server.protocol.shared_memory import (SharedMemoryRef, SharedMemoryRegistry, check_output_region, tensor_from_region,
                            write_output)

__all__ = ["HEADER_LENGTH", "RestRequest", "decode_request", "encode_response", "dumps"]

HEADER_LENGTH = "Inference-Header-Content-Length"
"""Triton's header: bytes of JSON at the start of a body that also carries binary tensors."""

# What JSON values each datatype accepts (numpy kinds of the parsed list): no silent float -> int cuts.
_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_KIND_WORDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers with a fraction", "U": "strings"}


@dataclass
class RestRequest:
    """An inference request, decoded: what ``ServedModel.infer`` takes, plus how to answer."""

    inputs: dict[str, np.ndarray]
    requested: list[str]
    id: str = ""
    timeout_s: float | None = None
    priority: int = 0
    binary_outputs: set[str] | bool = False
    """Output names to send as binary data, or True/False for every output."""
    output_regions: dict[str, SharedMemoryRef] | None = None
    """Outputs to write into shared memory regions (sixfold.server.protocol.shared_memory), by name."""


def dumps(obj: Any) -> bytes:
    """Compact JSON; NaN and infinity pass as Python writes them (tritonclient's rapidjson reads them)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _header(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    """The JSON header as a dict and the binary section after it."""
    if header_length is None:
        json_end = len(body)
    else:
        try:
            json_end = int(header_length)
        except ValueError:
            raise InvalidInput(f"header {HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= json_end <= len(body):
            raise InvalidInput(f"header {HEADER_LENGTH} is {json_end} but the body has {len(body)} bytes")
    try:
        header = json.loads(memoryview(body)[:json_end].tobytes() if json_end < len(body) else body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("request body is not valid JSON: nested too deeply") from None
    return _object(header, "request body"), memoryview(body)[json_end:]


def _int_parameter(parameters: Mapping[str, Any], name: str, meaning: str) -> int | None:
    if name not in parameters:
        return None
    value = parameters[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"parameter '{name}' must be a non-negative integer ({meaning}), got {value!r}")
    return value


def _shape(tensor: dict, name: str) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidInput(f"input '{name}': 'shape' must be a list of integers, got {shape!r}")
    if shape and min(shape) < 0:
        raise InvalidInput(f"input '{name}': shape {shape} has a negative dimension")
    return shape


def _from_json(name: str, datatype: str, dtype: np.dtype, shape: list[int], data: Any) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidInput(f"input '{name}': 'data' must be a JSON list, got {type(data).__name__}")
    count = math.prod(shape)
    try:
        parsed = np.asarray(data)
    except ValueError:  # ragged nesting
        raise InvalidInput(f"input '{name}': 'data' is a ragged nested list") from None
    if parsed.size != count:
        raise InvalidInput(f"input '{name}': {parsed.size} values in 'data' but shape {shape} needs {count}")
    if count == 0:
        return np.zeros(shape, dtype)
    if parsed.dtype.kind not in _KINDS.get(dtype.kind, ""):
        what = _KIND_WORDS.get(parsed.dtype.kind, "mixed or out-of-range values")
        raise InvalidInput(f"input '{name}': 'data' holds {what} (first: {parsed.ravel()[:3].tolist()}), "
                           f"which {datatype} cannot hold")
    if dtype.kind in "iu" and parsed.dtype != dtype:
        info = np.iinfo(dtype)
        low, high = int(parsed.min()), int(parsed.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidInput(f"input '{name}': value {bad} does not fit {datatype}")
    return parsed.astype(dtype, copy=False).reshape(shape)


def _shared_memory_ref(parameters: Mapping[str, Any], what: str) -> SharedMemoryRef | None:
    """(region, offset, byte size) when the tensor's parameters name a shared memory region."""
    if "shared_memory_region" not in parameters:
        return None
    region = parameters["shared_memory_region"]
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{what}: parameter 'shared_memory_region' must be a region name, got {region!r}")
    byte_size = _int_parameter(parameters, "shared_memory_byte_size", "bytes in the region")
    if byte_size is None:
        raise InvalidInput(f"{what}: parameter 'shared_memory_byte_size' is missing beside 'shared_memory_region'")
    return region, _int_parameter(parameters, "shared_memory_offset", "bytes into the region") or 0, byte_size


def _inputs(header: dict, binary: memoryview,
            shared_memory: SharedMemoryRegistry | None) -> dict[str, np.ndarray]:
    tensors = header.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidInput("request body: 'inputs' must be a non-empty list of tensors")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(tensors):
        tensor = _object(tensor, f"inputs[{i}]")
        name = tensor.get("name")
        if not isinstance(name, str):
            raise InvalidInput(f"inputs[{i}]: 'name' must be a string, got {name!r}")
        if name in arrays:
            raise InvalidInput(f"input '{name}' appears twice")
        datatype = tensor.get("datatype")
        dtype = DTYPES.get(datatype)  # type: ignore[arg-type]
        if dtype is None:
            raise InvalidInput(f"input '{name}': unsupported datatype '{datatype}'; supported: {', '.join(DTYPES)}")
        shape = _shape(tensor, name)
        parameters = _object(tensor.get("parameters", {}), f"input '{name}': 'parameters'")
        ref = _shared_memory_ref(parameters, f"input '{name}'")
        if ref is not None:
            arrays[name] = tensor_from_region(shared_memory, ref, dtype, shape, datatype, f"input '{name}'")
            continue
        size = _int_parameter(parameters, "binary_data_size", "bytes of binary data")
        if size is None:
            if "data" not in tensor:
                raise InvalidInput(f"input '{name}': needs 'data' or parameters.binary_data_size")
            arrays[name] = _from_json(name, datatype, dtype, shape, tensor["data"])
            continue
        if offset + size > len(binary):
            raise InvalidInput(f"input '{name}': binary_data_size {size} at offset {offset} runs past the "
                               f"{len(binary)} bytes of binary data after the JSON header")
        need = math.prod(shape) * dtype.itemsize
        if size != need:
            raise InvalidInput(f"input '{name}': binary_data_size is {size} bytes but shape {shape} of "
                               f"{datatype} needs {need}")
        arrays[name] = np.frombuffer(binary[offset:offset + size], dtype).reshape(shape)
        offset += size
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data after the JSON header belong to no input "
                           f"(binary_data_size values add up to {offset})")
    return arrays


def _outputs(header: dict, binary_default: bool, shared_memory: SharedMemoryRegistry | None
             ) -> tuple[list[str], set[str] | bool, dict[str, SharedMemoryRef] | None]:
    outputs = header.get("outputs")
    if outputs is None:
        return [], binary_default, None
    if not isinstance(outputs, list):
        raise InvalidInput(f"request body: 'outputs' must be a list, got {type(outputs).__name__}")
    names: list[str] = []
    binary: set[str] = set()
    regions: dict[str, SharedMemoryRef] = {}
    for i, output in enumerate(outputs):
        output = _object(output, f"outputs[{i}]")
        name = output.get("name")
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}]: 'name' must be a string, got {name!r}")
        parameters = _object(output.get("parameters", {}), f"output '{name}': 'parameters'")
        ref = _shared_memory_ref(parameters, f"output '{name}'")
        if ref is not None:
            check_output_region(shared_memory, ref, f"output '{name}'")
            regions[name] = ref
        wanted = parameters.get("binary_data", binary_default)
        if not isinstance(wanted, bool):
            raise InvalidInput(f"output '{name}': parameter 'binary_data' must be true or false, got {wanted!r}")
        names.append(name)
        if wanted:
            binary.add(name)
    return names, binary, regions or None


def decode_request(body: bytes, header_length: str | None = None,
                   shared_memory: SharedMemoryRegistry | None = None) -> RestRequest:
    """Parse an infer request body (``header_length``: the Inference-Header-Content-Length value;
    ``shared_memory``: the server's regions, None to refuse tensors in shared memory)."""
    header, binary = _header(body, header_length)
    parameters = _object(header.get("parameters", {}), "request 'parameters'")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput(f"parameter 'binary_data_output' must be true or false, got {binary_default!r}")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"request 'id' must be a string, got {request_id!r}")
    timeout_us = _int_parameter(parameters, "timeout", "microseconds")
    priority = _int_parameter(parameters, "priority", "1 = highest level, 0 = default level")
    requested, binary_outputs, regions = _outputs(header, binary_default, shared_memory)
    return RestRequest(inputs=_inputs(header, binary, shared_memory), requested=requested, id=request_id,
                       timeout_s=timeout_us / 1e6 if timeout_us else None, priority=priority or 0,
                       binary_outputs=binary_outputs, output_regions=regions)


def encode_response(model: str, version: str, request_id: str, outputs: Mapping[str, np.ndarray],
                    binary: set[str] | bool, regions: Mapping[str, SharedMemoryRef] | None = None,
                    shared_memory: SharedMemoryRegistry | None = None) -> tuple[bytes, int | None]:
    """The response body and, when it carries binary outputs, the length of its JSON header.
    Outputs named in ``regions`` are written into their shared memory region, not the body."""
    tensors = []
    chunks: list[bytes] = []
    for name, array in outputs.items():
        tensor: dict[str, Any] = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        ref = regions.get(name) if regions else None
        if ref is not None:
            tensor["parameters"] = write_output(shared_memory, ref, array, f"output '{name}'")
        elif binary is True or (binary is not False and name in binary):
            data = np.ascontiguousarray(array).tobytes()
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    response: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": tensors}
    if request_id:
        response["id"] = request_id
    header = dumps(response)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)
