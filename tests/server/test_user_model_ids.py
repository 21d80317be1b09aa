"""Every host lookup of a user model gets a range check, even where the partitioner cannot tell which
table a lookup serves: a bad id is INVALID_ARGUMENT naming sparse_indices, over real gRPC, and the
server keeps answering."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper
from torch import nn
from tritonclient.utils import InferenceServerException

from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_file
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_from_repository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from tests.conftest import triton_inputs

TABLES, ROWS, DIM, DENSE_DIM = 3, 10, 4, 2
CANONICAL = ("dense_features", "sparse_lengths", "sparse_indices")


class SharedTableModel(nn.Module):
    """One-hot ids shifted into one shared table by a per-table offset (``scale`` 1), or scaled first (2)."""

    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.scale = scale
        self.weight = nn.Parameter(torch.randn(TABLES * ROWS * scale, DIM), requires_grad=False)
        self.register_buffer("offsets", torch.arange(TABLES) * ROWS * scale)
        self.top = nn.Linear(DENSE_DIM + TABLES * DIM, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        rows = sparse_indices.view(-1, TABLES) * self.scale + self.offsets
        emb = nn.functional.embedding(rows, self.weight).flatten(1)
        return torch.sigmoid(self.top(torch.cat([dense_features, emb], dim=1)))


def _request(items: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense_features": rng.standard_normal((items, DENSE_DIM)).astype(np.float32),
            "sparse_lengths": np.ones((items, TABLES), dtype=np.int32),
            "sparse_indices": rng.integers(0, ROWS, size=items * TABLES).astype(np.int64)}


def _serve(repo, name: str):
    metrics = ServerMetrics()
    core = InferenceCore()
    core.control = ModelControl(core, ModelRepository(repo), lambda r, n, v: load_from_repository(
        r, n, v, backend="simcard", metrics=metrics, batching=BatchingConfig()))
    server = BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics)
    return core, server


def _bad_id_is_invalid_argument(client, name: str, bad: dict[str, np.ndarray], *match: str) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer(name, triton_inputs(grpcclient, bad))
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value.message()
    for text in ("'sparse_indices'", *match):
        assert text in err.value.message()


def _partition_torch(tmp_path, model: nn.Module, name: str):
    path = tmp_path / f"{name}.pt2"
    batch = torch.export.Dim("batch", min=1, max=4096)
    args = tuple(torch.from_numpy(_request(4, 0)[k]) for k in CANONICAL)
    torch.export.save(torch.export.export(model, args, dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch}, "sparse_indices": {0: batch * TABLES}}), str(path))
    partitioned = partition_file(str(path), cards=2)
    write_artifacts(partitioned, tmp_path / "repo" / name / "1")
    return partitioned


def _check_good(client, name: str, model: nn.Module) -> None:
    good = _request(5, 2)  # the server keeps answering, like the model
    scores = client.infer(name, triton_inputs(grpcclient, good)).as_numpy("scores")
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(good[k]) for k in CANONICAL)).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)


def test_ids_shifted_into_a_shared_table_are_checked_per_table(tmp_path) -> None:
    model = SharedTableModel().eval()
    partitioned = _partition_torch(tmp_path, model, "shared")
    assert partitioned.plan.tables["rows"] == [ROWS] * TABLES  # from the shifts: table t starts where t - 1 ends

    core, server = _serve(tmp_path / "repo", "shared")
    with server:
        asyncio.run_coroutine_threadsafe(core.control.load("shared"), server._loop).result(timeout=120)
        client = grpcclient.InferenceServerClient(server.url)
        bad = _request(3, 1)
        bad["sparse_indices"][4] = ROWS  # item 1, table 1: inside the shared weight, but table 2's first row
        _bad_id_is_invalid_argument(client, "shared", bad, "id 10 at position 4 is out of range for table 1")
        # The model's own host graph takes its traced INT64 ids only (INT32 is the tables backend's).
        narrow = {**_request(2, 3), "sparse_indices": _request(2, 3)["sparse_indices"].astype(np.int32)}
        _bad_id_is_invalid_argument(client, "shared", narrow, "datatype INT32 but the model expects INT64")
        _check_good(client, "shared", model)


def test_a_torch_lookup_with_no_table_map_range_checks_its_rows(tmp_path) -> None:
    model = SharedTableModel(scale=2).eval()
    partitioned = _partition_torch(tmp_path, model, "scaled")
    assert "rows" not in partitioned.plan.tables  # ids x 2: not a shift, so no table map

    core, server = _serve(tmp_path / "repo", "scaled")
    with server:
        asyncio.run_coroutine_threadsafe(core.control.load("scaled"), server._loop).result(timeout=120)
        client = grpcclient.InferenceServerClient(server.url)
        bad = _request(3, 1)
        bad["sparse_indices"][5] = 2 * ROWS  # item 1, table 2: row 2 x 20 + 40 = 80 of a 60-row table
        _bad_id_is_invalid_argument(client, "scaled", bad, "reads row 80 of lookup embedding", "rows 0..59")
        bad["sparse_indices"][5] = -3 * ROWS  # -60 + 40: before row 0
        _bad_id_is_invalid_argument(client, "scaled", bad, "reads row")
        _check_good(client, "scaled", model)


def _scaled_ids_onnx(path) -> None:
    """ids x 2 into a table of 2 x ROWS rows per table index: transformed, not shifted, so no table map."""
    rng = np.random.default_rng(0)
    table = helper.make_tensor("table", TensorProto.FLOAT, [2 * ROWS, DIM], rng.standard_normal(2 * ROWS * DIM))
    top = helper.make_tensor("top", TensorProto.FLOAT, [DENSE_DIM + TABLES * DIM, 1],
                             rng.standard_normal(DENSE_DIM + TABLES * DIM))
    consts = [helper.make_tensor("two", TensorProto.INT64, [], [2]),
              helper.make_tensor("shape", TensorProto.INT64, [2], [-1, TABLES * DIM])]
    nodes = [helper.make_node("Mul", ["sparse_indices", "two"], ["rows"]),
             helper.make_node("Gather", ["table", "rows"], ["gathered"]),
             helper.make_node("Reshape", ["gathered", "shape"], ["emb"]),
             helper.make_node("Concat", ["dense_features", "emb"], ["x"], axis=1),
             helper.make_node("MatMul", ["x", "top"], ["logit"]),
             helper.make_node("Sigmoid", ["logit"], ["scores"])]
    graph = helper.make_graph(nodes, "scaled", [
        helper.make_tensor_value_info("dense_features", TensorProto.FLOAT, ["N", DENSE_DIM]),
        helper.make_tensor_value_info("sparse_lengths", TensorProto.INT32, ["N", TABLES]),
        helper.make_tensor_value_info("sparse_indices", TensorProto.INT64, ["ids"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 1])], initializer=[table, top, *consts])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_an_onnx_lookup_with_no_table_map_range_checks_its_rows(tmp_path) -> None:
    path = tmp_path / "scaled.onnx"
    _scaled_ids_onnx(path)
    partitioned = partition_file(str(path), cards=2, pooling=1)
    assert "rows" not in partitioned.plan.tables
    write_artifacts(partitioned, tmp_path / "repo" / "scaled" / "1")
    original = ort.InferenceSession(str(path))

    core, server = _serve(tmp_path / "repo", "scaled")
    with server:
        asyncio.run_coroutine_threadsafe(core.control.load("scaled"), server._loop).result(timeout=120)
        client = grpcclient.InferenceServerClient(server.url)
        bad = _request(2, 3)
        bad["sparse_indices"][5] = ROWS  # x 2 = row 20 of a 20-row table
        _bad_id_is_invalid_argument(client, "scaled", bad, "row 20", "rows 0..19")
        good = _request(4, 4)
        scores = client.infer("scaled", triton_inputs(grpcclient, good)).as_numpy("scores")
        np.testing.assert_allclose(scores, original.run(None, good)[0], rtol=1e-5, atol=1e-6)
