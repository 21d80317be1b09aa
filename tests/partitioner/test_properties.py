"""Partition invariants on random recommendation models (hypothesis).

Each example builds a small recommendation model here (1-6 tables, random rows,
dims and pooling, bottom/top MLPs of random widths and depths, dot or concat
interaction), exports it with torch.export, cuts sparse from dense, and places
the dense part with ``replicate`` and with ``pipeline`` on cards of random
memory. Whatever the draw: every node is in exactly one partition, no edge
runs backwards between partitions, every partition fits its card, and host +
stages compute what the model computes (<= 1e-5). A plan the policy refuses
must be impossible, and say so with numbers.

The pieces are the partitioner's own (export, cut, node costs, strategy,
stage surgery); ONNX export of each stage is left to test_pipeline.py, where
it is checked once rather than per example, to keep this under a minute.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from sixfold.backends.spec_catalog import load_spec
from sixfold.models import DENSE, INDICES, LENGTHS
from sixfold.partitioner.pricing.cost import PartitionCost, module_param_bytes
from sixfold.partitioner.frontends.torch_frontend import export_model
from sixfold.partitioner.cut.graph_cut import cut_graph
from sixfold.partitioner.cut.pipeline import compute_nodes, node_costs, run_stages, split_stages
from sixfold.partitioner.plan import DeviceInfo
from sixfold.partitioner.cut.sparse_dense import assign_sparse_dense
from sixfold.partitioner.placement.strategy import ACTIVATION_HEADROOM, PlanError, pipeline, replicate

HEADROOM = ACTIVATION_HEADROOM


class RandomRec(nn.Module):
    """Table-batched sum-pooled embeddings, bottom MLP, dot or concat interaction, top MLP, sigmoid."""

    def __init__(self, rows: list[int], dim: int, dense: int, bottom: list[int], top: list[int],
                 interaction: str, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tables, self.dim, self.interaction = len(rows), dim, interaction
        self.weight = nn.Parameter(torch.randn(sum(rows), dim, generator=g) * 0.3, requires_grad=False)
        self.register_buffer("offsets", torch.tensor([0, *rows[:-1]]).cumsum(0))
        self.bottom = self._mlp([dense, *bottom, dim], g)
        if interaction == "dot":
            features = self.tables + 1
            i, j = torch.tril_indices(features, features, offset=-1)
            self.register_buffer("pairs", i * features + j)
            top_in = dim + features * (features - 1) // 2
        else:
            top_in = dim * (self.tables + 1)
        self.top = self._mlp([top_in, *top, 1], g, last_relu=False)

    @staticmethod
    def _mlp(widths: list[int], g: torch.Generator, last_relu: bool = True) -> nn.Sequential:
        layers: list[nn.Module] = []
        for k, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            linear = nn.Linear(a, b)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(b, a, generator=g) / math.sqrt(a))
                linear.bias.copy_(torch.randn(b, generator=g) * 0.1)
            layers += [linear, nn.ReLU()] if last_relu or k < len(widths) - 2 else [linear]
        return nn.Sequential(*layers)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        lengths = sparse_lengths.reshape(-1).to(torch.int64)
        starts = torch.cumsum(lengths, 0) - lengths
        bag_offsets = (torch.zeros_like(sparse_lengths, dtype=torch.int64) + self.offsets).reshape(-1)
        ids = sparse_indices + torch.repeat_interleave(bag_offsets, lengths, output_size=sparse_indices.shape[0])
        emb = F.embedding_bag(ids, self.weight, starts, mode="sum").view(-1, self.tables, self.dim)
        x = self.bottom(dense_features)
        if self.interaction == "dot":
            stacked = torch.cat([x.unsqueeze(1), emb], dim=1)
            dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)
            top_in = torch.cat([x, torch.index_select(dots, 1, self.pairs)], dim=1)
        else:
            top_in = torch.cat([x, emb.flatten(1)], dim=1)
        return torch.sigmoid(self.top(top_in))


@st.composite
def random_models(draw) -> tuple[RandomRec, dict]:
    tables = draw(st.integers(1, 6))
    shape = dict(
        rows=draw(st.lists(st.integers(2, 60), min_size=tables, max_size=tables)),
        dim=draw(st.sampled_from([2, 4, 8, 16])), dense=draw(st.integers(1, 16)),
        bottom=draw(st.lists(st.integers(2, 48), max_size=3)), top=draw(st.lists(st.integers(2, 48), max_size=3)),
        interaction=draw(st.sampled_from(["dot", "cat"])))
    pooling = draw(st.integers(1, 4))
    return RandomRec(**shape, seed=draw(st.integers(0, 1000))).eval(), {**shape, "pooling": pooling}


def _request(shape: dict, items: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tables, pooling = len(shape["rows"]), shape["pooling"]
    ids = torch.cat([torch.randint(0, shape["rows"][t], (1,), generator=g) for _ in range(items)
                     for t in range(tables) for _ in range(pooling)])
    return {DENSE: torch.randn(items, shape["dense"], generator=g),
            LENGTHS: torch.full((items, tables), pooling, dtype=torch.int32), INDICES: ids}


def _cards(count: int, memory: int) -> list[DeviceInfo]:
    spec = load_spec("m2-card")
    return [DeviceInfo(id=f"card{i}", spec=dataclasses.replace(spec, name="drawn", memory_bytes=memory))
            for i in range(count)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=random_models(), cards=st.integers(1, 6), memory_at=st.floats(0.0, 1.2), items=st.integers(1, 40))
def test_replicate_and_pipeline_keep_the_partition_invariants(drawn, cards, memory_at, items) -> None:
    model, shape = drawn
    small, large = _request(shape, 4, 1), _request(shape, 64, 2)
    gm = export_model(model, tuple(small[n] for n in (DENSE, LENGTHS, INDICES))).module()
    labels = assign_sparse_dense(gm.graph)
    split = cut_graph(gm, labels, ["scores"])
    host_nodes, dense_nodes = set(split.host_nodes), set(split.dense_nodes)
    assert not host_nodes & dense_nodes  # each node in one of the two partitions
    for node in gm.graph.nodes:  # and the host never reads a dense value
        if node.name in host_nodes:
            assert not {i.name for i in node.all_input_nodes} & dense_nodes

    def dense_args(request):
        with torch.inference_mode():
            boundary = dict(zip(split.boundary, split.host(*[request[n] for n in split.host_inputs])))
        env = {**request, **boundary}
        return tuple(env[n] for n in split.dense_inputs)

    costs = node_costs(split.dense, dense_args(small), 4, dense_args(large), 64)
    total = costs.stage_param_bytes(0, len(costs.nodes))
    widest = max(costs.stage_param_bytes(i, i + 1) for i in range(len(costs.nodes)))
    # Card memory from "just the widest node fits" to "more than the whole dense part".
    memory = int((widest + memory_at * (total - widest)) * HEADROOM) + 1
    host = DeviceInfo(id="host", spec=load_spec("host-cpu"))
    devices = _cards(cards, memory)
    request = _request(shape, items, 3)
    with torch.inference_mode():
        expected = model(*[request[n] for n in (DENSE, LENGTHS, INDICES)])

    # replicate: the whole dense part on every card, or a refusal only when it truly does not fit.
    dense_cost = PartitionCost(param_bytes=module_param_bytes(split.dense), flops_per_item=0.0,
                               bytes_per_item=0.0, weight_bytes_per_batch=0)
    if int(dense_cost.param_bytes * HEADROOM) <= memory:
        placed = replicate("sparse", "dense", dense_cost, host, devices)
        assert [p.device for p in placed] == ["host", *(d.id for d in devices)]
    else:
        with pytest.raises(PlanError, match=r"dense partition needs \d.* largest card card0 \(drawn\) has"):
            replicate("sparse", "dense", dense_cost, host, devices)

    # pipeline: contiguous stages that fit, or a refusal that quotes why.
    try:
        choice = pipeline("sparse", "dense", costs, host, devices, batch_rows=64)
    except PlanError as exc:
        needed = re.search(r"needs at least (\d+) pipeline stages .* there are (\d+) cards", str(exc))
        # NOTE: >= : every stage must also hold a learned weight, so a split into exactly `cards` stages by
        # memory alone may still be refused (weightless stages merge into a neighbour)
        assert needed and int(needed[1]) >= cards == int(needed[2]), str(exc)
        assert any(ch.isdigit() for ch in str(exc))
        event("pipeline refused")
        return
    stages = split_stages(split.dense, choice.cuts, ["scores"])
    event(f"{len(stages)} stage(s)")
    assert len(stages) * choice.replicas <= cards and choice.replicas == cards // len(stages)
    placed = [n for s in stages for n in s.nodes]
    assert sorted(placed) == sorted(compute_nodes(split.dense)) and len(placed) == len(set(placed))
    assert set(placed) <= dense_nodes
    stage_of = {n: s.index for s in stages for n in s.nodes}
    for node in split.dense.graph.nodes:  # no edge runs from a later stage to an earlier one
        for source in node.all_input_nodes:
            if node.name in stage_of and source.name in stage_of:
                assert stage_of[source.name] <= stage_of[node.name]
    for stage, weights in zip(stages, choice.stage_param_bytes):
        # whole bytes, as the strategy counts them (112 B x 1.1 = 123.2 fits 123: hypothesis found it)
        assert module_param_bytes(stage.module) == weights and int(weights * HEADROOM) <= memory
    _, outputs = run_stages(stages, dict(zip(split.dense_inputs, dense_args(request))))
    torch.testing.assert_close(outputs["scores"], expected, rtol=0, atol=1e-5)
