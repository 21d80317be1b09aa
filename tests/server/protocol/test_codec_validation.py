"""Decoding KServe v2 tensors and validating canonical requests: every error names its field."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sixfold.server.protocol.codec import decode_inputs, encode_response
from sixfold.server.errors import InvalidInput
from sixfold.server.model import validation
from sixfold.server.model.validation import InputSpec, validate_request

SPECS = [InputSpec("dense_features", "FP32", (-1, 3)), InputSpec("sparse_lengths", "INT32", (-1, 2)),
         InputSpec("sparse_indices", "INT64", (-1,))]
ROWS = [10, 20]


def _good() -> dict[str, np.ndarray]:
    return {"dense_features": np.zeros((2, 3), np.float32),
            "sparse_lengths": np.array([[1, 2], [0, 1]], np.int32),
            "sparse_indices": np.array([9, 19, 0, 5], np.int64)}


def _request(arrays: dict[str, np.ndarray], raw: bool = True) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m")
    for name, array in arrays.items():
        t = request.inputs.add(name=name, datatype={np.float32: "FP32", np.int32: "INT32", np.int64: "INT64"}[array.dtype.type],
                               shape=array.shape)
        if raw:
            request.raw_input_contents.append(array.tobytes())
        else:
            field = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}[t.datatype]
            getattr(t.contents, field).extend(array.ravel().tolist())
    return request


@pytest.mark.parametrize("raw", [True, False])
def test_raw_and_typed_contents_decode_to_the_same_arrays(raw: bool) -> None:
    decoded = decode_inputs(_request(_good(), raw=raw))
    for name, array in _good().items():
        np.testing.assert_array_equal(decoded[name], array)
        assert decoded[name].dtype == array.dtype
    assert validate_request(decoded, SPECS, ROWS) == 2


def test_raw_bytes_short_of_the_shape() -> None:
    request = _request(_good())
    request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
    with pytest.raises(InvalidInput, match=r"'dense_features': raw contents have 20 bytes .* needs 24"):
        decode_inputs(request)


@pytest.mark.parametrize("shape, nbytes", [((-1, -1), 4), ((-1, 0), 0), ((-2, 0), 0), ((-1,), 12), ((2, -2), 16)])
def test_negative_dimensions_are_refused_even_when_the_bytes_match(shape, nbytes: int) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="dense_features", datatype="FP32", shape=shape)
    request.raw_input_contents.append(bytes(nbytes))
    with pytest.raises(InvalidInput, match="'dense_features': shape .* has a negative dimension"):
        decode_inputs(request)


def test_an_input_given_twice_is_refused() -> None:
    request = _request(_good())
    request.inputs.add(name="dense_features", datatype="FP32", shape=[2, 3])
    request.raw_input_contents.append(bytes(24))
    with pytest.raises(InvalidInput, match="'dense_features' appears twice"):
        decode_inputs(request)


def test_typed_contents_count_mismatch_and_bad_datatype() -> None:
    request = _request(_good(), raw=False)
    request.inputs[2].contents.int64_contents.append(3)
    with pytest.raises(InvalidInput, match="'sparse_indices': 5 values"):
        decode_inputs(request)
    request = _request(_good())
    request.inputs[0].datatype = "FP8"
    with pytest.raises(InvalidInput, match="'dense_features': unsupported datatype 'FP8'"):
        decode_inputs(request)


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(dense_features=r["dense_features"].astype(np.float64)), "'dense_features': datatype FP64"),
    (lambda r: r.update(dense_features=np.zeros((2, 4), np.float32)), r"'dense_features': shape \[2, 4\]"),
    (lambda r: r.update(dense_features=np.zeros((3, 3), np.float32)), "batch sizes disagree"),
    (lambda r: r.update(sparse_lengths=np.array([[1, -2], [0, 1]], np.int32)), "negative length -2"),
    (lambda r: r.update(sparse_indices=np.array([9, 19, 0], np.int64)), "sums to 4 ids but 'sparse_indices' has 3"),
    (lambda r: r.update(sparse_indices=np.array([9, 20, 0, 5], np.int64)), r"id 20 at position 1 is out of range for table 1"),
    (lambda r: r.update(sparse_indices=np.array([-1, 19, 0, 5], np.int64)), "id -1 at position 0"),
    # In range for the larger table 1 but not for table 0, which it belongs to.
    (lambda r: r.update(sparse_indices=np.array([10, 19, 0, 5], np.int64)), r"id 10 at position 0 .* table 0"),
    (lambda r: r.update(extra=np.zeros(1, np.float32)), r"unknown input\(s\) \['extra'\]"),
    (lambda r: r.pop("sparse_lengths"), "missing input 'sparse_lengths'"),
    # As many inputs as the model takes, one of them unknown: the name is reported before another
    # input's wrong datatype or shape (validate_request looks names up as it checks each input).
    (lambda r: r.update(dense_features=r["dense_features"].astype(np.float64), extra=r.pop("sparse_indices")),
     r"unknown input\(s\) \['extra'\]"),
    (lambda r: r.update(dense_features=np.zeros((2, 4), np.float32), extra=r.pop("sparse_indices")),
     r"unknown input\(s\) \['extra'\]"),
])
@pytest.mark.parametrize("path", ["lists", "numpy"])
def test_invalid_requests_name_the_field(mutate, message: str, path: str, monkeypatch) -> None:
    if path == "numpy":  # the checks for arrays too large for the list path, on the same requests
        monkeypatch.setattr(validation, "_SMALL_LENGTHS", 0)
        monkeypatch.setattr(validation, "_SMALL_IDS", 0)
        monkeypatch.setattr(validation, "_SMALL_DENSE", 0)
    request = _good()
    mutate(request)
    with pytest.raises(InvalidInput, match=message):
        validate_request(request, SPECS, ROWS)


def _with_dense(value: float, at: tuple[int, int]) -> dict[str, np.ndarray]:
    request = _good()
    request["dense_features"][at] = value
    return request


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("path", ["lists", "numpy"])
def test_non_finite_dense_features_are_refused_naming_the_first_position(value: float, path: str,
                                                                         monkeypatch) -> None:
    if path == "numpy":
        monkeypatch.setattr(validation, "_SMALL_DENSE", 0)
    request = _with_dense(value, (1, 2))
    request["dense_features"][1, 1] = value
    with pytest.raises(InvalidInput, match=rf"'dense_features': non-finite value {value} at \[1, 1\] \(2 in all\)"):
        validate_request(request, SPECS, ROWS)
    assert validate_request(_with_dense(value, (1, 2)), SPECS, ROWS, allow_nonfinite=True) == 2


def test_an_empty_query_is_valid() -> None:
    empty = {"dense_features": np.zeros((0, 3), np.float32), "sparse_lengths": np.zeros((0, 2), np.int32),
             "sparse_indices": np.zeros((0,), np.int64)}
    assert validate_request(empty, SPECS, ROWS) == 0


def test_encode_response_round_trips() -> None:
    scores = np.arange(4, dtype=np.float32).reshape(4, 1)
    response = encode_response("m", "1", "abc", {"scores": scores})
    assert response.outputs[0].datatype == "FP32" and list(response.outputs[0].shape) == [4, 1]
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32).reshape(4, 1), scores)


def _field_by_field(model: str, version: str, request_id: str, outputs: dict) -> service_pb2.ModelInferResponse:
    """The response as the protocol defines it, built field by field (what encode_response's templates must equal)."""
    names = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.int64): "INT64"}
    response = service_pb2.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for name, array in outputs.items():
        response.outputs.add(name=name, datatype=names[array.dtype], shape=list(array.shape))
        response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response


