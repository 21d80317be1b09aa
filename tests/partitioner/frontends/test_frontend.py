"""A torch.export archive the project did not ship is partitioned and answers like the original."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_file
from sixfold.partitioner.partitioned import DENSE_PARTITION
from sixfold.partitioner.frontends.torch_frontend import export_model

from tests.partitioner.cut.test_cut import OneHotConcatModel, _one_hot_inputs


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    model = OneHotConcatModel().eval()
    path = tmp_path_factory.mktemp("model") / "onehot.pt2"
    torch.export.save(export_model(model, _one_hot_inputs(4)), str(path))
    return model, path


def test_an_export_archive_is_cut_and_the_pieces_answer_like_the_original(archive) -> None:
    model, path = archive
    partitioned = partition_file(str(path), cards=3)
    plan = partitioned.plan
    assert plan.model == "onehot" and plan.devices_of(DENSE_PARTITION) == ["card0", "card1", "card2"]
    assert [i.name for i in plan.inputs] == ["dense_features", "sparse_lengths", "sparse_indices"]
    split, dense = partitioned.split, partitioned.artifacts[DENSE_PARTITION]
    session = ort.InferenceSession(dense.payload)
    for items in (1, 5, 33):
        x = dict(zip(("dense_features", "sparse_lengths", "sparse_indices"), _one_hot_inputs(items)))
        with torch.inference_mode():
            boundary = dict(zip(split.boundary, split.host(*[x[n] for n in split.host_inputs])))
        feed = {n: (boundary.get(n) if n in boundary else x[n]).numpy() for n in dense.input_names}
        scores = session.run(None, feed)[0]
        np.testing.assert_allclose(scores, model(*x.values()).detach().numpy(), atol=1e-5)


def test_cli_partitions_a_file(archive, tmp_path, capsys) -> None:
    _, path = archive
    assert partition_main([str(path), "--cards", "2", "--name", "mine", "--out", str(tmp_path)]) == 0
    assert "card1" in capsys.readouterr().out
    assert (tmp_path / "dense.onnx").is_file() and (tmp_path / "plan.json").is_file()


def test_a_file_and_a_builtin_name_together_are_refused(archive, tmp_path, capsys) -> None:
    _, path = archive
    assert partition_main([str(path), "--model", "rm2", "--out", str(tmp_path)]) == 2
    assert "either MODEL_FILE or --model" in capsys.readouterr().err


def test_a_model_without_the_canonical_inputs_is_refused_with_its_inputs(tmp_path) -> None:
    class Other(nn.Module):
        def forward(self, x):
            return x.sum(1, keepdim=True)
    path = tmp_path / "other.pt2"
    torch.export.save(torch.export.export(Other(), (torch.randn(3, 4),)), str(path))
    with pytest.raises(ValueError, match=r"inputs are \['x'\].*must take"):
        partition_file(str(path))


class _PinnedModel(nn.Module):
    """Reshapes the ids by the batch: a static export bakes [4, 3, 2] into its graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.top = nn.Linear(2 + 3 * 4, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        ids = sparse_indices.reshape(dense_features.shape[0] * 3, 2)
        pooled = self.bag(ids).reshape(dense_features.shape[0], 12)
        return torch.sigmoid(self.top(torch.cat([dense_features, pooled], dim=1)))


class _JaggedModel(nn.Module):
    """Offsets from the lengths, no size taken from the example: a static export still runs on any batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.top = nn.Linear(2 + 4, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        per_item = sparse_lengths.sum(1)
        pooled = self.bag(sparse_indices, torch.cumsum(per_item, 0) - per_item)
        return torch.sigmoid(self.top(torch.cat([dense_features, pooled], dim=1)))


def _fixed_pooling(items: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(items, 2, generator=g), torch.full((items, 3), 2, dtype=torch.int32),
            torch.randint(0, 30, (items * 6,), generator=g))


def _static_archive(model: nn.Module, tmp_path) -> str:
    path = tmp_path / "static.pt2"
    torch.export.save(torch.export.export(model.eval(), _fixed_pooling(4)), str(path))  # no dynamic_shapes
    return str(path)


def test_a_static_export_whose_graph_pins_the_batch_is_refused_saying_what_to_change(tmp_path, capsys) -> None:
    from sixfold.partitioner.frontends.torch_frontend import StaticExportError

    path = _static_archive(_PinnedModel(), tmp_path)
    with pytest.raises(StaticExportError) as err:
        partition_file(path, cards=1, pooling=2)
    text = str(err.value)
    assert "static shapes" in text and "sparse_indices [24]" in text and "4-item request" in text
    assert "dynamic_shapes=" in text and "'sparse_indices': {0: batch * 6}" in text
    assert partition_main([path, "--cards", "1", "--pooling", "2", "--plan-only"]) == 2
    err_text = capsys.readouterr().err.replace("\n", "")
    assert "static shapes" in err_text and "dynamic_shapes=" in err_text


def test_a_static_export_that_does_not_depend_on_the_batch_is_re_traced(tmp_path) -> None:
    model = _JaggedModel().eval()
    partitioned = partition_file(_static_archive(model, tmp_path), cards=1, pooling=2)
    split, dense = partitioned.split, partitioned.artifacts[DENSE_PARTITION]
    session = ort.InferenceSession(dense.payload)
    for items in (1, 4, 19):  # not only the example's 4 items
        x = dict(zip(("dense_features", "sparse_lengths", "sparse_indices"), _fixed_pooling(items, seed=items)))
        with torch.inference_mode():
            boundary = dict(zip(split.boundary, split.host(*[x[n] for n in split.host_inputs])))
            expected = model(*x.values()).numpy()
        feed = {n: (boundary[n] if n in boundary else x[n]).numpy() for n in dense.input_names}
        np.testing.assert_allclose(session.run(None, feed)[0], expected, atol=1e-5)
