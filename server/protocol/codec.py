"""KServe v2 tensors <-> numpy: decode a ModelInferRequest, encode a ModelInferResponse.

Raw bytes are viewed, not copied (``np.frombuffer``). Every mismatch becomes an
InvalidInput that names the input and quotes the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from tritonclient.grpc import service_pb2

from sixfold.server.errors import InvalidInput, clip
from sixfold.server.protocol.shared_memory import (SharedMemoryRef, SharedMemoryRegistry, check_output_region, tensor_from_region,
                            write_output)

__all__ = ["DTYPES", "decode_inputs", "requested_outputs", "request_timeout", "request_priority", "encode_response",
           "datatype_of", "shared_memory_ref", "output_regions", "MAX_TENSOR_ELEMENTS", "MAX_DIMS", "check_shape"]

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_TENSOR_ELEMENTS = 1 << 31
"""Most elements one input tensor may declare (zero dimensions counted as 1, so that numpy can still
make the empty array): a shape past it is refused, naming the input and the limit, before anything
is allocated or viewed."""
MAX_DIMS = 32
"""Most dimensions one input tensor may declare (numpy's own limit is 64)."""
# Which typed-contents field carries each datatype (KServe v2 protocol).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def datatype_of(array: np.ndarray) -> str:
    try:
        return _NAMES[array.dtype]
    except KeyError:
        raise InvalidInput(f"unsupported output dtype {array.dtype}") from None


def check_shape(shape, what: str) -> None:
    """Refuse a declared shape (a sequence of Python ints) with a negative dimension, too many
    dimensions, or more than MAX_TENSOR_ELEMENTS elements: before anything is allocated, and
    without overflow (Python ints)."""
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"{what}: shape has {len(shape)} dimensions, over the limit of {MAX_DIMS}")
    if shape and min(shape) < 0:
        raise InvalidInput(f"{what}: shape {clip(list(shape))} has a negative dimension")
    count = 1
    for d in shape:
        count *= max(d, 1)
        if count > MAX_TENSOR_ELEMENTS:
            raise InvalidInput(f"{what}: shape {clip(list(shape))} declares more than the limit of "
                               f"{MAX_TENSOR_ELEMENTS} elements per tensor")


def _shape(tensor: service_pb2.ModelInferRequest.InferInputTensor) -> tuple[int, ...]:
    shape = tuple(tensor.shape)
    check_shape(shape, f"input '{clip(tensor.name)}'")
    return shape


def _dtype(tensor: service_pb2.ModelInferRequest.InferInputTensor) -> np.dtype:
    dtype = DTYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidInput(f"input '{clip(tensor.name)}': unsupported datatype '{clip(tensor.datatype)}'; "
                           f"supported: {', '.join(DTYPES)}")
    return dtype


def _from_contents(tensor: service_pb2.ModelInferRequest.InferInputTensor, dtype: np.dtype,
                   shape: tuple[int, ...], count: int) -> np.ndarray:
    field = _CONTENTS_FIELD.get(tensor.datatype)
    values = getattr(tensor.contents, field) if field else ()
    if len(values) != count:
        raise InvalidInput(f"input '{clip(tensor.name)}': {len(values)} values in contents.{field or '?'} but "
                           f"shape {list(shape)} needs {count}")
    return np.asarray(values, dtype=dtype).reshape(shape)


def _param_int(parameters, key: str, what: str) -> int:
    param = parameters[key]
    which = param.WhichOneof("parameter_choice")
    value = getattr(param, which) if which else None
    if which not in ("int64_param", "uint64_param") or value < 0:
        raise InvalidInput(f"{what}: parameter '{key}' must be a non-negative integer, got {clip(repr(value))}")
    return int(value)


def shared_memory_ref(parameters, what: str) -> SharedMemoryRef | None:
    """The tensor's region, offset and byte size when its parameters put it in shared memory
    (Triton's ``shared_memory_region``, ``shared_memory_offset``, ``shared_memory_byte_size``)."""
    if "shared_memory_region" not in parameters:
        return None
    region = parameters["shared_memory_region"]
    if region.WhichOneof("parameter_choice") != "string_param" or not region.string_param:
        raise InvalidInput(f"{what}: parameter 'shared_memory_region' must be a region name")
    if "shared_memory_byte_size" not in parameters:
        raise InvalidInput(f"{what}: parameter 'shared_memory_byte_size' is missing beside "
                           "'shared_memory_region'")
    offset = _param_int(parameters, "shared_memory_offset", what) if "shared_memory_offset" in parameters else 0
    return region.string_param, offset, _param_int(parameters, "shared_memory_byte_size", what)