def test_encode_response_is_the_same_for_every_request_of_a_size_and_any_strides() -> None:
    """Responses copied from a cached template carry each request's own id and bytes, and a new
    template for a new size, dtype, model or version; a transposed (non-contiguous) output is sent in C order."""
    rng = np.random.default_rng(0)
    cases = [("m", "1", {"scores": rng.random((4, 1), dtype=np.float32)}),
             ("m", "1", {"scores": rng.random((4, 1), dtype=np.float32)}),  # same key, other bytes
             ("m", "1", {"scores": rng.random((2, 1), dtype=np.float32)}),
             ("m", "2", {"scores": rng.random((2, 1), dtype=np.float32)}),
             ("n", "1", {"scores": rng.random((2, 1)), "ids": np.arange(6, dtype=np.int64).reshape(2, 3)}),
             ("n", "1", {"scores": rng.random((3, 2), dtype=np.float32).T})]
    for i, (model, version, outputs) in enumerate(cases):
        for request_id in (f"r{i}", ""):
            got = encode_response(model, version, request_id, outputs)
            assert got == _field_by_field(model, version, request_id, outputs)


def test_encode_response_refuses_an_unsupported_output_dtype_every_time() -> None:
    for _ in range(2):  # a failed template is not kept
        with pytest.raises(InvalidInput, match="unsupported output dtype complex64"):
            encode_response("m", "1", "x", {"scores": np.zeros((1, 1), np.complex64)})


def test_encode_response_templates_stay_bounded(monkeypatch) -> None:
    from sixfold.server.protocol import codec

    monkeypatch.setattr(codec, "_MAX_RESPONSE_TEMPLATES", 4)
    monkeypatch.setattr(codec, "_RESPONSE_TEMPLATES", {})
    for rows in range(1, 11):  # ten sizes through a cache of four
        outputs = {"scores": np.full((rows, 1), rows, np.float32)}
        assert encode_response("m", "1", str(rows), outputs) == _field_by_field("m", "1", str(rows), outputs)
        assert len(codec._RESPONSE_TEMPLATES) <= 4
