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