def decode_inputs(request: service_pb2.ModelInferRequest,
                  shared_memory: SharedMemoryRegistry | None = None) -> dict[str, np.ndarray]:
    """The request's input tensors by name, from raw_input_contents, typed contents or shared
    memory regions (``shared_memory``: the server's registry; None refuses such inputs)."""
    # NOTE: runs on the event loop for every request: each protobuf field read is a call into
    # upb, so every field is read once, and each input is one ndarray over its raw bytes.
    raw = request.raw_input_contents
    tensors = request.inputs
    if len(raw) != len(tensors):  # some (or all) inputs come as contents or from shared memory
        return _decode_mixed(tensors, raw, shared_memory)
    arrays: dict[str, np.ndarray] = {}
    for tensor, data in zip(tensors, raw):
        name = tensor.name
        dtype = DTYPES.get(tensor.datatype) or _dtype(tensor)  # _dtype raises, naming the input
        shape = tensor.shape[:]  # NOTE: a list slice is half the cost of tuple() on upb's container
        if len(data) != math.prod(shape) * dtype.itemsize or name in arrays:
            _raw_mismatch(tensor, name, arrays, shape, dtype, data)  # raises, naming the input
        try:  # a read-only view of the bytes, like np.frombuffer(...).reshape(...) in one call
            arrays[name] = np.ndarray(shape, dtype, data)
        except ValueError:  # negative dimensions whose product still matches the bytes
            _raw_mismatch(tensor, name, arrays, shape, dtype, data)
    return arrays


def _raw_mismatch(tensor: service_pb2.ModelInferRequest.InferInputTensor, name: str, seen: Mapping[str, object],
                  shape: list[int], dtype: np.dtype, data: bytes) -> None:
    """Raise the InvalidInput that explains why a raw input cannot be viewed as its declared tensor."""
    if name in seen:
        raise InvalidInput(f"input '{clip(name)}' appears twice")
    _shape(tensor)  # raises for a negative dimension or a shape past the limits
    need = math.prod(shape) * dtype.itemsize
    raise InvalidInput(f"input '{clip(name)}': raw contents have {len(data)} bytes but shape "
                       f"{list(shape)} of {tensor.datatype} needs {need}")


def _decode_mixed(tensors, raw, shared_memory: SharedMemoryRegistry | None) -> dict[str, np.ndarray]:
    """Inputs from shared memory regions, typed contents (``contents.fp32_contents`` etc.) or raw
    bytes, in Triton's order: raw_input_contents holds the inputs that have neither, in order."""
    arrays: dict[str, np.ndarray] = {}
    next_raw = 0
    for tensor in tensors:
        name = tensor.name
        if name in arrays:
            raise InvalidInput(f"input '{clip(name)}' appears twice")
        dtype = DTYPES.get(tensor.datatype) or _dtype(tensor)
        shape = _shape(tensor)
        what = f"input '{clip(name)}'"
        ref = shared_memory_ref(tensor.parameters, what)
        if ref is not None:
            if tensor.HasField("contents"):
                raise InvalidInput(f"{what}: has both contents and a shared memory region")
            arrays[name] = tensor_from_region(shared_memory, ref, dtype, shape, tensor.datatype, what)
        elif tensor.HasField("contents"):
            if raw:
                raise InvalidInput(f"{what}: has typed contents in a request that also has raw_input_contents")
            arrays[name] = _from_contents(tensor, dtype, shape, math.prod(shape))
        elif next_raw < len(raw):
            data = raw[next_raw]
            next_raw += 1
            if len(data) != math.prod(shape) * dtype.itemsize:
                _raw_mismatch(tensor, name, arrays, list(shape), dtype, data)
            arrays[name] = np.ndarray(shape, dtype, data)
        else:
            arrays[name] = _from_contents(tensor, dtype, shape, math.prod(shape))  # raises: no values
    if next_raw != len(raw):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for the {next_raw} inputs without "
                           "contents or shared memory; they must match one to one")
    return arrays


def output_regions(request: service_pb2.ModelInferRequest,
                   shared_memory: SharedMemoryRegistry | None = None) -> dict[str, SharedMemoryRef] | None:
    """The requested outputs to be written into shared memory regions, checked before any work."""
    regions: dict[str, SharedMemoryRef] | None = None
    for output in request.outputs:
        parameters = output.parameters
        if not parameters:  # NOTE: nearly every request: one length read, no map lookup
            continue
        what = f"output '{clip(output.name)}'"
        ref = shared_memory_ref(parameters, what)
        if ref is None:
            continue
        check_output_region(shared_memory, ref, what)
        if regions is None:
            regions = {}
        regions[output.name] = ref
    return regions


