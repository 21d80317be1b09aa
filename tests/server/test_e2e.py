"""End to end over real loopback gRPC with the stock tritonclient: answers equal the unsplit model."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sixfold import models
from tests.conftest import triton_inputs

from tests.server.conftest import MAX_ROWS

ATOL = 1e-4


@pytest.fixture(scope="module")
def gen():
    return models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=11)


@pytest.fixture
def client(served_rm2):
    with tc.InferenceServerClient(served_rm2.url) as c:
        yield c


@pytest.fixture
def stub(served_rm2):
    channel = grpc.insecure_channel(served_rm2.url, options=[("grpc.max_receive_message_length", 1 << 30),
                                                             ("grpc.max_send_message_length", 1 << 30)])
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def test_health_metadata_and_config(client, served_rm2) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("rm2")
    assert not client.is_model_ready("nope")
    assert client.get_server_metadata().name == "sixfold"
    meta = client.get_model_metadata("rm2")
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
        ("dense_features", "FP32", [-1, 256]), ("sparse_lengths", "INT32", [-1, 32]), ("sparse_indices", "INT64", [-1])]
    assert [(o.name, list(o.shape)) for o in meta.outputs] == [("scores", [-1, 1])]
    config = client.get_model_config("rm2").config
    assert config.max_batch_size == 0 and list(config.input[2].dims) == [-1]
    assert config.parameters["sixfold.table_rows"].string_value == ",".join([str(MAX_ROWS)] * 32)
    assert config.parameters["sixfold.pooling"].string_value.startswith("120,")


def test_standard_grpc_health_service(served_rm2) -> None:
    with grpc.insecure_channel(served_rm2.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("items", [1, 2, 37, 300, 1500])
def test_sync_client_scores_equal_the_model(client, served_rm2, gen, items: int) -> None:
    request = gen.make(items)
    result = client.infer("rm2", triton_inputs(tc, request), outputs=[tc.InferRequestedOutput("scores")])
    np.testing.assert_allclose(result.as_numpy("scores"), served_rm2.expected(request), atol=ATOL, rtol=0)


async def test_concurrent_mixed_sizes_through_the_asyncio_client(served_rm2, gen) -> None:
    sizes = [1, 700, 5, 200, 64, 3, 100, 450, 1, 20, 300, 9, 1000, 2, 150, 33]
    requests = [gen.make(n) for n in sizes]
    async with tca.InferenceServerClient(served_rm2.url) as client:
        results = await asyncio.gather(*(client.infer("rm2", triton_inputs(tca, r)) for r in requests))
    for request, result in zip(requests, results):
        np.testing.assert_allclose(result.as_numpy("scores"), served_rm2.expected(request), atol=ATOL, rtol=0)


@pytest.mark.parametrize("items", [1, 37, 300])
def test_int32_ids_score_like_int64_ones(client, served_rm2, gen, items: int) -> None:
    """A table-batched model takes INT32 ids too (half the bytes on the wire); metadata still says INT64."""
    request = gen.make(items)
    narrow = {**request, "sparse_indices": request["sparse_indices"].astype(np.int32)}
    inputs = triton_inputs(tc, narrow)
    assert inputs[2].datatype() == "INT32"
    result = client.infer("rm2", inputs, outputs=[tc.InferRequestedOutput("scores")])
    np.testing.assert_allclose(result.as_numpy("scores"), served_rm2.expected(request), atol=ATOL, rtol=0)
    bad = narrow["sparse_indices"].copy()
    bad[-1] = -1  # a negative int32 id is still caught by the one-pass unsigned check
    _expect_error(client, "rm2", {**narrow, "sparse_indices": bad}, "StatusCode.INVALID_ARGUMENT",
                  "sparse_indices", "id -1", "out of range")
    _expect_error(client, "rm2", {**request, "sparse_indices": request["sparse_indices"].astype(np.int16)},
                  "StatusCode.INVALID_ARGUMENT", "'sparse_indices': datatype INT16 but the model expects INT64 or INT32")


@pytest.mark.parametrize("transport", ["raw", "tritonclient"])
async def test_a_loadgen_run_with_int32_ids_is_served_without_errors(served_rm2, transport: str) -> None:
    from sixfold.loadgen import LoadConfig, run_load_async

    config = LoadConfig(url=served_rm2.url, model="rm2", qps=20.0, duration_s=1.0, query_size="mlperf",
                        wait_ready_s=10.0, drain_timeout_s=10.0, pool=4, arrival="constant", client=transport,
                        ids_dtype="int32")
    report = await run_load_async(config)
    assert report.requests["sent"] == report.requests["ok"] == 20, report.errors_by_reason


def _typed_request(request: dict[str, np.ndarray]) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="rm2")
    for name, datatype, field in (("dense_features", "FP32", "fp32_contents"),
                                  ("sparse_lengths", "INT32", "int_contents"),
                                  ("sparse_indices", "INT64", "int64_contents")):
        tensor = message.inputs.add(name=name, datatype=datatype, shape=request[name].shape)
        getattr(tensor.contents, field).extend(request[name].ravel().tolist())
    return message


def test_typed_contents_are_served_too(stub, served_rm2, gen) -> None:
    request = gen.make(6)
    response = stub.ModelInfer(_typed_request(request))
    scores = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(6, 1)
    np.testing.assert_allclose(scores, served_rm2.expected(request), atol=ATOL, rtol=0)


def test_an_empty_query_gets_an_empty_answer(client) -> None:
    empty = {"dense_features": np.zeros((0, 256), np.float32), "sparse_lengths": np.zeros((0, 32), np.int32),
             "sparse_indices": np.zeros((0,), np.int64)}
    assert client.infer("rm2", triton_inputs(tc, empty)).as_numpy("scores").shape == (0, 1)


def _expect_error(client, model: str, request: dict[str, np.ndarray], status: str, *fragments: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, triton_inputs(tc, request))
    assert info.value.status() == status, info.value
    for fragment in fragments:
        assert fragment in info.value.message()


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(client, served_rm2, gen) -> None:
    good = gen.make(4)
    bad_id = {**good, "sparse_indices": good["sparse_indices"].copy()}
    bad_id["sparse_indices"][3] = MAX_ROWS
    _expect_error(client, "rm2", bad_id, "StatusCode.INVALID_ARGUMENT", "sparse_indices", "out of range")
    _expect_error(client, "nope", good, "StatusCode.NOT_FOUND", "unknown model 'nope'")
    _expect_error(client, "rm2", {**good, "dense_features": good["dense_features"].astype(np.int32)},
                  "StatusCode.INVALID_ARGUMENT", "dense_features", "datatype INT32")
    _expect_error(client, "rm2", {**good, "sparse_indices": good["sparse_indices"][:-1]},
                  "StatusCode.INVALID_ARGUMENT", "sparse_lengths", "sparse_indices")
    result = client.infer("rm2", triton_inputs(tc, good))
    np.testing.assert_allclose(result.as_numpy("scores"), served_rm2.expected(good), atol=ATOL, rtol=0)


def test_raw_bytes_short_of_the_shape_over_the_wire(stub, gen) -> None:
    request = gen.make(2)
    message = service_pb2.ModelInferRequest(model_name="rm2")
    for name, datatype in (("dense_features", "FP32"), ("sparse_lengths", "INT32"), ("sparse_indices", "INT64")):
        message.inputs.add(name=name, datatype=datatype, shape=request[name].shape)
        message.raw_input_contents.append(request[name].tobytes())
    message.raw_input_contents[2] = message.raw_input_contents[2][:-8]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sparse_indices" in info.value.details()


def test_nan_features_are_refused_naming_the_input_and_the_server_keeps_serving(client, gen) -> None:
    request = gen.make(3)
    request["dense_features"][1, 4:] = np.nan
    with pytest.raises(InferenceServerException) as info:
        client.infer("rm2", triton_inputs(tc, request))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'dense_features': non-finite value nan at [1, 4]" in info.value.message()
    request["dense_features"][1, :] = 0.5
    scores = client.infer("rm2", triton_inputs(tc, request)).as_numpy("scores")
    assert scores.shape == (3, 1) and np.isfinite(scores).all()


def test_statistics_count_real_work(client, gen) -> None:
    before = client.get_inference_statistics("rm2").model_stats[0]
    client.infer("rm2", triton_inputs(tc, gen.make(10)))
    after = client.get_inference_statistics("rm2").model_stats[0]
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert after.inference_count == before.inference_count + 10
    assert after.execution_count >= before.execution_count + 1
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns


def test_prometheus_metrics_are_exposed(client, served_rm2, gen) -> None:
    client.infer("rm2", triton_inputs(tc, gen.make(5)))
    text = urllib.request.urlopen(f"http://127.0.0.1:{served_rm2.metrics_port}/metrics", timeout=10).read().decode()
    assert 'sixfold_inference_request_success_total{model="rm2"}' in text
    assert "sixfold_card_stage_duration_seconds_bucket" in text and "sixfold_batch_rows_bucket" in text
    # Triton's own names too, so Triton dashboards work unchanged.
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count",
                 "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"):
        assert f'{name}{{model="rm2",version="1"}}' in text, name


def test_requests_refused_before_a_model_are_counted_by_protocol_and_reason(client, served_rm2, gen) -> None:
    import json
    import urllib.error

    def refused(protocol: str, reason: str) -> float:
        page = urllib.request.urlopen(f"http://127.0.0.1:{served_rm2.metrics_port}/metrics", timeout=10).read().decode()
        key = f'sixfold_requests_refused_total{{protocol="{protocol}",reason="{reason}"}} '
        return float(page.split(key, 1)[1].split()[0]) if key in page else 0.0

    before = {p: refused(p, "model_not_found") for p in ("grpc", "rest")}
    with pytest.raises(InferenceServerException):
        client.infer("no-such-model", triton_inputs(tc, gen.make(2)))
    body = json.dumps({"inputs": [{"name": "dense_features", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}]})
    rest = urllib.request.Request(f"http://{served_rm2.http_url}/v2/models/no-such-model/infer", data=body.encode(),
                                  headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(rest, timeout=10)
    assert answer.value.code == 404
    assert {p: refused(p, "model_not_found") for p in ("grpc", "rest")} == {p: v + 1 for p, v in before.items()}


def test_the_timeout_parameter_drops_a_request_before_compute(client, gen) -> None:
    before = client.get_inference_statistics("rm2").model_stats[0].execution_count
    with pytest.raises(InferenceServerException) as info:
        client.infer("rm2", triton_inputs(tc, gen.make(3)), timeout=1)  # 1 microsecond
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED" and "before compute" in info.value.message()
    assert client.get_inference_statistics("rm2").model_stats[0].execution_count == before
    assert client.infer("rm2", triton_inputs(tc, gen.make(3))).as_numpy("scores").shape == (3, 1)


def test_a_grpc_deadline_is_honoured(client, gen) -> None:
    # A generous deadline is met; the server sees and respects it without failing the request.
    result = client.infer("rm2", triton_inputs(tc, gen.make(50)), client_timeout=30)
    assert result.as_numpy("scores").shape == (50, 1)


def test_streaming_answers_every_request_including_errors(served_rm2, gen) -> None:
    requests = {f"q{i}": gen.make(n) for i, n in enumerate([1, 300, 7, 64])}
    bad = gen.make(2)
    bad["sparse_indices"] = bad["sparse_indices"][:-1]
    results: dict[str, object] = {}
    done = __import__("threading").Event()

    def callback(result, error) -> None:
        if error is not None:
            results[f"error:{len(results)}"] = error
        else:
            results[result.get_response().id] = result.as_numpy("scores")
        if len(results) == len(requests) + 1:
            done.set()

    with tc.InferenceServerClient(served_rm2.url) as client:
        client.start_stream(callback=callback)
        for rid, request in requests.items():
            client.async_stream_infer("rm2", triton_inputs(tc, request), request_id=rid)
        client.async_stream_infer("rm2", triton_inputs(tc, bad), request_id="bad")
        assert done.wait(60), results
        client.stop_stream()
    for rid, request in requests.items():
        np.testing.assert_allclose(results[rid], served_rm2.expected(request), atol=ATOL, rtol=0)
    errors = [v for k, v in results.items() if k.startswith("error:")]
    assert len(errors) == 1 and "sparse_indices" in str(errors[0])


def _serve_and_score(partitioned, backend: str, request: dict[str, np.ndarray]) -> np.ndarray:
    """Serve ``partitioned`` on its own loopback server with ``backend`` cards; score one request."""
    from sixfold.server.app import BackgroundServer, ServerConfig
    from sixfold.server.scheduling.batcher import BatchingConfig
    from sixfold.server.core import InferenceCore
    from sixfold.server.loading.loader import load_partitioned
    from sixfold.server.observability.metrics import ServerMetrics

    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend=backend, metrics=metrics, batching=BatchingConfig())
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None), metrics) as bg:
        with tc.InferenceServerClient(bg.url) as client:
            return client.infer(partitioned.plan.model, triton_inputs(tc, request)).as_numpy("scores")


def _model_scores(model, request: dict[str, np.ndarray]) -> np.ndarray:
    import torch
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in
                       ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


def test_int8_tables_serve_close_to_the_fp32_model(gen) -> None:
    """The host stage on row-wise int8 tables, end to end over gRPC: close to fp32, not equal."""
    from sixfold.partitioner.compile import partition_builtin

    model, partitioned = partition_builtin("rm2", max_rows=MAX_ROWS, seed=3, cards=2, table_precision="int8")
    assert partitioned.plan.partition("sparse").format == "tables"
    assert partitioned.plan.partition("sparse").param_bytes < MAX_ROWS * 32 * 64 * 4 / 3
    request = gen.make(64)
    diff = np.abs(_serve_and_score(partitioned, "simcard", request) - _model_scores(model, request)).max()
    assert 0 < diff < 0.02, diff


def test_the_torch_backend_serves_the_dense_part_too(gen) -> None:
    """--backend torch takes the dense partition as an FX module (no ONNX), and answers exactly."""
    from sixfold.backends.registry import get_backend
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.partitioner.partitioned import DENSE_PARTITION

    model, partitioned = partition_builtin("rm2", max_rows=MAX_ROWS, seed=3, cards=2)
    assert partitioned.artifact_for(DENSE_PARTITION, get_backend("torch")).format == "torch-fx"
    request = gen.make(33)
    np.testing.assert_allclose(_serve_and_score(partitioned, "torch", request), _model_scores(model, request),
                               atol=ATOL, rtol=0)


def test_an_int8_dense_partition_serves_close_to_the_fp32_model(gen) -> None:
    """--dense-precision int8 (dynamic quantization) over gRPC on simulated cards: close to fp32, not equal."""
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.partitioner.precision.dense import apply_dense_precision

    model, partitioned = partition_builtin("dlrm-mlperf", max_rows=MAX_ROWS, seed=3, cards=2)
    apply_dense_precision(partitioned, "int8")
    assert partitioned.plan.partition("dense").dtype == "int8"
    request = models.RequestGenerator.for_config(model.config, seed=5).make(300)
    diff = np.abs(_serve_and_score(partitioned, "simcard", request) - _model_scores(model, request))
    assert 0 < float(diff.max()) < 0.05 and float(diff.mean()) < 5e-3, (diff.max(), diff.mean())
