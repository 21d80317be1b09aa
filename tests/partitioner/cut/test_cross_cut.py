"""Sizes and layouts across the partition cut (issue 31, items 1 and 2): a batch read on both sides, pooling
after a lookup, and pooling that cannot move, each partitioned from a real torch.export and run at 1..64 items."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_model

T, D, E, R = 4, 5, 8, 50


class OneHot(nn.Module):
    """The 20-line repro: ``n`` read on the host side (offsets) and on the card side (``view(n, -1, E)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.ModuleList(nn.EmbeddingBag(R, E, mode="sum") for _ in range(T))
        self.bot = nn.Linear(D, E)
        self.top = nn.Linear((T + 1) * E, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n = dense_features.shape[0]
        ids = sparse_indices.view(n, T)
        offsets = torch.arange(n, dtype=torch.int64)
        ly = [self.emb[t](ids[:, t].contiguous(), offsets) for t in range(T)]
        z = torch.cat([self.bot(dense_features), *ly], dim=1).view(n, -1, E)
        return torch.sigmoid(self.top(z.reshape(n, -1)))


class IndexAddPool(nn.Module):
    """nn.Embedding, then ``zeros_like(x).index_add`` pools the per-id rows per item."""

    def __init__(self, pool_last: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(R, E)
        self.bot = nn.Linear(D, E)
        self.top = nn.Linear(2 * E, 1)
        self.per_id = nn.Linear(E, 1)
        self.pool_last = pool_last

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        x = self.bot(dense_features)
        item_of_id = torch.arange(sparse_lengths.shape[0]).repeat_interleave(sparse_lengths.sum(1))
        rows = self.emb(sparse_indices)
        if self.pool_last:  # the pooling is the model's last op: it cannot move without the output
            return torch.zeros_like(x[:, :1]).index_add(0, item_of_id, torch.sigmoid(self.per_id(rows)))
        pooled = torch.zeros_like(x).index_add(0, item_of_id, rows)
        return torch.sigmoid(self.top(torch.cat([x, pooled], 1)))


def _request(items: int, seed: int, one_hot: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.ones(items, T, dtype=torch.int32) if one_hot
               else torch.randint(0, 4, (items, T), generator=g, dtype=torch.int32))
    return {"dense_features": torch.randn(items, D, generator=g), "sparse_lengths": lengths,
            "sparse_indices": torch.randint(0, R, (int(lengths.sum()),), generator=g)}


def _partition(model: nn.Module, one_hot: bool, **options):
    example = _request(4, 0, one_hot)
    batch = torch.export.Dim("batch", min=1, max=4096)
    ids = batch * T if one_hot else torch.export.Dim("ids", min=1, max=1 << 20)
    program = torch.export.export(model.eval(), tuple(example.values()), dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch}, "sparse_indices": {0: ids}})
    return partition_model("m", program, lambda rows: _request(rows, rows, one_hot), cards=[load_spec("m2-card")] * 2,
                           host=load_spec("host-cpu"), compile=False, **options)


def _run_split(partitioned, request: dict[str, torch.Tensor]) -> torch.Tensor:
    split = partitioned.split
    with torch.inference_mode():
        boundary = dict(zip(split.boundary, split.host(*[request[n] for n in split.host_inputs])))
        env = {**request, **boundary}
        return split.dense(*[env[n] for n in split.dense_inputs])[0]


def _layouts(info) -> dict[str, tuple[int | None, str | None]]:
    return {t.name: (t.rows_per_item, t.ragged_by) for t in [*info.inputs, *info.outputs]}


def test_a_batch_read_on_both_sides_is_recomputed_by_the_dense_side_from_its_own_inputs() -> None:
    model = OneHot()
    partitioned = _partition(model, one_hot=True)  # was: AttributeError: 'int' object has no attribute 'numel'
    split = partitioned.split
    assert all(isinstance(v, torch.Tensor) for v in
               split.host(*[_request(3, 3, True)[n] for n in split.host_inputs]))  # no size crosses
    reads = [n for n in split.dense.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert reads and all(n.args[0].op == "placeholder" for n in reads)
    for items in (1, 2, 3, 7, 64):
        request = _request(items, items, True)
        with torch.inference_mode():
            torch.testing.assert_close(_run_split(partitioned, request), model(**request))
    dense = partitioned.plan.partition("dense")
    assert dense.unsplittable == "" and all(k == 1 for k, _ in _layouts(dense).values())
    assert partitioned.artifacts["dense"].layouts["host_embedding_bag"].rows_per_item == 1
    consumed = {t.name: t.consumed for t in dense.inputs}
    assert consumed["sparse_lengths"] is False and consumed["dense_features"] is True  # read by no dense node
    assert _layouts(partitioned.plan.partition("sparse"))["sparse_indices"] == (T, None)


def test_a_size_crossing_pipeline_stages_is_recomputed_in_each_stage() -> None:
    from sixfold.partitioner.cut.pipeline import compute_nodes, run_stages, split_stages
    model = OneHot()
    partitioned = _partition(model, one_hot=True)
    split = partitioned.split
    nodes = {n.name: n for n in split.dense.graph.nodes}
    units = [nodes[name] for name in compute_nodes(split.dense)]
    crossing = [c for c in range(1, len(units)) if any(  # cuts after n is read and before the view that needs it
        u.target is torch.ops.aten.sym_size.int for u in units[:c]) and any(
        u.target is torch.ops.aten.view.default for u in units[c:])]
    assert crossing, [u.name for u in units]
    request = _request(7, 7, True)
    with torch.inference_mode():
        want = model(**request)
        env = {**request, **dict(zip(split.boundary, split.host(*[request[n] for n in split.host_inputs])))}
    for cut in crossing:  # was: ValueError ... crosses the cut and is not a tensor (SymInt)
        stages = split_stages(split.dense, [cut], ["scores"])
        _, final = run_stages(stages, {n: env[n] for n in split.dense_inputs})
        torch.testing.assert_close(final["scores"], want)
    staged = _partition(model, one_hot=True, strategy="pipeline", stages=2)
    for name in staged.plan.dense_stages():
        info = staged.plan.partition(name)
        assert info.unsplittable == "" and all(k is not None for k, _ in _layouts(info).values()), _layouts(info)
        assert staged.artifacts[name].layouts.keys() == {t.name for t in [*info.inputs, *info.outputs]}


def test_pooling_after_a_lookup_moves_to_the_host_and_the_bottom_mlp_stays_on_the_cards() -> None:
    model = IndexAddPool()
    partitioned = _partition(model, one_hot=False)
    split = partitioned.split
    assert split.boundary == ["host_index_add"]
    assert any(n.target is torch.ops.aten.linear.default for n in split.dense.graph.nodes)
    assert sum(n.target is torch.ops.aten.linear.default for n in split.host.graph.nodes) == 0  # bot stays
    dense = partitioned.plan.partition("dense")
    assert dense.unsplittable == "" and _layouts(dense)["host_index_add"] == (1, None)
    assert _layouts(partitioned.plan.partition("sparse"))["sparse_indices"] == (None, "sparse_lengths")
    for items in (1, 2, 3, 7, 64):
        request = _request(items, items, False)
        with torch.inference_mode():
            torch.testing.assert_close(_run_split(partitioned, request), model(**request))


def test_pooling_that_cannot_move_leaves_batches_whole_and_the_plan_says_why() -> None:
    model = IndexAddPool(pool_last=True)
    partitioned = _partition(model, one_hot=False)
    dense = partitioned.plan.partition("dense")
    assert "'host_embedding' is ragged (one row per id, counted by sparse_lengths)" in dense.unsplittable
    assert "cannot move to the host without the model's output" in dense.unsplittable
    assert partitioned.artifacts["dense"].layouts["host_embedding"].ragged_by == "sparse_lengths"
    for items in (1, 7, 64):
        request = _request(items, items, False)
        with torch.inference_mode():
            torch.testing.assert_close(_run_split(partitioned, request), model(**request))


def test_a_size_is_rebuilt_from_any_dimension_that_is_a_multiple_of_it() -> None:
    from torch import fx

    from sixfold.partitioner.cut.sizes import SizeRebuilder, UnrecoverableSize
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(OneHot().eval(), tuple(_request(3, 0, True).values()), dynamic_shapes={
        "dense_features": {0: batch}, "sparse_lengths": {0: batch}, "sparse_indices": {0: batch * T}})
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    n = nodes["dense_features"].meta["val"].shape[0]
    graph = fx.Graph()
    ids = graph.placeholder("sparse_indices")
    ids.meta = dict(nodes["sparse_indices"].meta)  # [4 * n]: n comes back as its length // 4
    graph.output(SizeRebuilder(graph, [ids]).build(n.node.expr + 1, "n + 1"))
    assert fx.GraphModule(torch.nn.Module(), graph)(torch.zeros(7 * T, dtype=torch.int64)) == 8
    with pytest.raises(UnrecoverableSize, match="no input of the dense side"):
        SizeRebuilder(fx.Graph(), []).build(n.node.expr, "n")


class TotalIds(nn.Module):
    """The host reads the id count for its lookup; the dense side reads it too (no dense input carries it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.bag = nn.EmbeddingBag(R, E, mode="sum")
        self.top = nn.Linear(T * E + 1, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        m = sparse_indices.shape[0]
        per_bag = sparse_lengths.reshape(-1).long()
        pooled = self.bag(sparse_indices[:m], torch.cumsum(per_bag, 0) - per_bag).reshape(-1, T * E)
        ids_seen = torch.full((dense_features.shape[0], 1), m, dtype=torch.float32) / 100.0
        return torch.sigmoid(self.top(torch.cat([pooled, ids_seen], 1)))


def test_a_size_no_dense_input_carries_is_passed_as_an_explicit_input() -> None:
    model = TotalIds()
    partitioned = _partition(model, one_hot=False)
    split = partitioned.split
    assert "sparse_indices" in split.dense_inputs  # its length is the size the dense side needs
    dense = partitioned.plan.partition("dense")
    assert "'sparse_indices' is ragged" in dense.unsplittable  # a batch-wide count: only whole batches
    for items in (1, 2, 3, 7, 64):
        request = _request(items, items, False)
        with torch.inference_mode():
            torch.testing.assert_close(_run_split(partitioned, request), model(**request))
