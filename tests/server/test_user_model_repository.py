"""A torch.export model the project did not ship: partitioned from its .pt2, written to a repository,
served on 6 simulated cards, and answering exactly like the original over gRPC."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
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

POOLING = 3
ROWS = (40, 7, 25)
DENSE_DIM = 5


class PerTableModel(nn.Module):
    """Fixed pooling, one EmbeddingBag per table, a gated interaction: nothing like the zoo's DLRM."""

    def __init__(self, hashed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.hashed = hashed
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, 6, mode="mean") for r in ROWS)
        self.bottom = nn.Sequential(nn.Linear(DENSE_DIM, 6), nn.Tanh())
        self.gate = nn.Linear(DENSE_DIM, len(ROWS))
        self.top = nn.Sequential(nn.Linear(6 * (len(ROWS) + 1), 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n = dense_features.shape[0]
        ids = sparse_indices.reshape(n, len(ROWS), POOLING)
        pooled = []
        for t, table in enumerate(self.tables):
            table_ids = ids[:, t, :] % ROWS[t] if self.hashed else ids[:, t, :]
            pooled.append(table(table_ids))
        gates = torch.sigmoid(self.gate(dense_features))
        emb = torch.stack(pooled, dim=1) * gates.unsqueeze(-1)
        x = torch.cat([self.bottom(dense_features), emb.flatten(1)], dim=1)
        return torch.sigmoid(self.top(x))


def _request(items: int, seed: int, hashed: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(0, 10_000 if hashed else ROWS[t], size=(items, 1, POOLING))
                          for t in range(len(ROWS))], axis=1)
    return {"dense_features": rng.standard_normal((items, DENSE_DIM)).astype(np.float32),
            "sparse_lengths": np.full((items, len(ROWS)), POOLING, dtype=np.int32),
            "sparse_indices": ids.reshape(-1).astype(np.int64)}


def _save(tmp_path, model: nn.Module) -> str:
    example = _request(4, 0)
    args = tuple(torch.from_numpy(example[k]) for k in ("dense_features", "sparse_lengths", "sparse_indices"))
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(model, args, dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch}, "sparse_indices": {0: batch * len(ROWS) * POOLING}})
    path = tmp_path / "ctr.pt2"
    torch.export.save(program, str(path))
    return str(path)


@pytest.mark.parametrize("hashed", [False, True])
def test_a_user_export_serves_from_a_repository_like_the_original(tmp_path, hashed, caplog):
    model = PerTableModel(hashed).eval()
    partitioned = partition_file(_save(tmp_path, model), cards=6, pooling=POOLING)
    repo = tmp_path / "repo"
    write_artifacts(partitioned, repo / "ctr" / "1")
    assert (repo / "ctr" / "1" / "host.pt2").is_file()  # not plain tables: the host graph is saved whole
    if hashed:  # ids are hashed inside the model: no per-table range to check
        assert "rows" not in partitioned.plan.tables and "range-checks ids per lookup" in caplog.text
    else:
        assert partitioned.plan.tables["rows"] == list(ROWS)  # read off the graph, table by table

    metrics = ServerMetrics()
    core = InferenceCore()
    core.control = ModelControl(core, ModelRepository(repo), lambda r, n, v: load_from_repository(
        r, n, v, backend="simcard", metrics=metrics, batching=BatchingConfig()))
    with BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        asyncio.run_coroutine_threadsafe(core.control.load("ctr"), server._loop).result(timeout=120)
        assert len(core.model("ctr").runtime.cards) == 6
        client = grpcclient.InferenceServerClient(server.url)
        for items, seed in ((1, 1), (17, 2), (300, 3)):
            request = _request(items, seed, hashed)
            result = client.infer("ctr", triton_inputs(grpcclient, request))
            with torch.inference_mode():
                expected = model(*(torch.from_numpy(request[k]) for k in
                                   ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()
            np.testing.assert_allclose(result.as_numpy("scores"), expected, rtol=1e-5, atol=1e-6)
        if not hashed:
            bad = _request(2, 4)
            bad["sparse_indices"][POOLING] = ROWS[1]  # item 0, table 1: one past its last row
            with pytest.raises(InferenceServerException, match="table 1") as err:
                client.infer("ctr", triton_inputs(grpcclient, bad))
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


class OnnxStyleModel(nn.Module):
    """Per-table nn.Embedding + sum: torch.onnx exports it as Gather on an initializer + ReduceSum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.tables = nn.ModuleList(nn.Embedding(r, 4) for r in ROWS)
        self.top = nn.Sequential(nn.Linear(DENSE_DIM + 4 * len(ROWS), 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        ids = sparse_indices.reshape(-1, len(ROWS), POOLING)
        pooled = [table(ids[:, t, :]).sum(dim=1) for t, table in enumerate(self.tables)]
        return torch.sigmoid(self.top(torch.cat([dense_features, *pooled], dim=1)))


def test_a_user_onnx_model_serves_from_a_repository_like_the_original(tmp_path):
    import onnxruntime as ort

    model = OnnxStyleModel().eval()
    example = _request(4, 0)
    args = tuple(torch.from_numpy(example[k]) for k in ("dense_features", "sparse_lengths", "sparse_indices"))
    path = tmp_path / "ctr.onnx"
    batch = torch.export.Dim("batch", min=1, max=4096)
    torch.onnx.export(model, args, str(path), dynamo=True, input_names=list(example), output_names=["scores"],
                      dynamic_shapes={"dense_features": {0: batch}, "sparse_lengths": {0: batch},
                                      "sparse_indices": {0: batch * len(ROWS) * POOLING}})
    partitioned = partition_file(str(path), cards=6)
    assert partitioned.plan.tables["rows"] == list(ROWS)
    repo = tmp_path / "repo"
    write_artifacts(partitioned, repo / "ctr_onnx" / "1")
    assert (repo / "ctr_onnx" / "1" / "host.onnx").is_file()
    original = ort.InferenceSession(str(path))

    metrics = ServerMetrics()
    core = InferenceCore()
    core.control = ModelControl(core, ModelRepository(repo), lambda r, n, v: load_from_repository(
        r, n, v, backend="simcard", metrics=metrics, batching=BatchingConfig()))
    with BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        asyncio.run_coroutine_threadsafe(core.control.load("ctr_onnx"), server._loop).result(timeout=120)
        client = grpcclient.InferenceServerClient(server.url)
        for items, seed in ((1, 1), (40, 2)):
            request = _request(items, seed)
            scores = client.infer("ctr_onnx", triton_inputs(grpcclient, request)).as_numpy("scores")
            np.testing.assert_allclose(scores, original.run(None, request)[0], rtol=1e-5, atol=1e-6)
        bad = _request(1, 3)
        bad["sparse_indices"][2 * POOLING] = ROWS[2]
        with pytest.raises(InferenceServerException, match="table 2"):
            client.infer("ctr_onnx", triton_inputs(grpcclient, bad))
