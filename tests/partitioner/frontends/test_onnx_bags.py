"""torch's ONNX EmbeddingBag (a Loop per bag) is a host lookup (issue 31 item 3).

Both exporters (legacy ``dynamo=False`` and dynamo), one-hot and jagged (offsets), sum and mean, with
per-sample weights: the Loop becomes a vectorised gather + pooling on the host, the dense partition
holds only ops of the card op set, and host∘dense answers like torch, empty bags included. A bag
form that is not recognised (mode="max") stays, and the partitioner names the ops it leaves on the cards.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from sixfold.backends.conformance.ops import dense_ops
from sixfold.partitioner.frontends.onnx_frontend import cut_onnx

T, D, E, R = 3, 5, 4, 30
NAMES = ["dense_features", "sparse_lengths", "sparse_indices"]
CARD_OPS = {use["op"] for use in dense_ops()["ops"]}


class Bags(nn.Module):
    """T EmbeddingBags fed the canonical request: one id per (item, table), or jagged through offsets."""

    def __init__(self, mode: str, jagged: bool, weighted: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = nn.ModuleList(nn.EmbeddingBag(R, E, mode=mode) for _ in range(T))
        self.psw = nn.Embedding(R, 1) if weighted else None
        self.top = nn.Linear(D + T * E, 1)
        self.jagged = jagged

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n = sparse_lengths.shape[0]
        pooled = []
        if self.jagged:  # per table: its ids (sample-major order) and each item's offset into them
            table_of_id = torch.arange(T).repeat(n).repeat_interleave(sparse_lengths.reshape(-1).long())
            for t, bag in enumerate(self.bags):
                ids = sparse_indices[table_of_id == t]
                lengths = sparse_lengths[:, t].long()
                offsets = torch.cumsum(lengths, 0) - lengths
                weights = self.psw(ids).reshape(-1) if self.psw is not None else None
                pooled.append(bag(ids, offsets, per_sample_weights=weights))
        else:
            ids = sparse_indices.reshape(n, T)
            pooled = [bag(ids[:, t:t + 1]) for t, bag in enumerate(self.bags)]
        return torch.sigmoid(self.top(torch.cat([dense_features, *pooled], 1)))


def export(model: nn.Module, path, dynamo: bool) -> onnx.ModelProto:
    example = (torch.randn(4, D), torch.ones(4, T, dtype=torch.int32), torch.randint(0, R, (4 * T,)))
    for noisy in ("torch.onnx", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if dynamo:
        batch, ids = torch.export.Dim("batch", min=2, max=4096), torch.export.Dim("ids", min=2, max=1 << 20)
        torch.onnx.export(model, example, str(path), dynamo=True, verbose=False, input_names=NAMES,
                          output_names=["scores"], dynamic_shapes={
                              "dense_features": {0: batch}, "sparse_lengths": {0: batch},
                              "sparse_indices": {0: ids if model.jagged else T * batch}})
    else:
        torch.onnx.export(model, example, str(path), dynamo=False, input_names=NAMES, output_names=["scores"],
                          dynamic_axes={n: {0: n} for n in [*NAMES, "scores"]})
    return onnx.load(str(path))


def request(items: int, seed: int, jagged: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=(items, T)) if jagged else np.ones((items, T))
    if jagged:
        lengths[0] = 0  # an item with every bag empty
    return {"dense_features": rng.standard_normal((items, D)).astype(np.float32),
            "sparse_lengths": lengths.astype(np.int32),
            "sparse_indices": rng.integers(0, R, size=int(lengths.sum())).astype(np.int64)}


def ops(graph: onnx.GraphProto) -> set[str]:
    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found |= ops(attr.g)
    return found


def run_split(split, feed: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort
    host = ort.InferenceSession(split.host.SerializeToString(), providers=["CPUExecutionProvider"])
    dense = ort.InferenceSession(split.dense.SerializeToString(), providers=["CPUExecutionProvider"])
    boundary = dict(zip(split.boundary, host.run(split.boundary, {n: feed[n] for n in split.host_inputs})))
    env = {**feed, **boundary}
    return dense.run(["scores"], {n: env[n] for n in split.dense_inputs})[0]


CASES = [  # (exporter, mode, jagged, weighted): every exporter x form x mode, and weights in both exporters
    ("legacy", "sum", False, False), ("legacy", "mean", True, False), ("legacy", "sum", True, True),
    ("dynamo", "mean", False, False), ("dynamo", "sum", True, False), ("dynamo", "mean", True, False),
    ("dynamo", "sum", True, True),
]


@pytest.mark.parametrize(("exporter", "mode", "jagged", "weighted"), CASES,
                         ids=["-".join([c[0], c[1], "jagged" if c[2] else "onehot"] + ["weighted"] * c[3])
                              for c in CASES])
def test_a_loop_bag_is_a_host_lookup_and_the_cards_get_only_card_ops(tmp_path, caplog, exporter, mode, jagged,
                                                                     weighted) -> None:
    model = Bags(mode, jagged, weighted).eval()
    exported = export(model, tmp_path / "bags.onnx", dynamo=exporter == "dynamo")
    assert "Loop" in ops(exported.graph)  # what torch writes, or this test tests nothing
    with caplog.at_level(logging.WARNING):
        split = cut_onnx(exported, pooling=None if jagged else 1, where="bags.onnx")
    dense_ops_used = ops(split.dense.graph) - {"Constant"}
    assert dense_ops_used <= CARD_OPS, dense_ops_used - CARD_OPS
    assert not [r for r in caplog.records if "card op set" in r.getMessage()]
    bag_lookups = [lk for lk in split.lookups if lk.rows == R and lk.dim == E]
    assert len(bag_lookups) == T and all(lk.pooling for lk in bag_lookups), split.lookups
    assert all(split.layouts[t].rows_per_item == 1 for t in split.boundary), split.layouts  # pooled per item
    for items, seed in ((1, 1), (7, 2), (64, 3)):
        feed = request(items, seed, jagged and items > 1)
        with torch.no_grad():
            want = model(*(torch.from_numpy(feed[n]) for n in NAMES)).numpy()
        np.testing.assert_allclose(run_split(split, feed), want, rtol=0, atol=1e-5)


def test_an_unrecognised_bag_is_named_loudly_with_the_ops_left_on_the_cards(tmp_path, caplog) -> None:
    exported = export(Bags("max", jagged=False).eval(), tmp_path / "max.onnx", dynamo=True)
    with caplog.at_level(logging.WARNING):
        split = cut_onnx(exported, pooling=1, where="max.onnx")
    warned = [r.getMessage() for r in caplog.records if "control-flow ops" in r.getMessage()]
    assert warned and "max.onnx" in warned[0] and "'Loop'" in warned[0], caplog.text
    assert "Loop" in ops(split.dense.graph)
    # The legacy exporter gathers inside the Loop: no lookup outside it, and the refusal says where they are.
    legacy = export(Bags("max", jagged=False).eval(), tmp_path / "max_legacy.onnx", dynamo=False)
    with pytest.raises(ValueError, match=r"no embedding lookup found .*control-flow nodes .*Loop.* max is not"):
        cut_onnx(legacy, pooling=1, where="max_legacy.onnx")
