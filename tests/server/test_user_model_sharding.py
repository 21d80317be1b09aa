"""A user model whose host stage is a table-batched sum bag gets its tables sharded on cards, and serves
like the original over gRPC; one that only looks like it (a mean bag) is refused, and never written as
tables the tables backend would sum."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from torch import nn

from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_file
from sixfold.partitioner.placement.sharding import shard_tables
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_from_repository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from tests.conftest import triton_inputs

ROWS, DIM, DENSE_DIM = (40, 25, 60, 30), 8, 3
CANONICAL = ("dense_features", "sparse_lengths", "sparse_indices")


class JaggedBags(nn.Module):
    """Jagged ids shifted into one weight by per-table offsets, pooled by one bag: not the zoo's code."""

    def __init__(self, mode: str = "sum") -> None:
        super().__init__()
        torch.manual_seed(6)
        self.bag = nn.EmbeddingBag(sum(ROWS), DIM, mode=mode)
        self.register_buffer("start", torch.tensor(np.cumsum([0, *ROWS[:-1]])))
        self.top = nn.Sequential(nn.Linear(DENSE_DIM + len(ROWS) * DIM, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        per_bag = sparse_lengths.reshape(-1).long()
        table = (torch.ones_like(sparse_lengths).cumsum(1) - 1).reshape(-1).repeat_interleave(per_bag)
        pooled = self.bag(sparse_indices + self.start[table], torch.cumsum(per_bag, 0) - per_bag)
        return torch.sigmoid(self.top(torch.cat([dense_features, pooled.reshape(-1, len(ROWS) * DIM)], dim=1)))


def _request(items: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=(items, len(ROWS))).astype(np.int32)
    ids = np.concatenate([rng.integers(0, ROWS[t], size=k) for k, t in
                          zip(lengths.reshape(-1), np.tile(np.arange(len(ROWS)), items))]).astype(np.int64)
    return {"dense_features": rng.standard_normal((items, DENSE_DIM)).astype(np.float32),
            "sparse_lengths": lengths, "sparse_indices": ids}


def _archive(tmp_path, model: nn.Module) -> str:
    path = tmp_path / "bags.pt2"
    batch = torch.export.Dim("batch", min=1, max=4096)
    args = tuple(torch.from_numpy(_request(4, 0)[k]) for k in CANONICAL)
    torch.export.save(torch.export.export(model, args, dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch},
        "sparse_indices": {0: torch.export.Dim("ids", min=1, max=1 << 20)}}), str(path))
    return str(path)


def test_a_user_table_batched_model_is_sharded_on_cards_and_serves_like_the_original(tmp_path) -> None:
    model = JaggedBags().eval()
    partitioned = partition_file(_archive(tmp_path, model), cards=3)
    assert partitioned.plan.tables["rows"] == list(ROWS)  # read off the shifts
    result = shard_tables(partitioned, "row")
    assert {s.device for s in result.shards} == {"card0", "card1", "card2"}
    write_artifacts(partitioned, tmp_path / "repo" / "bags" / "1")
    assert (tmp_path / "repo" / "bags" / "1" / "tables" / "table_003.npy").is_file()

    metrics = ServerMetrics()
    core = InferenceCore()
    core.control = ModelControl(core, ModelRepository(tmp_path / "repo"), lambda r, n, v: load_from_repository(
        r, n, v, backend="simcard", metrics=metrics, batching=BatchingConfig()))
    with BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        asyncio.run_coroutine_threadsafe(core.control.load("bags"), server._loop).result(timeout=120)
        assert core.model("bags").plan.shards
        assert core.model("bags").parameters["sixfold.fixed_pooling"] == "true"  # traced at one pooling
        client = grpcclient.InferenceServerClient(server.url)
        for items, seed in ((1, 1), (40, 2)):
            request = _request(items, seed)
            scores = client.infer("bags", triton_inputs(grpcclient, request)).as_numpy("scores")
            with torch.inference_mode():
                expected = model(*(torch.from_numpy(request[k]) for k in CANONICAL)).numpy()
            np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)


def test_a_mean_bag_is_not_taken_for_a_table_batched_sum(tmp_path) -> None:
    model = JaggedBags(mode="mean").eval()
    partitioned = partition_file(_archive(tmp_path, model), cards=3)
    assert partitioned.plan.tables["rows"] == list(ROWS)
    with pytest.raises(ValueError, match="--sparse-on-cards needs a table-batched host stage"):
        shard_tables(partitioned, "row")
    write_artifacts(partitioned, tmp_path / "out")
    assert (tmp_path / "out" / "host.pt2").is_file() and not (tmp_path / "out" / "tables").exists()
