"""Table precision, the accuracy report and --measure on models the project did not ship (.pt2 and .onnx)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from sixfold.backends.registry import get_backend
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_file
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.server.loading.repository import ModelRepository

ROWS, DIM, DENSE_DIM, POOLING = (30, 12, 20), 8, 3, 2
CANONICAL = ("dense_features", "sparse_lengths", "sparse_indices")


class MixedLookups(nn.Module):
    """A mean EmbeddingBag, a sum EmbeddingBag with per-sample weights, and embedding + max over the bag."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.mean = nn.EmbeddingBag(ROWS[0], DIM, mode="mean")
        self.weighted = nn.EmbeddingBag(ROWS[1], DIM, mode="sum")
        self.psw = nn.Parameter(torch.rand(ROWS[1]) + 0.5, requires_grad=False)
        self.rows = nn.Embedding(ROWS[2], DIM)
        self.top = nn.Sequential(nn.Linear(DENSE_DIM + 3 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        # NOTE: the batch from dense_features, not reshape(-1, ...): torch.export would guard it to != 1.
        ids = sparse_indices.reshape(dense_features.shape[0], len(ROWS), POOLING)
        a = self.mean(ids[:, 0])
        b = self.weighted(ids[:, 1].reshape(-1), torch.arange(0, ids.shape[0] * POOLING, POOLING),
                          per_sample_weights=self.psw[ids[:, 1].reshape(-1)])
        c = self.rows(ids[:, 2]).amax(dim=1)
        return torch.sigmoid(self.top(torch.cat([dense_features, a, b, c], dim=1)))


def _request(items: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, r, size=(items, POOLING)) for r in ROWS], axis=1)
    return {"dense_features": rng.standard_normal((items, DENSE_DIM)).astype(np.float32),
            "sparse_lengths": np.full((items, len(ROWS)), POOLING, dtype=np.int32),
            "sparse_indices": ids.reshape(-1).astype(np.int64)}


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    model = MixedLookups().eval()
    path = tmp_path_factory.mktemp("mixed") / "mixed.pt2"
    batch = torch.export.Dim("batch", min=1, max=4096)
    args = tuple(torch.from_numpy(_request(4, 0)[k]) for k in CANONICAL)
    torch.export.save(torch.export.export(model, args, dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch},
        "sparse_indices": {0: batch * len(ROWS) * POOLING}}), str(path))
    return model, str(path)


def _scores(partitioned, request, host_artifact=None) -> np.ndarray:
    plan = partitioned.plan
    host_art = host_artifact or partitioned.artifacts[HOST_PARTITION]
    backend = {"torch-fx": "torch", "onnx": "onnxruntime"}[host_art.format]
    spec = load_spec("host-cpu")
    host = get_backend(backend).load(host_art, spec)
    dense = get_backend("onnxruntime").load(partitioned.artifacts[DENSE_PARTITION], spec)
    try:
        env = {**request, **host.run(request)}
        return dense.run(env)["scores"]
    finally:
        host.close()
        dense.close()


@pytest.mark.parametrize("precision,atol", [("fp16", 2e-3), ("int8", 2e-2), ("int4", 8e-2)])
def test_table_precision_rewrites_every_lookup_of_a_user_export(archive, tmp_path, precision, atol) -> None:
    model, path = archive
    fp32 = partition_file(path, cards=2, pooling=POOLING)
    partitioned = partition_file(path, cards=2, pooling=POOLING, table_precision=precision)
    plan = partitioned.plan
    assert plan.tables["precision"] == precision and plan.tables["rows"] == list(ROWS)
    host = partitioned.artifacts[HOST_PARTITION]
    assert host.metadata["precision"] == precision
    from sixfold.backends.host.host_embedding import bytes_per_row
    saved = (4 * DIM - bytes_per_row(precision, DIM)) * sum(ROWS)  # the tables shrink, the rest stays
    assert host.param_bytes == fp32.artifacts[HOST_PARTITION].param_bytes - saved
    assert plan.partition(HOST_PARTITION).param_bytes == host.param_bytes

    write_artifacts(partitioned, tmp_path / "repo" / "mixed" / "1")
    from_disk = ModelRepository(tmp_path / "repo").read("mixed", "1")
    for items, seed in ((1, 1), (33, 2)):
        request = _request(items, seed)
        with torch.inference_mode():
            expected = model(*(torch.from_numpy(request[k]) for k in CANONICAL)).numpy()
        scores = _scores(partitioned, request)
        np.testing.assert_allclose(scores, expected, atol=atol)
        if precision != "fp16":
            assert not np.array_equal(scores, expected)  # the rows really are quantized
        # host.pt2 in the repository: the same quantized graph, exported
        np.testing.assert_allclose(_scores(partitioned, request, from_disk.artifacts[HOST_PARTITION]), scores,
                                   rtol=1e-6, atol=1e-7)


