"""A torch.export archive the project did not ship is partitioned and answers like the original."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from partitioner.cli import main as partition_main
from partitioner.compile import DENSE_PARTITION, partition_file
from partitioner.frontend import export_model

from .test_cut import OneHotConcatModel, _one_hot_inputs


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
