"""The sparse/dense cut on torch.export graphs: built-in models, models written here, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from sixfold import models
from sixfold.models import DENSE, INDICES, LENGTHS
from sixfold.partitioner.frontends.torch_frontend import export_model
from sixfold.partitioner.cut.graph_cut import cut_graph
from sixfold.partitioner.cut.sparse_dense import DENSE as DENSE_LABEL, HOST, assign_sparse_dense, is_embedding_lookup


def _split(model: nn.Module, example: tuple[torch.Tensor, ...]):
    gm = export_model(model, example).module()
    labels = assign_sparse_dense(gm.graph)
    return gm, labels, cut_graph(gm, labels, ["scores"])


def _run_split(split, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        boundary = dict(zip(split.boundary, split.host(*[inputs[n] for n in split.host_inputs])))
        env = {**inputs, **boundary}
        return split.dense(*[env[n] for n in split.dense_inputs])[0]


def _named(x: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    return dict(zip((DENSE, LENGTHS, INDICES), x))


@pytest.mark.parametrize("name", ["rm1", "rm2", "rm3", "dlrm-mlperf", "dcnv2-mlperf"])
def test_split_output_equals_unsplit_for_builtin_models(name: str) -> None:
    model = models.build(name, max_rows=100)
    gm, labels, split = _split(model, models.example_inputs(model.config, 4))
    for items in (1, 9, 33):
        x = models.example_inputs(model.config, items, seed=items)
        torch.testing.assert_close(_run_split(split, _named(x)), model(*x), rtol=0, atol=1e-5)
    assert split.host_inputs == [LENGTHS, INDICES]
    assert DENSE in split.dense_inputs and all(b.startswith("host_") for b in split.boundary)


class OneHotConcatModel(nn.Module):
    """Not from the zoo: one-hot lookups with aten.embedding, concatenated (no dot interaction)."""

    def __init__(self, tables: int = 3, rows: int = 20, dim: int = 4, dense: int = 5) -> None:
        super().__init__()
        self.tables, self.rows = tables, rows
        self.weight = nn.Parameter(torch.randn(tables * rows, dim), requires_grad=False)
        self.register_buffer("offsets", torch.arange(tables) * rows)
        self.mlp = nn.Sequential(nn.Linear(dense + tables * dim, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        ids = sparse_indices.view(-1, self.tables) + self.offsets
        emb = F.embedding(ids, self.weight).flatten(1)
        return torch.sigmoid(self.mlp(torch.cat([dense_features, emb], dim=1)))


def _one_hot_inputs(items: int, tables: int = 3, rows: int = 20, dense: int = 5):
    g = torch.Generator().manual_seed(items)
    return (torch.randn(items, dense, generator=g), torch.ones(items, tables, dtype=torch.int32),
            torch.randint(0, rows, (items * tables,), generator=g))


def test_a_model_written_here_with_aten_embedding_is_cut_at_the_lookup() -> None:
    model = OneHotConcatModel().eval()
    gm, labels, split = _split(model, _one_hot_inputs(4))
    lookups = [n for n in gm.graph.nodes if is_embedding_lookup(n)]
    assert lookups and all(labels[n] == HOST for n in lookups)
    for items in (1, 6, 40):
        x = _one_hot_inputs(items)
        torch.testing.assert_close(_run_split(split, _named(x)), model(*x), rtol=0, atol=1e-5)


class MaskedBagsModel(nn.Module):
    """Not from the zoo: per-table ids picked by a boolean mask (data-dependent sizes, so
    torch.export adds runtime asserts on the host tensors' lengths), mean-pooled bags."""

    def __init__(self, rows: tuple[int, ...] = (30, 10, 50), dim: int = 4, dense: int = 5) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="mean") for r in rows)
        self.mlp = nn.Sequential(nn.Linear(dense + len(rows) * dim, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n, t = sparse_lengths.shape
        table_of_id = torch.repeat_interleave(torch.arange(t).repeat(n), sparse_lengths.reshape(-1).long())
        pooled = []
        for k, bag in enumerate(self.bags):
            lengths = sparse_lengths[:, k].long()
            pooled.append(bag(sparse_indices[table_of_id == k], torch.cumsum(lengths, 0) - lengths))
        return torch.sigmoid(self.mlp(torch.cat([dense_features, *pooled], dim=1)))


def _masked_inputs(items: int):
    g = torch.Generator().manual_seed(items)
    lengths = torch.randint(1, 4, (items, 3), generator=g, dtype=torch.int32)
    ids = torch.cat([torch.randint(0, (30, 10, 50)[k], (int(lengths[i, k]),), generator=g)
                     for i in range(items) for k in range(3)])
    return torch.randn(items, 5, generator=g), lengths, ids


def test_shape_checks_on_host_tensors_stay_on_the_host() -> None:
    """The dense part gets the pooled embeddings, never the ids only to assert their length."""
    model = MaskedBagsModel().eval()
    gm, labels, split = _split(model, _masked_inputs(4))
    asserts = [n for n in gm.graph.nodes if "assert" in str(n.target)]
    assert asserts, "expected torch.export runtime asserts in this graph"
    assert INDICES not in split.dense_inputs and LENGTHS not in split.dense_inputs, split.dense_inputs
    for items in (1, 7, 30):
        x = _masked_inputs(items)
        torch.testing.assert_close(_run_split(split, _named(x)), model(*x), rtol=0, atol=1e-5)


def test_every_node_is_in_exactly_one_partition_and_edges_run_host_to_dense() -> None:
    model = models.build("rm2", max_rows=50)
    gm, labels, split = _split(model, models.example_inputs(model.config, 4))
    assert not set(split.host_nodes) & set(split.dense_nodes)
    computing = {n.name for n in gm.graph.nodes if n.op != "output" and not str(n.target).startswith("_guards")}
    assert set(split.host_nodes) | set(split.dense_nodes) == computing
    for node in gm.graph.nodes:
        if labels.get(node) == HOST:
            assert all(labels.get(i) != DENSE_LABEL for i in node.all_input_nodes)


def test_a_graph_without_lookups_is_refused() -> None:
    class DenseOnly(nn.Module):
        def forward(self, dense_features, sparse_lengths, sparse_indices):
            return torch.sigmoid(dense_features.sum(1, keepdim=True))
    gm = export_model(DenseOnly(), _one_hot_inputs(3)).module()
    with pytest.raises(ValueError, match="no embedding lookup"):
        assign_sparse_dense(gm.graph)


def test_the_cutter_does_not_change_its_input() -> None:
    model = models.build("rm1", max_rows=50)
    gm = export_model(model, models.example_inputs(model.config, 4)).module()
    before = str(gm.graph)
    cut_graph(gm, assign_sparse_dense(gm.graph), ["scores"])
    assert str(gm.graph) == before


@st.composite
def small_dlrm_configs(draw) -> models.ModelConfig:
    tables = draw(st.integers(1, 4))
    dim = draw(st.sampled_from([2, 4, 8]))
    dense = draw(st.integers(1, 6))
    hidden = draw(st.lists(st.integers(2, 12), max_size=2))
    top = draw(st.lists(st.integers(2, 12), max_size=2))
    interaction = draw(st.sampled_from(["dot", "dcn"]))
    return models.ModelConfig(
        name="random", table_rows=tuple(draw(st.lists(st.integers(2, 40), min_size=tables, max_size=tables))),
        embedding_dim=dim, pooling=tuple(draw(st.lists(st.integers(1, 5), min_size=tables, max_size=tables))),
        bottom_mlp=(dense, *hidden, dim), top_mlp=(*top, 1), interaction=interaction,
        dcn_layers=draw(st.integers(1, 2)) if interaction == "dcn" else 0,
        dcn_rank=draw(st.integers(1, 4)) if interaction == "dcn" else 0)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=small_dlrm_configs(), seed=st.integers(0, 100), items=st.integers(1, 20))
def test_property_split_equals_unsplit_on_random_recommendation_graphs(config, seed, items) -> None:
    model = models.DLRM(config, seed=seed).eval()
    gm, labels, split = _split(model, models.example_inputs(config, 3, seed=seed))
    assert not set(split.host_nodes) & set(split.dense_nodes)
    x = models.example_inputs(config, items, seed=seed + 1)
    torch.testing.assert_close(_run_split(split, _named(x)), model(*x), rtol=0, atol=1e-5)