def requested_outputs(request: service_pb2.ModelInferRequest) -> list[str]:
    outputs = request.outputs
    return [o.name for o in outputs] if outputs else []


def request_timeout(request: service_pb2.ModelInferRequest, context: object = None) -> float | None:
    """Seconds the client will wait: the sooner of its gRPC deadline and the ``timeout``
    parameter (microseconds, Triton's name); None when neither is set."""
    remaining = context.time_remaining() if context is not None else None
    limit = None if remaining is None else max(0.0, remaining)
    if "timeout" in request.parameters:
        param = request.parameters["timeout"]
        which = param.WhichOneof("parameter_choice")
        value = getattr(param, which) if which else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(f"parameter 'timeout' must be a non-negative integer (microseconds), "
                               f"got {clip(repr(value))}")
        if value and (limit is None or value / 1e6 < limit):
            limit = value / 1e6
    return limit


def request_priority(request: service_pb2.ModelInferRequest) -> int:
    """The ``priority`` parameter (Triton's: 1 is the highest level; 0 or absent: the model's
    default level). tritonclient sends it as ``uint64_param`` (``infer(..., priority=N)``)."""
    if "priority" not in request.parameters:
        return 0
    param = request.parameters["priority"]
    which = param.WhichOneof("parameter_choice")
    value = getattr(param, which) if which else None
    if which not in ("int64_param", "uint64_param") or value < 0:
        raise InvalidInput(f"parameter 'priority' must be a non-negative integer (1 = highest level, "
                           f"0 = default level), got {value!r}")
    return int(value)


def encode_response(model: str, version: str, request_id: str, outputs: Mapping[str, np.ndarray],
                    regions: Mapping[str, SharedMemoryRef] | None = None,
                    shared_memory: SharedMemoryRegistry | None = None) -> service_pb2.ModelInferResponse:
    """Outputs as raw_output_contents (what tritonclient and perf_analyzer read); those named in
    ``regions`` are written into their shared memory region instead, and carry an empty entry so
    that raw_output_contents stays one entry per output."""
    if not regions:
        # NOTE: every request of a model and size has the same output metadata: it is copied from a
        # response made once (one upb copy, ~1 us) instead of set field by field (~2.5 us a request).
        key = (model, version, *[(name, array.dtype, array.shape) for name, array in outputs.items()])
        template = _RESPONSE_TEMPLATES.get(key)
        if template is None:
            template = _response_template(key, model, version, outputs)
        response = service_pb2.ModelInferResponse()
        response.CopyFrom(template)
        response.id = request_id
        raw = response.raw_output_contents
        for array in outputs.values():
            raw.append(array.tobytes())  # C order, whatever the array's strides
        return response
    response = service_pb2.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for name, array in outputs.items():
        out = response.outputs.add()
        out.name = name
        out.datatype = datatype_of(array)
        out.shape.extend(array.shape)
        ref = regions.get(name) if regions else None
        if ref is None:
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
            continue
        for key, value in write_output(shared_memory, ref, array, f"output '{name}'").items():
            if isinstance(value, str):
                out.parameters[key].string_param = value
            else:
                out.parameters[key].int64_param = value
        response.raw_output_contents.append(b"")
    return response


_RESPONSE_TEMPLATES: dict[tuple, service_pb2.ModelInferResponse] = {}
_MAX_RESPONSE_TEMPLATES = 1024
"""Response templates kept (model, version, each output's name, dtype and shape): a few per model in
practice (one per batch size a client sends); past the bound the cache starts afresh."""


def _response_template(key: tuple, model: str, version: str,
                       outputs: Mapping[str, np.ndarray]) -> service_pb2.ModelInferResponse:
    """The response to ``outputs`` without an id or raw contents, made once per key (raises
    InvalidInput for an unsupported dtype, as every request of that key would)."""
    template = service_pb2.ModelInferResponse(model_name=model, model_version=version)
    for name, array in outputs.items():
        out = template.outputs.add()
        out.name = name
        out.datatype = datatype_of(array)
        out.shape.extend(array.shape)
    if len(_RESPONSE_TEMPLATES) >= _MAX_RESPONSE_TEMPLATES:
        _RESPONSE_TEMPLATES.clear()
    _RESPONSE_TEMPLATES[key] = template
    return template
