"""The piece check runs for .onnx files too: host.onnx then dense.onnx at 1, 2, 3, 7 and 64 items (and a jagged
request with empty bags) against the original file under ONNX Runtime; a size that fails is refused at partition
time naming the size and the reason, with no plan written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.frontends.onnx_frontend import cut_onnx
from sixfold.partitioner.piece_check import CHECK_SIZES, PieceCheckError, check_onnx_pieces

TABLES, ROWS, DIM, DENSE_IN = 2, 30, 4, 3
INPUTS = ["dense_features", "sparse_lengths", "sparse_indices"]


class Bagged(nn.Module):
    """Jagged bags over two tables; ``ending`` picks a last step that breaks at some batch sizes."""

    def __init__(self, ending: str = "plain") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(TABLES))
        self.top = nn.Linear(DENSE_IN + TABLES * DIM, 1)
        self.ending = ending

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        per_bag, count = sparse_lengths.reshape(-1).long(), sparse_indices.shape[0]
        starts = torch.cumsum(per_bag, 0) - per_bag
        marks = torch.zeros(count + 1, dtype=torch.long).scatter_add(0, starts, torch.ones_like(starts))
        table_of_id = (torch.cumsum(marks[:count], 0) - 1) % TABLES
        pooled = []
        for t, bag in enumerate(self.bags):
            lengths = sparse_lengths[:, t].long()
            pooled.append(bag(sparse_indices[table_of_id == t], torch.cumsum(lengths, 0) - lengths))
        logit = self.top(torch.cat([dense_features, *pooled], dim=1))
        if self.ending == "squeeze":  # [N] -> [N, 1], but a 1-item batch's [1, 1] -> [] -> [1]
            return torch.sigmoid(logit.squeeze()).unsqueeze(-1)
        if self.ending == "top4":  # centred on the batch's 4 largest logits: no batch under 4 items runs
            return torch.sigmoid(logit - logit.topk(4, dim=0).values.mean())
        return torch.sigmoid(logit)


def _export(ending: str, path) -> str:
    args = (torch.randn(4, DENSE_IN), torch.full((4, TABLES), 2, dtype=torch.int32), torch.randint(0, ROWS, (16,)))
    axes = {"dense_features": {0: "batch"}, "sparse_lengths": {0: "batch"}, "sparse_indices": {0: "ids"},
            "scores": {0: "batch"}}
    torch.onnx.export(Bagged(ending).eval(), args, str(path), dynamo=False, input_names=INPUTS,
                      output_names=["scores"], dynamic_axes=axes)
    return str(path)


def _example(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {"dense_features": rng.standard_normal((rows, DENSE_IN)).astype(np.float32),
            "sparse_lengths": np.full((rows, TABLES), 2, dtype=np.int32),
            "sparse_indices": rng.integers(0, ROWS, size=rows * TABLES * 2).astype(np.int64)}


def _check(split, dense) -> list[str]:
    return check_onnx_pieces(split.model, split.host, dense, host_inputs=split.host_inputs, boundary=split.boundary,
                             dense_inputs=split.dense_inputs, heads=split.heads, example=_example)


def test_an_onnx_models_pieces_are_checked_at_every_size_and_on_a_jagged_request(tmp_path) -> None:
    split = cut_onnx(onnx.load(_export("plain", tmp_path / "plain.onnx")))
    assert _check(split, split.dense) == [f"{n}-item request" for n in CHECK_SIZES] + [
        "7-item jagged request with empty bags"]


def test_a_dense_onnx_that_disagrees_with_the_file_is_refused_naming_the_size(tmp_path) -> None:
    split = cut_onnx(onnx.load(_export("plain", tmp_path / "plain.onnx")))
    tampered = onnx.ModelProto()
    tampered.CopyFrom(split.dense)
    bias = next(t for t in tampered.graph.initializer if list(t.dims) == [1])  # the top layer's bias
    bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + np.float32(0.5), bias.name))
    with pytest.raises(PieceCheckError, match=r"on a 1-item request, the card piece \(dense.onnx\) gives 'scores' "
                                              r"up to .* off the model's"):
        _check(split, tampered)


def test_an_onnx_model_that_drops_the_batch_dim_at_one_item_is_refused(tmp_path, capsys) -> None:
    path = _export("squeeze", tmp_path / "squeezed.onnx")
    assert partition_main([path, "--cards", "1", "--out", str(tmp_path / "repo" / "1")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "squeezed.onnx: the model itself answers a 1-item request with 'scores' [1], not [1, 1]" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "repo").exists()  # no plan written


def test_an_onnx_model_that_fails_under_four_items_is_refused_naming_the_size(tmp_path, capsys) -> None:
    path = _export("top4", tmp_path / "top4.onnx")
    assert partition_main([path, "--cards", "1", "--out", str(tmp_path / "repo" / "1")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "top4.onnx: the model itself fails on a 3-item request" in err and "TopK" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "repo").exists()
    from sixfold.partitioner.frontends.onnx_frontend import partition_onnx
    with pytest.raises(PieceCheckError, match="-item request"):
        partition_onnx(path, cards=[load_spec("m2-card")], host=load_spec("host-cpu"))
