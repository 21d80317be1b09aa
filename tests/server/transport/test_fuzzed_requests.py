"""Requests a fuzzer sent a real server (REST and stock tritonclient gRPC over 127.0.0.1): every one is
refused with the client's status (400 / INVALID_ARGUMENT / NOT_FOUND) naming the field, never 500,
INTERNAL or RESOURCE_EXHAUSTED; client strings echo at most 256 characters; the server keeps serving."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException
import grpc

from sixfold.server.errors import clip, clip_names
from sixfold.server.protocol.codec import MAX_TENSOR_ELEMENTS

from tests.server.transport.test_http import ATOL, _DATATYPES, json_request, raw

HUGE = "x" * 100_000


@pytest.fixture(scope="module")
def small_request():
    from sixfold import models
    from tests.server.conftest import MAX_ROWS
    gen = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=5)
    request = gen.make(2)
    request["sparse_lengths"][:] = 4
    request["sparse_indices"] = request["sparse_indices"][:256]
    return request


def _rest_still_serves(served, request) -> None:
    code, _, content = raw(served.http_url, "POST", "/v2/models/rm2/infer", json.dumps(json_request(request)).encode())
    assert code == 200, content
    scores = np.asarray(json.loads(content)["outputs"][0]["data"], np.float32).reshape(2, 1)
    np.testing.assert_allclose(scores, served.expected(request), atol=ATOL, rtol=0)


def _grpc_infer(url: str, request, *, model: str = "rm2", rename: dict | None = None, outputs=None):
    with tc.InferenceServerClient(url) as client:
        inputs = []
        for name, array in request.items():
            item = tc.InferInput((rename or {}).get(name, name), list(array.shape), _DATATYPES[array.dtype])
            item.set_data_from_numpy(array)
            inputs.append(item)
        return client.infer(model, inputs, outputs=outputs)


def test_clip() -> None:
    assert clip("abc") == "abc"
    assert clip("x" * 256) == "x" * 256
    assert clip(HUGE) == "x" * 256 + "... (100000 characters)"
    assert clip_names(["a", HUGE]) == f"['a', '{'x' * 256}... (100000 characters)']"
    assert clip_names(str(i) for i in range(10)).endswith(", ... (10 in all)]")


def _set_input(key: str, value):
    def change(body: dict) -> None:
        body["inputs"][0][key] = value
    return change


def _set_body(key: str, value):
    def change(body: dict) -> None:
        body[key] = value
    return change


TYPE_CONFUSIONS = [  # (id, mutate, words the message must hold)
    ("datatype object", _set_input("datatype", {}), ['inputs[0].datatype: expected a string such as "FP32", got an object']),
    ("datatype list", _set_input("datatype", ["FP32"]), ["inputs[0].datatype", "got a list"]),
    ("datatype number", _set_input("datatype", 32), ["inputs[0].datatype", "got a number"]),
    ("datatype bool", _set_input("datatype", True), ["inputs[0].datatype", "got a boolean"]),
    ("datatype null", _set_input("datatype", None), ["inputs[0].datatype", "got null"]),
    ("name object", _set_input("name", {}), ["inputs[0].name", "got an object"]),
    ("name number", _set_input("name", 7), ["inputs[0].name", "got a number"]),
    ("shape object", _set_input("shape", {}), ["inputs[0].shape", "got an object"]),
    ("shape string", _set_input("shape", "2,13"), ["inputs[0].shape", "got a string"]),
    ("shape missing", lambda b: b["inputs"][0].pop("shape"), ["inputs[0].shape", "missing"]),
    ("shape nested", _set_input("shape", [[2, 13]]), ["inputs[0].shape[0]", "got a list"]),
    ("shape float", _set_input("shape", [2, 13.0]), ["inputs[0].shape[1]", "got a number"]),
    ("shape bool", _set_input("shape", [True, 13]), ["inputs[0].shape[0]", "got a boolean"]),
    ("shape string dim", _set_input("shape", ["2", 13]), ["inputs[0].shape[0]", "got a string"]),
    ("shape past int64", _set_input("shape", [2 ** 70, 0]), ["dense_features", str(MAX_TENSOR_ELEMENTS)]),
    ("shape too many dims", _set_input("shape", [1] * 40), ["dense_features", "40 dimensions"]),
    ("data object", _set_input("data", {}), ["inputs[0].data", "dense_features", "got an object"]),
    ("data string", _set_input("data", "1,2,3"), ["inputs[0].data", "got a string"]),
    ("data number", _set_input("data", 1.5), ["inputs[0].data", "got a number"]),
    ("data null", _set_input("data", None), ["inputs[0].data", "got null"]),
    ("data of objects", _set_input("data", [{}] * 512), ["dense_features", "FP32"]),
    ("data of nulls", _set_input("data", [None] * 512), ["dense_features", "FP32"]),
    ("data of bools", _set_input("data", [True] * 512), ["dense_features", "booleans"]),
    ("data too deep", _set_input("data", [[[[1.0] * 256]]]), ["dense_features", "256 values"]),  # any nesting of the right count is read, as Triton does
    ("data mixed nesting", _set_input("data", [[1.0] * 256, [[1.0] * 256]]), ["dense_features"]),
    ("data deeper than numpy", _set_input("data", json.loads("[" * 70 + "1.0" + "]" * 70)), ["dense_features"]),
    ("data mixed depth", _set_input("data", [[1.0] * 256, 1.0]), ["dense_features"]),
    ("input not an object", lambda b: b["inputs"].__setitem__(0, "dense"), ["inputs[0]", "got a string"]),
    ("inputs object", _set_body("inputs", {}), ["'inputs'", "got an object"]),
    ("inputs string", _set_body("inputs", "x"), ["'inputs'", "got a string"]),
    ("parameters list", _set_body("parameters", []), ["parameters", "got a list"]),
    ("input parameters list", _set_input("parameters", [1]), ["inputs[0].parameters", "got a list"]),
    ("binary_data_size string", _set_input("parameters", {"binary_data_size": "8"}), ["binary_data_size"]),
    ("shm region number", _set_input("parameters", {"shared_memory_region": 1, "shared_memory_byte_size": 8}),
     ["shared_memory_region", "got a number"]),
    ("outputs object", _set_body("outputs", {}), ["'outputs'", "got an object"]),
    ("output name list", _set_body("outputs", [{"name": ["scores"]}]), ["outputs[0].name", "got a list"]),
    ("output parameters string", _set_body("outputs", [{"name": "scores", "parameters": "x"}]),
     ["outputs[0].parameters"]),
    ("output binary_data string", _set_body("outputs", [{"name": "scores", "parameters": {"binary_data": "yes"}}]),
     ["outputs[0].parameters.binary_data", "got a string"]),
    ("id number", _set_body("id", 5), ["id", "got a number"]),
    ("binary_data_output number", _set_body("parameters", {"binary_data_output": 1}), ["binary_data_output"]),
    ("timeout float", _set_body("parameters", {"timeout": 1.5}), ["timeout", "got a number"]),
    ("priority bool", _set_body("parameters", {"priority": True}), ["priority", "got a boolean"]),
]


@pytest.mark.parametrize("mutate,words", [c[1:] for c in TYPE_CONFUSIONS], ids=[c[0] for c in TYPE_CONFUSIONS])
def test_rest_type_confusions_are_400_naming_the_field(served_rm2, small_request, mutate, words) -> None:
    body = json_request(small_request)
    assert body["inputs"][0]["name"] == "dense_features"
    mutate(body)
    code, headers, content = raw(served_rm2.http_url, "POST", "/v2/models/rm2/infer", json.dumps(body).encode())
    assert code == 400, content
    assert headers["content-type"] == "application/json"
    message = json.loads(content)["error"]
    for word in words:
        assert word in message, message
    _rest_still_serves(served_rm2, small_request)


@pytest.mark.parametrize("shape", [[2 ** 40, 1], [2 ** 31, 2 ** 31, 2 ** 31], [2 ** 62, 0, 2 ** 62]])
def test_huge_shapes_are_refused_naming_the_input_and_the_limit(served_rm2, small_request, shape) -> None:
    # gRPC, typed contents (what tritonclient cannot send, so the raw stub does)
    request = service_pb2.ModelInferRequest(model_name="rm2")
    tensor = request.inputs.add(name="dense_features", datatype="FP32", shape=shape)
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    with grpc.insecure_channel(served_rm2.url) as channel:
        with pytest.raises(grpc.RpcError) as err:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "dense_features" in err.value.details() and str(MAX_TENSOR_ELEMENTS) in err.value.details()
    # gRPC, raw bytes (0 bytes for a shape with a zero dimension)
    del tensor.contents.fp32_contents[:]
    request.raw_input_contents.append(b"" if 0 in shape else b"\0" * 8)
    with grpc.insecure_channel(served_rm2.url) as channel:
        with pytest.raises(grpc.RpcError) as err:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "dense_features" in err.value.details()
    # REST, JSON data and binary data
    body = json_request(small_request)
    body["inputs"][0]["shape"] = shape
    code, _, content = raw(served_rm2.http_url, "POST", "/v2/models/rm2/infer", json.dumps(body).encode())
    assert code == 400, content
    message = json.loads(content)["error"]
    assert "dense_features" in message and str(MAX_TENSOR_ELEMENTS) in message, message
    header = json.dumps({"inputs": [{"name": "dense_features", "datatype": "FP32", "shape": shape,
                                     "parameters": {"binary_data_size": 0}}]}).encode()
    code, _, content = raw(served_rm2.http_url, "POST", "/v2/models/rm2/infer", header,
                           {"Inference-Header-Content-Length": str(len(header))})
    assert code == 400 and str(MAX_TENSOR_ELEMENTS) in json.loads(content)["error"], content
    _rest_still_serves(served_rm2, small_request)
    np.testing.assert_allclose(_grpc_infer(served_rm2.url, small_request).as_numpy("scores"),
                               served_rm2.expected(small_request), atol=ATOL, rtol=0)


CLIPPED = "x" * 256 + "... (100000 characters)"


def _assert_clipped(message: str) -> None:
    assert CLIPPED in message, message[:600]
    assert "x" * 257 not in message
    assert len(message) < 2000


def test_huge_names_get_the_real_error_over_grpc(served_rm2, small_request) -> None:
    cases = [  # (kwargs, status)
        ({"model": HUGE}, "StatusCode.NOT_FOUND"),
        ({"rename": {"dense_features": HUGE}}, "StatusCode.INVALID_ARGUMENT"),
        ({"outputs": [tc.InferRequestedOutput(HUGE)]}, "StatusCode.INVALID_ARGUMENT"),
    ]
    for kwargs, status in cases:
        with pytest.raises(InferenceServerException) as err:
            _grpc_infer(served_rm2.url, small_request, **kwargs)
        assert err.value.status() == status, (err.value.status(), str(err.value)[:300])
        _assert_clipped(err.value.message())
    with tc.InferenceServerClient(served_rm2.url) as client:
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata(HUGE)
        assert err.value.status() == "StatusCode.NOT_FOUND"
        _assert_clipped(err.value.message())
    # a parameter key: a huge unknown key is ignored like any unknown key, and a huge shm region name is clipped
    with tc.InferenceServerClient(served_rm2.url) as client:
        inputs = []
        for name, array in small_request.items():
            item = tc.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
            item.set_data_from_numpy(array)
            inputs.append(item)
        inputs[0].set_shared_memory(HUGE, small_request["dense_features"].nbytes)
        with pytest.raises(InferenceServerException) as err:
            client.infer("rm2", inputs)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", str(err.value)[:300]
        _assert_clipped(err.value.message())
    np.testing.assert_allclose(_grpc_infer(served_rm2.url, small_request).as_numpy("scores"),
                               served_rm2.expected(small_request), atol=ATOL, rtol=0)


def test_huge_names_get_the_real_error_over_rest(served_rm2, small_request) -> None:
    url = served_rm2.http_url
    body = json_request(small_request)
    code, _, content = raw(url, "POST", f"/v2/models/{HUGE}/infer", json.dumps(body).encode())
    assert code == 404, content[:300]
    _assert_clipped(json.loads(content)["error"])
    renamed = json.loads(json.dumps(body))
    renamed["inputs"][0]["name"] = HUGE
    code, _, content = raw(url, "POST", "/v2/models/rm2/infer", json.dumps(renamed).encode())
    assert code == 400, content[:300]
    _assert_clipped(json.loads(content)["error"])
    code, _, content = raw(url, "POST", "/v2/models/rm2/infer",
                           json.dumps({**body, "outputs": [{"name": HUGE}]}).encode())
    assert code == 400, content[:300]
    _assert_clipped(json.loads(content)["error"])
    renamed["inputs"][0]["datatype"] = HUGE
    code, _, content = raw(url, "POST", "/v2/models/rm2/infer", json.dumps(renamed).encode())
    assert code == 400, content[:300]
    assert json.loads(content)["error"].count(CLIPPED) == 2
    _rest_still_serves(served_rm2, small_request)


def test_405_carries_an_allow_header(served_rm2) -> None:
    url = served_rm2.http_url
    for method, path, allowed in [("GET", "/v2/models/rm2/infer", "POST"),
                                  ("PUT", "/v2/models/rm2/versions/1/infer", "POST"),
                                  ("POST", "/v2/health/live", "GET, HEAD"),
                                  ("DELETE", "/v2/models/rm2", "GET, HEAD"),
                                  ("GET", "/v2/systemsharedmemory/region/r/register", "POST")]:
        code, headers, content = raw(url, method, path)
        assert code == 405, (method, path, content)
        assert headers.get("allow") == allowed, (method, path, headers)
        assert method in json.loads(content)["error"]
    assert raw(url, "GET", "/v2/health/ready")[0] == 200
