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

from sixfold.server.protocol.codec import DTYPES, check_shape, datatype_of
from sixfold.server.errors import InvalidInput, clip
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


def _kind(value: Any) -> str:
    """What a JSON value is, in words, for "expected ..., got <kind>" messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({clip(repr(value), 40)})"
    if isinstance(value, str):
        return f"a string ({clip(repr(value), 40)})"
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: expected a JSON object, got {_kind(value)}")
    return value


def _string(value: Any, where: str, example: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{where}: expected a string such as {example}, got {_kind(value)}")
    return value


def _header(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    """The JSON header as a dict and the binary section after it."""
    if header_length is None:
        json_end = len(body)
    else:
        try:
            json_end = int(header_length)
        except ValueError:
            raise InvalidInput(f"header {HEADER_LENGTH} must be an integer, got {clip(repr(header_length))}") from None
        if not 0 <= json_end <= len(body):
            raise InvalidInput(f"header {HEADER_LENGTH} is {json_end} but the body has {len(body)} bytes")
    try:
        header = json.loads(memoryview(body)[:json_end].tobytes() if json_end < len(body) else body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"request body is not valid JSON: {clip(str(exc))}") from None
    except RecursionError:
        raise InvalidInput("request body is not valid JSON: nested too deeply") from None
    return _object(header, "request body"), memoryview(body)[json_end:]


def _int_parameter(parameters: Mapping[str, Any], name: str, meaning: str) -> int | None:
    if name not in parameters:
        return None
    value = parameters[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"parameter '{name}' must be a non-negative integer ({meaning}), got {_kind(value)}")
    return value


def _shape(tensor: dict, where: str, name: str) -> list[int]:
    """The input's shape: a list of non-negative integers within codec.check_shape's limits."""
    if "shape" not in tensor:
        raise InvalidInput(f"{where}.shape: missing; expected a list of integers such as [2, 13]")
    shape = tensor["shape"]
    if not isinstance(shape, list):
        raise InvalidInput(f"{where}.shape: expected a list of integers such as [2, 13], got {_kind(shape)}")
    for k, d in enumerate(shape):
        if not isinstance(d, int) or isinstance(d, bool):
            raise InvalidInput(f"{where}.shape[{k}]: expected an integer, got {_kind(d)}")
    check_shape(shape, f"input '{clip(name)}'")
    return shape


def _from_json(name: str, where: str, datatype: str, dtype: np.dtype, shape: list[int], data: Any) -> np.ndarray:
    name = clip(name)
    if not isinstance(data, list):
        raise InvalidInput(f"{where}.data (input '{name}'): expected a JSON list of values, got {_kind(data)}")
    count = math.prod(shape)
    try:
        parsed = np.asarray(data)
    except ValueError:  # ragged nesting, or nested deeper than numpy's dimension limit
        raise InvalidInput(f"input '{name}': 'data' is a ragged nested list (or nested too deeply)") from None
    except (TypeError, OverflowError, RecursionError) as exc:
        raise InvalidInput(f"input '{name}': 'data' is not a list of {datatype} values: {clip(str(exc))}") from None
    if parsed.size != count:
        raise InvalidInput(f"input '{name}': {parsed.size} values in 'data' but shape {shape} needs {count}")
    if count == 0:
        return np.zeros(shape, dtype)
    if parsed.dtype.kind not in _KINDS.get(dtype.kind, ""):
        what = _KIND_WORDS.get(parsed.dtype.kind, "mixed or out-of-range values")
        raise InvalidInput(f"input '{name}': 'data' holds {what} (first: {clip(parsed.ravel()[:3].tolist())}), "
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
        raise InvalidInput(f"{what}: parameter 'shared_memory_region' must be a region name, got {_kind(region)}")
    byte_size = _int_parameter(parameters, "shared_memory_byte_size", "bytes in the region")
    if byte_size is None:
        raise InvalidInput(f"{what}: parameter 'shared_memory_byte_size' is missing beside 'shared_memory_region'")
    return region, _int_parameter(parameters, "shared_memory_offset", "bytes into the region") or 0, byte_size


def _inputs(header: dict, binary: memoryview,
            shared_memory: SharedMemoryRegistry | None) -> dict[str, np.ndarray]:
    tensors = header.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidInput(f"request body: 'inputs' must be a non-empty list of tensors, got {_kind(tensors)}")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(tensors):
        where = f"inputs[{i}]"
        tensor = _object(tensor, where)
        name = _string(tensor.get("name"), f"{where}.name", '"dense_features"')
        if name in arrays:
            raise InvalidInput(f"input '{clip(name)}' appears twice")
        datatype = _string(tensor.get("datatype"), f"{where}.datatype", '"FP32"')
        dtype = DTYPES.get(datatype)
        if dtype is None:
            raise InvalidInput(f"input '{clip(name)}': unsupported datatype '{clip(datatype)}'; "
                               f"supported: {', '.join(DTYPES)}")
        shape = _shape(tensor, where, name)
        parameters = _object(tensor.get("parameters", {}), f"{where}.parameters")
        ref = _shared_memory_ref(parameters, f"input '{clip(name)}'")
        if ref is not None:
            arrays[name] = tensor_from_region(shared_memory, ref, dtype, shape, datatype, f"input '{clip(name)}'")
            continue
        size = _int_parameter(parameters, "binary_data_size", "bytes of binary data")
        if size is None:
            if "data" not in tensor:
                raise InvalidInput(f"input '{clip(name)}': needs 'data' or parameters.binary_data_size")
            arrays[name] = _from_json(name, where, datatype, dtype, shape, tensor["data"])
            continue
        if offset + size > len(binary):
            raise InvalidInput(f"input '{clip(name)}': binary_data_size {size} at offset {offset} runs past the "
                               f"{len(binary)} bytes of binary data after the JSON header")
        need = math.prod(shape) * dtype.itemsize
        if size != need:
            raise InvalidInput(f"input '{clip(name)}': binary_data_size is {size} bytes but shape {shape} of "
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
        raise InvalidInput(f"request body: 'outputs' must be a list, got {_kind(outputs)}")
    names: list[str] = []
    binary: set[str] = set()
    regions: dict[str, SharedMemoryRef] = {}
    for i, output in enumerate(outputs):
        output = _object(output, f"outputs[{i}]")
        name = _string(output.get("name"), f"outputs[{i}].name", '"scores"')
        parameters = _object(output.get("parameters", {}), f"outputs[{i}].parameters")
        ref = _shared_memory_ref(parameters, f"output '{clip(name)}'")
        if ref is not None:
            check_output_region(shared_memory, ref, f"output '{clip(name)}'")
            regions[name] = ref
        wanted = parameters.get("binary_data", binary_default)
        if not isinstance(wanted, bool):
            raise InvalidInput(f"outputs[{i}].parameters.binary_data: expected true or false, got {_kind(wanted)}")
        names.append(name)
        if wanted:
            binary.add(name)
    return names, binary, regions or None


def decode_request(body: bytes, header_length: str | None = None,
                   shared_memory: SharedMemoryRegistry | None = None) -> RestRequest:
    """Parse an infer request body (``header_length``: the Inference-Header-Content-Length value;
    ``shared_memory``: the server's regions, None to refuse tensors in shared memory)."""
    header, binary = _header(body, header_length)
    parameters = _object(header.get("parameters", {}), "parameters")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput(f"parameters.binary_data_output: expected true or false, got {_kind(binary_default)}")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"id: expected a string, got {_kind(request_id)}")
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