def test_cli_accuracy_report_on_a_user_export(archive, tmp_path, capsys) -> None:
    _, path = archive
    out = tmp_path / "mixed"
    assert partition_main([path, "--cards", "2", "--pooling", str(POOLING), "--table-precision", "int8",
                           "--accuracy-report", "--accuracy-items", "256", "--out", str(out)]) == 0
    report = json.loads((out / "accuracy.json").read_text())
    assert report["variant"] == "int8 tables + fp32 dense" and report["reference"] == "fp32 tables + fp32 dense"
    assert 0 < report["max_abs_diff"] < 0.05 and report["items"] == 256
    assert json.loads((out / "plan.json").read_text())["tables"]["precision"] == "int8"


def test_a_lookup_that_cannot_be_quantized_is_named(tmp_path) -> None:
    class MaxBag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 4, mode="max")
            self.top = nn.Linear(4 + DENSE_DIM, 1)

        def forward(self, dense_features, sparse_lengths, sparse_indices):
            return self.top(torch.cat([dense_features, self.bag(sparse_indices.reshape(-1, 2))], dim=1))

    path = tmp_path / "max.pt2"
    batch = torch.export.Dim("batch", min=1, max=4096)
    args = (torch.zeros(4, DENSE_DIM), torch.full((4, 1), 2, dtype=torch.int32), torch.zeros(8, dtype=torch.int64))
    torch.export.save(torch.export.export(MaxBag(), args, dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch}, "sparse_indices": {0: batch * 2}}), str(path))
    with pytest.raises(ValueError, match=r"lookup embedding_bag.*max pooling cannot be converted to int8"):
        partition_file(str(path), cards=1, pooling=2, table_precision="int8")


@pytest.mark.parametrize("lookup,reduce,weighted", [("gather", "ReduceMean", True), ("gathernd", "ReduceSum", False)])
def test_table_precision_on_an_onnx_model(tmp_path, lookup, reduce, weighted) -> None:
    import onnx

    from tests.partitioner.precision.test_onnx_lookups import DIM as onnx_dim, ROWS as onnx_rows, _model, _request as onnx_request

    path = tmp_path / "bags.onnx"
    onnx.save(_model(lookup, reduce, weighted), str(path))
    original = ort.InferenceSession(str(path))
    fp32 = partition_file(str(path), cards=1)
    for precision, atol in (("fp16", 2e-3), ("int8", 3e-2)):
        partitioned = partition_file(str(path), cards=1, table_precision=precision)
        assert partitioned.plan.tables["precision"] == precision
        from sixfold.backends.host.host_embedding import bytes_per_row
        saved = (4 * onnx_dim - bytes_per_row(precision, onnx_dim)) * sum(onnx_rows)  # per-sample weights stay
        if precision == "fp16" and weighted:
            saved += 2 * sum(onnx_rows)  # the [rows, 1] weights too
        assert partitioned.artifacts[HOST_PARTITION].param_bytes == fp32.artifacts[HOST_PARTITION].param_bytes - saved
        request = onnx_request(17, 5)
        np.testing.assert_allclose(_scores(partitioned, request), original.run(None, request)[0], atol=atol)
    with pytest.raises(ValueError, match="int4 needs ONNX 4-bit types: use int8"):
        partition_file(str(path), cards=1, table_precision="int4")


def test_measure_compares_the_plan_with_this_host_for_a_user_model(archive, tmp_path, capsys) -> None:
    _, path = archive
    out = tmp_path / "measured"
    assert partition_main([path, "--cards", "2", "--pooling", str(POOLING), "--batch-rows", "32", "--measure",
                           "--measure-seconds", "0.5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "estimate vs measured" in text and "calibrated spec:" in text
    report = json.loads((out / "measure.json").read_text())
    assert report["model"] == "mixed" and report["batch_rows"] == 32
    stages = {s["stage"]: s for s in report["stages"]}
    assert set(stages) == {HOST_PARTITION, DENSE_PARTITION}
    assert stages[HOST_PARTITION]["device"] == "host" and stages[DENSE_PARTITION]["device"] == "card0"
    for s in stages.values():
        assert s["estimate_s"] > 0 and s["measured_s"] > 0 and s["ratio"] == pytest.approx(
            s["measured_s"] / s["estimate_s"])
