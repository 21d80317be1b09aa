"""Issue 31: index arithmetic written with repeat_interleave exports to ONNX as a [bags x ids] comparison (dynamo)
or a Loop (legacy) that stays on the host and runs 10-27x slower; the ONNX frontend warns, naming the nodes and
the cumulative-sum form to use instead. The cumulative-sum form itself gets no such warning."""

from __future__ import annotations

import logging

import onnx
import pytest
import torch
from torch import nn

from sixfold.partitioner.frontends.onnx_frontend import cut_onnx
from tests.partitioner.frontends.test_onnx_piece_check import _export as export_cumsum_form

INPUTS = ["dense_features", "sparse_lengths", "sparse_indices"]


class RepeatInterleave(nn.Module):
    """Each id's table found with repeat_interleave (docs step 7's way), one bag over table 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(50, 4, mode="sum")
        self.top = nn.Linear(3 + 4, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        lengths = sparse_lengths.long()
        table_of_id = (torch.ones_like(lengths).cumsum(1) - 1).reshape(-1).repeat_interleave(lengths.reshape(-1))
        pooled = self.bag(sparse_indices[table_of_id == 0], lengths[:, 0].cumsum(0) - lengths[:, 0])
        return torch.sigmoid(self.top(torch.cat([dense_features, pooled], 1)))


def _export(path, dynamo: bool) -> onnx.ModelProto:
    args = (torch.randn(4, 3), torch.full((4, 2), 2, dtype=torch.int32), torch.randint(0, 50, (16,)))
    if dynamo:
        batch, ids = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("ids", min=1, max=1 << 20)
        torch.onnx.export(RepeatInterleave().eval(), args, str(path), dynamo=True, input_names=INPUTS,
                          output_names=["scores"], dynamic_shapes={"dense_features": {0: batch},
                                                                   "sparse_lengths": {0: batch},
                                                                   "sparse_indices": {0: ids}})
    else:
        torch.onnx.export(RepeatInterleave().eval(), args, str(path), dynamo=False, input_names=INPUTS,
                          output_names=["scores"], dynamic_axes={"dense_features": {0: "b"}, "sparse_lengths": {0: "b"},
                                                                 "sparse_indices": {0: "i"}, "scores": {0: "b"}})
    return onnx.load(str(path))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "the host stage has" in r.getMessage()]


@pytest.mark.parametrize("dynamo, shape", [(True, "grow with the square of the request"), (False, "loop over the request")])
def test_repeat_interleave_is_named_with_the_cumsum_form_to_use(tmp_path, caplog, dynamo, shape) -> None:
    model = _export(tmp_path / "ri.onnx", dynamo)
    with caplog.at_level(logging.WARNING):
        split = cut_onnx(model, where="ri.onnx")
    (message,) = _warnings(caplog)
    assert message.startswith("ri.onnx: the host stage has") and shape in message, message
    assert ("Less" if dynamo else "Loop") in message
    assert "repeat_interleave" in message and "cumsum(lengths) - lengths" in message and "scatter_add" in message
    assert split.heads == ["scores"]  # a warning, not a refusal: the model is still cut and served


def test_the_cumulative_sum_form_gets_no_warning(tmp_path, caplog) -> None:
    model = onnx.load(export_cumsum_form("plain", tmp_path / "cumsum.onnx"))
    with caplog.at_level(logging.WARNING):
        cut_onnx(model, where="cumsum.onnx")
    assert _warnings(caplog) == []
