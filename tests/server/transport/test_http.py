"""KServe v2 REST over real loopback HTTP: stock tritonclient.http (sync and aio) and raw requests.

The same server also speaks gRPC (the shared ``served_rm2`` fixture): REST answers
must equal gRPC's and the unsplit model's, and bad requests get a status and a
message naming the field, after which the server still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
import tritonclient.http.aio as tha
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.server.app import ServerConfig

from tests.server.conftest import MAX_ROWS

ATOL = 1e-4
_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}


@pytest.fixture(scope="module")
def gen():
    return models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=23)


@contextlib.contextmanager
def http_client(url: str) -> Iterator[th.InferenceServerClient]:
    """tritonclient.http's client, closed once in this thread. NOTE: its __del__ closes it again, and
    if the garbage collector runs that on another thread (the server's), gevent refuses it loudly."""
    client = th.InferenceServerClient(url, network_timeout=60.0)
    try:
        yield client
    finally:
        client.close()
        client.close = lambda: None


@pytest.fixture
def client(served_rm2):
    with http_client(served_rm2.http_url) as c:
        yield c


def http_inputs(module, request: dict[str, np.ndarray], binary: bool) -> list:
    inputs = []
    for name, array in request.items():
        item = module.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    return inputs


def grpc_scores(url: str, request: dict[str, np.ndarray]) -> np.ndarray:
    with tc.InferenceServerClient(url) as grpc_client:
        inputs = []
        for name, array in request.items():
            item = tc.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
            item.set_data_from_numpy(array)
            inputs.append(item)
        return grpc_client.infer("rm2", inputs).as_numpy("scores")


def test_health_metadata_config_and_statistics(client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("rm2") and client.is_model_ready("rm2", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("rm2", "7")
    server = client.get_server_metadata()
    assert server["name"] == "sixfold" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("rm2")
    assert meta["versions"] == ["1"]
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("dense_features", "FP32", [-1, 256]), ("sparse_lengths", "INT32", [-1, 32]), ("sparse_indices", "INT64", [-1])]
    assert client.get_model_metadata("rm2", "1") == meta
    config = client.get_model_config("rm2")
    assert config.get("max_batch_size", 0) == 0  # proto3 JSON leaves zeros out
    assert config["input"][2] == {"name": "sparse_indices", "data_type": "TYPE_INT64", "dims": [-1]}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["parameters"]["sixfold.table_rows"]["string_value"] == ",".join([str(MAX_ROWS)] * 32)
    stats = client.get_inference_statistics("rm2")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("rm2", "1")]
    assert set(stats[0]["inference_stats"]) >= {"success", "fail", "queue", "compute_infer"}
    assert client.get_inference_statistics()["model_stats"][0]["name"] == "rm2"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "404"


def test_statistics_count_rest_requests(client, gen) -> None:
    before = client.get_inference_statistics("rm2")["model_stats"][0]["inference_stats"]["success"]["count"]
    client.infer("rm2", http_inputs(th, gen.make(3), binary=True))
    after = client.get_inference_statistics("rm2")["model_stats"][0]["inference_stats"]["success"]["count"]
    assert after == before + 1


@pytest.mark.parametrize("binary_in,binary_out", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("items", [1, 16, 300])
def test_rest_scores_equal_grpc_and_the_model(client, served_rm2, gen, items: int, binary_in: bool,
                                              binary_out: bool) -> None:
    request = gen.make(items)
    result = client.infer("rm2", http_inputs(th, request, binary_in),
                          outputs=[th.InferRequestedOutput("scores", binary_data=binary_out)], request_id="q7")
    response = result.get_response()
    assert response["id"] == "q7" and response["model_version"] == "1"
    assert ("data" in response["outputs"][0]) != binary_out
    scores = result.as_numpy("scores")
    assert scores.shape == (items, 1) and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, grpc_scores(served_rm2.url, request))
    np.testing.assert_allclose(scores, served_rm2.expected(request), atol=ATOL, rtol=0)


def test_no_outputs_named_means_all_outputs_binary(client, served_rm2, gen) -> None:
    request = gen.make(5)
    result = client.infer("rm2", http_inputs(th, request, binary=False), model_version="1", priority=0,
                          timeout=60_000_000)
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 5 * 4
    np.testing.assert_allclose(result.as_numpy("scores"), served_rm2.expected(request), atol=ATOL, rtol=0)


def test_gzip_and_deflate_request_bodies(client, served_rm2, gen) -> None:
    request = gen.make(20)
    for algorithm in ("gzip", "deflate"):
        scores = client.infer("rm2", http_inputs(th, request, binary=True),
                              request_compression_algorithm=algorithm).as_numpy("scores")
        np.testing.assert_allclose(scores, served_rm2.expected(request), atol=ATOL, rtol=0)


async def test_concurrent_mixed_sizes_through_the_aio_client(served_rm2, gen) -> None:
    sizes = [1, 700, 5, 200, 64, 3, 100, 450, 1, 20, 300, 9]
    requests = [gen.make(n) for n in sizes]
    async with tha.InferenceServerClient(served_rm2.http_url) as aio_client:
        assert await aio_client.is_server_ready() and await aio_client.is_model_ready("rm2")
        results = await asyncio.gather(*(
            aio_client.infer("rm2", http_inputs(tha, r, binary=i % 2 == 0),
                             outputs=[tha.InferRequestedOutput("scores", binary_data=i % 3 == 0)])
            for i, r in enumerate(requests)))
    for request, result in zip(requests, results):
        np.testing.assert_allclose(result.as_numpy("scores"), served_rm2.expected(request), atol=ATOL, rtol=0)


# ---- raw HTTP (what curl sends): each error answers a status and names the field -------------------------------

def raw(http_url: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection: status, headers (lower-case names), body."""
    host, port = http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def json_request(request: dict[str, np.ndarray]) -> dict:
    return {"inputs": [{"name": k, "datatype": _DATATYPES[a.dtype], "shape": list(a.shape), "data": a.tolist()}
                       for k, a in request.items()]}


def _tensor(body: dict, name: str) -> dict:
    return next(t for t in body["inputs"] if t["name"] == name)


def _set(name: str, key: str, value) -> Callable[[dict], None]:
    def change(body: dict) -> None:
        _tensor(body, name)[key] = value
    return change


def _drop_last_id(body: dict) -> None:
    ids = _tensor(body, "sparse_indices")
    ids["data"] = ids["data"][:-1]
    ids["shape"] = [len(ids["data"])]


def _id_out_of_range(body: dict) -> None:
    _tensor(body, "sparse_indices")["data"][0] = MAX_ROWS


JSON_ERRORS = [
    ("unknown dtype", _set("dense_features", "datatype", "FP8"), 400, ["dense_features", "FP8"]),
    ("dtype the model does not take", _set("dense_features", "datatype", "FP64"), 400, ["dense_features", "FP32"]),
    ("wrong shape", _set("dense_features", "shape", [256, 2]), 400, ["dense_features", "[256, 2]"]),
    ("values vs shape", _set("dense_features", "data", [1.0, 2.0, 3.0]), 400, ["dense_features", "3 values"]),
    ("float ids", _set("sparse_indices", "data", [0.5] * 256), 400, ["sparse_indices", "INT64"]),
    ("string values", _set("sparse_lengths", "data", ["4"] * 64), 400, ["sparse_lengths", "strings"]),
    ("ragged data", _set("dense_features", "data", [[1.0], [1.0, 2.0]]), 400, ["dense_features", "ragged"]),
    ("ids past INT64", _set("sparse_indices", "data", [2 ** 70] * 256), 400, ["sparse_indices", "INT64"]),
    ("lengths vs ids", _drop_last_id, 400, ["sparse_lengths", "sparse_indices"]),
    ("id out of range", _id_out_of_range, 400, ["sparse_indices", f"id {MAX_ROWS}", "table 0"]),
    ("missing data", lambda b: _tensor(b, "sparse_lengths").pop("data"), 400, ["sparse_lengths", "'data'"]),
    ("no inputs", lambda b: b.pop("inputs"), 400, ["'inputs'"]),
    ("unknown output", lambda b: b.update(outputs=[{"name": "logits"}]), 400, ["logits"]),
    ("bad priority", lambda b: b.update(parameters={"priority": -1}), 400, ["priority"]),
    ("bad timeout", lambda b: b.update(parameters={"timeout": "1s"}), 400, ["timeout"]),
]


@pytest.mark.parametrize("mutate,status,words", [c[1:] for c in JSON_ERRORS], ids=[c[0] for c in JSON_ERRORS])
def test_json_request_errors_name_the_field_and_the_server_keeps_serving(served_rm2, gen, mutate, status,
                                                                         words) -> None:
    request = gen.make(2)
    request["sparse_lengths"][:] = 4  # 2 items x 32 tables x 4 ids: small enough to edit
    request["sparse_indices"] = request["sparse_indices"][:256]
    body = json_request(request)
    mutate(body)
    code, headers, content = raw(served_rm2.http_url, "POST", "/v2/models/rm2/infer", json.dumps(body).encode())
    assert code == status, content
    assert headers["content-type"] == "application/json"
    message = json.loads(content)["error"]
    for word in words:
        assert word in message, message
    # ...and a good request still works
    code, _, content = raw(served_rm2.http_url, "POST", "/v2/models/rm2/infer",
                           json.dumps(json_request(request)).encode())
    assert code == 200, content
    scores = np.asarray(json.loads(content)["outputs"][0]["data"], dtype=np.float32).reshape(2, 1)
    np.testing.assert_allclose(scores, served_rm2.expected(request), atol=ATOL, rtol=0)


def binary_body(request: dict[str, np.ndarray], sizes: dict[str, int] | None = None) -> tuple[bytes, int]:
    sizes = sizes or {}
    header = json.dumps({"inputs": [
        {"name": k, "datatype": _DATATYPES[a.dtype], "shape": list(a.shape),
         "parameters": {"binary_data_size": sizes.get(k, a.nbytes)}} for k, a in request.items()]}).encode()
    return header + b"".join(a.tobytes() for a in request.values()), len(header)


def test_body_and_header_errors(served_rm2, gen) -> None:
    url = served_rm2.http_url
    request = gen.make(2)
    body, json_length = binary_body(request)
    good = {"Inference-Header-Content-Length": str(json_length)}
    cases = [  # (path, body, headers, status, words)
        ("/v2/models/nope/infer", body, good, 404, ["'nope'"]),
        ("/v2/models/rm2/versions/9/infer", body, good, 404, ["version '9'"]),
        ("/v2/models/rm2/infer", b'{"inputs": [', {}, 400, ["not valid JSON"]),
        ("/v2/models/rm2/infer", b'[1, 2]', {}, 400, ["JSON object"]),
        ("/v2/models/rm2/infer", b"[" * 100_000, {}, 400, ["nested too deeply"]),
        ("/v2/models/rm2/infer", body, {"Inference-Header-Content-Length": "abc"}, 400,
         ["Inference-Header-Content-Length", "'abc'"]),
        ("/v2/models/rm2/infer", body, {"Inference-Header-Content-Length": str(len(body) + 1)}, 400,
         ["Inference-Header-Content-Length", f"{len(body)} bytes"]),
        ("/v2/models/rm2/infer", body + b"xx", good, 400, ["2 bytes", "no input"]),
        ("/v2/models/rm2/infer", binary_body(request, {"dense_features": 12})[0],
         {"Inference-Header-Content-Length": str(binary_body(request, {"dense_features": 12})[1])}, 400,
         ["dense_features", "binary_data_size is 12", "needs 2048"]),
        ("/v2/models/rm2/infer", body[:-8], good, 400, ["sparse_indices", "runs past"]),
        ("/v2/models/rm2/infer", body, {**good, "Content-Encoding": "br"}, 400, ["Content-Encoding", "br"]),
        ("/v2/models/rm2/infer", body, {**good, "Content-Encoding": "gzip"}, 400, ["gzip"]),
        ("/v2/nothing/here", b"", {}, 404, ["/v2/nothing/here"]),
    ]
    for path, content, headers, status, words in cases:
        code, _, answer = raw(url, "POST", path, content, headers)
        assert code == status, (path, headers, answer)
        message = json.loads(answer)["error"]
        assert all(word in message for word in words), (words, message)
    code, _, answer = raw(url, "GET", "/v2/models/rm2/infer")
    assert code == 405 and "GET" in json.loads(answer)["error"]
    code, headers, answer = raw(url, "POST", "/v2/models/rm2/infer", body, good)
    assert code == 200, answer
    assert "inference-header-content-length" not in headers  # no binary output asked: all JSON
    np.testing.assert_allclose(np.asarray(json.loads(answer)["outputs"][0]["data"], np.float32).reshape(2, 1),
                               served_rm2.expected(request), atol=ATOL, rtol=0)


def test_declared_body_over_the_limit_is_refused_before_it_is_read(served_rm2) -> None:
    host, port = served_rm2.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v2/models/rm2/infer")
        conn.putheader("Content-Length", str(2 << 30))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413
        limit = ServerConfig().max_message_bytes
        assert f"over the {limit}-byte limit" in json.loads(response.read())["error"]
    finally:
        conn.close()
    assert raw(served_rm2.http_url, "GET", "/v2/health/ready")[0] == 200


def test_binary_output_of_a_raw_request_has_the_header_length(served_rm2, gen) -> None:
    request = gen.make(3)
    header = json.dumps({"inputs": json_request(request)["inputs"], "parameters": {"binary_data_output": True},
                         "id": "raw-1"}).encode()
    code, headers, answer = raw(served_rm2.http_url, "POST", "/v2/models/rm2/versions/1/infer", header,
                                {"Content-Type": "application/json"})
    assert code == 200
    json_length = int(headers["inference-header-content-length"])
    meta = json.loads(answer[:json_length])
    assert meta["id"] == "raw-1" and meta["outputs"][0]["parameters"] == {"binary_data_size": 12}
    scores = np.frombuffer(answer[json_length:], np.float32).reshape(3, 1)
    np.testing.assert_allclose(scores, served_rm2.expected(request), atol=ATOL, rtol=0)


def test_repository_endpoints_without_a_repository_say_so(served_rm2) -> None:
    code, _, answer = raw(served_rm2.http_url, "POST", "/v2/repository/index", b"")
    assert code == 503 and "no model repository" in json.loads(answer)["error"]
